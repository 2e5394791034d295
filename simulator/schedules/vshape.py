"""V-shape schedules with controllable memory (Qi et al., NeurIPS 2024): V-Half and V-Min.

Same V placement as ZB-V (device r holds stages r and 2p-1-r). Every microbatch
repeats one "building block" shifted by 6 unit slots per microbatch; the block's
slot offsets (docs/schedules.md section 6, from sail-sg's ``stable_pattern_v_half`` /
``stable_pattern_v_min``) fix how long each activation lives, hence the peak
memory: (p+2)//2 device-stages of activations for V-Half, (p+4)//3 for V-Min.
sail-sg's ``zbv_greedy`` then re-packs the warm-up and cool-down into free slots
under that peak (``vhalf_repack``); each device's op order is its slots sorted,
and the timing model squeezes out the empty slots.
"""

from __future__ import annotations

from collections.abc import Callable

from pipescope.simulator.ir import Action, Schedule, v_placement
from pipescope.simulator.schedules.common import check_sizes, v_chunks
from pipescope.simulator.schedules.vhalf_repack import LANE_KINDS, Device, greedy_repack, stage_of

PERIOD = 6  # unit slots per microbatch per device: F and I of both chunks, plus two W's

Pattern = Callable[[int, int], tuple[int, int, int, int]]


def v_half_block(i: int, p: int) -> tuple[int, int, int, int]:
    """Slot offsets of one microbatch on device i for V-Half (delta = 3 when p is even)."""
    delta = 3 if p % 2 == 0 else 0
    return (2 * i, 3 * p - i - 2, 3 * p + delta + 2 * i - 1, 6 * p + delta - i - 2)


def v_min_block(i: int, p: int) -> tuple[int, int, int, int]:
    """Slot offsets of one microbatch on device i for V-Min (delta = 2 when 3 divides p)."""
    delta = 2 if p % 3 == 0 else 0
    return (i, 2 * p - i - 1, 2 * p + delta + i, 4 * p + delta - i - 1)


def block_lanes(i: int, p: int, m: int, pattern: Pattern) -> list[list[int]]:
    """Device i's F/I slots for all m microbatches, per lane (F0, F1, I1, I0): the block shifted by 6 each."""
    return [list(range(offset, offset + PERIOD * m, PERIOD)) for offset in pattern(i, p)]


def device_actions(d: int, p: int, device: Device) -> list[Action]:
    """The device's ops in slot order, each lane's index being its microbatch."""
    slots = sorted(device.occupant.items())
    return [Action(stage_of(d, p, LANE_KINDS[lane][1]), LANE_KINDS[lane][0], index) for _, (lane, index) in slots]


def device_orders(p: int, m: int, pattern: Pattern) -> list[list[Action]]:
    """Every device's ops in slot order: blocks, then sail-sg's greedy re-pack with the W's placed."""
    devices = greedy_repack([block_lanes(i, p, m, pattern) for i in range(p)], p, m)
    return [device_actions(d, p, device) for d, device in enumerate(devices)]


def _v_schedule(name: str, pattern: Pattern, p: int, m: int, chunks: int, recompute: bool) -> Schedule:
    v_chunks(name, chunks)
    check_sizes(name, p, m, min_m=p)
    lists = tuple(tuple(order) for order in device_orders(p, m, pattern))
    return Schedule(name, p, m, v_placement(p), lists, recompute=recompute,
                    weight_versions=(1,) * p)


def v_half(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """V-Half: half of 1F1B's activation memory, (p+2)//2 device-stages on every device."""
    return _v_schedule("v-half", v_half_block, p, m, chunks, recompute)


def v_min(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """V-Min: a third of 1F1B's activation memory, (p+4)//3 device-stages on every device."""
    return _v_schedule("v-min", v_min_block, p, m, chunks, recompute)
