"""V-shape schedules with controllable memory (Qi et al., NeurIPS 2024): V-Half and V-Min.

Same V placement as ZB-V (device r holds stages r and 2p-1-r). Every microbatch
repeats one "building block" shifted by 6 unit slots per microbatch; the block's
slot offsets (docs/schedules.md section 6, from sail-sg's ``stable_pattern_v_half`` /
``stable_pattern_v_min``) fix how long each activation lives, hence the peak
memory: (p+2)//2 device-stages of activations for V-Half, (p+4)//3 for V-Min.
As in sail-sg's ``zbv_greedy``: W's take the first free slot after their I; the
warm-up and cool-down ops then move into earlier free slots where that keeps every
device under the block's peak memory (F +1, W -1); the W's are placed afresh; each
device's op order is its slots sorted, and the timing model squeezes out the empty
slots. (sail-sg's second, W-less re-pack of the cool-down is left out.)
"""

from __future__ import annotations

from collections.abc import Callable, Container

from pipescope.simulator.ir import Action, ActionKind, Schedule, producers, v_placement
from pipescope.simulator.schedules.common import check_sizes, v_chunks

PERIOD = 6  # unit slots per microbatch per device: F and I of both chunks, plus two W's
# Block entries, in order: F of chunk 0, F of chunk 1, I of chunk 1, I of chunk 0.
BLOCK_KINDS = ((ActionKind.F, 0), (ActionKind.F, 1), (ActionKind.I, 1), (ActionKind.I, 0))
MEMORY_DELTA = {ActionKind.F: 1, ActionKind.I: 0, ActionKind.W: -1}

Pattern = Callable[[int, int], tuple[int, int, int, int]]


def v_half_block(i: int, p: int) -> tuple[int, int, int, int]:
    """Slot offsets of one microbatch on device i for V-Half (delta = 3 when p is even)."""
    delta = 3 if p % 2 == 0 else 0
    return (2 * i, 3 * p - i - 2, 3 * p + delta + 2 * i - 1, 6 * p + delta - i - 2)


def v_min_block(i: int, p: int) -> tuple[int, int, int, int]:
    """Slot offsets of one microbatch on device i for V-Min (delta = 2 when 3 divides p)."""
    delta = 2 if p % 3 == 0 else 0
    return (i, 2 * p - i - 1, 2 * p + delta + i, 4 * p + delta - i - 1)


def stage_of(i: int, p: int, chunk: int) -> int:
    """Device i's chunk 0 is stage i, its chunk 1 is stage 2p-1-i (the V)."""
    return i if chunk == 0 else 2 * p - 1 - i


def block_slots(i: int, p: int, m: int, pattern: Pattern) -> dict[int, Action]:
    """F's and I's of all m microbatches on device i, keyed by slot (block shifted by 6 per microbatch)."""
    slots = {}
    for offset, (kind, chunk) in zip(pattern(i, p), BLOCK_KINDS):
        for mb in range(m):
            slots[offset + PERIOD * mb] = Action(stage_of(i, p, chunk), kind, mb)
    return slots


def place_weight_grads(slots: dict[int, Action]) -> dict[int, Action]:
    """Give each I's W the first free slot after it, chunk-1 W's first, in microbatch order (sail-sg's put_w)."""
    placed = dict(slots)
    pending: dict[int, list[Action]] = {}  # stage -> W's waiting for a slot, oldest first
    slot, last = 0, max(slots)
    while slot <= last or any(pending.values()):
        action = slots.get(slot)
        if action is None:
            waiting = [stage for stage in sorted(pending, reverse=True) if pending[stage]]
            if waiting:
                placed[slot] = pending[waiting[0]].pop(0)
        elif action.kind is ActionKind.I:
            pending.setdefault(action.stage, []).append(Action(action.stage, ActionKind.W, action.microbatch))
        slot += 1
    return placed


def prerequisites(action: Action, p: int, present: Container[Action]) -> list[Action]:
    """Ops that must hold an earlier slot: the producers (``simulator.ir.producers``, the one dependency rule, over
    the V's stages 0..2p-1) and the same op of the previous microbatch (each op kind keeps microbatch order)."""
    before = [Action(action.stage, action.kind, action.microbatch - 1)] if action.microbatch > 0 else []
    return before + producers(action, 2 * p, present)


def memory_levels(slots: dict[int, Action], length: int) -> list[int]:
    """Activations held after each slot, counting one from an F until its W (sail-sg's mem_of_stage)."""
    level, levels = 0, []
    for slot in range(length):
        level += MEMORY_DELTA[slots[slot].kind] if slot in slots else 0
        levels.append(level)
    return levels


def earliest_slot(slots: dict[int, Action], levels: list[int], low: int, now: int, delta: int, cap: int) -> int:
    """The earliest free slot in [low, now) an op adding ``delta`` can move to without passing ``cap``."""
    best, peak = now, float("-inf")
    for slot in range(now - 1, low - 1, -1):
        peak = max(peak, levels[slot])
        if peak + delta > cap:
            break  # the op would be held over this slot too, and earlier slots only add more
        if slot not in slots:
            best = slot
    return best


def compact_edges(table: list[dict[int, Action]], p: int, m: int) -> None:
    """Move warm-up and cool-down ops (outside device 0's first I0 .. last F0) into earlier free slots.

    Ops are visited in slot order, so their prerequisites are already placed; the
    steady state between keeps the block's slots, as in sail-sg's ``reorder``.
    """
    where = {a: (slot, d) for d, slots in enumerate(table) for slot, a in slots.items()}
    length = max(slot for slot, _ in where.values()) + 1
    levels = [memory_levels(slots, length) for slots in table]
    cap = max(max(level) for level in levels)
    steady_from, steady_to = where[Action(0, ActionKind.I, 0)], where[Action(0, ActionKind.F, m - 1)]
    for action in sorted(where, key=where.__getitem__):
        now, d = where[action]
        if steady_from <= (now, d) <= steady_to:
            continue
        low = max((where[a][0] + 1 for a in prerequisites(action, p, where)), default=0)
        slot = earliest_slot(table[d], levels[d], low, now, MEMORY_DELTA[action.kind], cap)
        if slot < now:
            table[d][slot] = table[d].pop(now)
            levels[d][slot:now] = [level + MEMORY_DELTA[action.kind] for level in levels[d][slot:now]]
            where[action] = (slot, d)


def device_orders(p: int, m: int, pattern: Pattern) -> list[list[Action]]:
    """Every device's ops in slot order: blocks, W's, edge compaction, then the W's placed afresh."""
    table = [place_weight_grads(block_slots(i, p, m, pattern)) for i in range(p)]
    compact_edges(table, p, m)
    orders = []
    for slots in table:
        placed = place_weight_grads({s: a for s, a in slots.items() if a.kind is not ActionKind.W})
        orders.append([placed[s] for s in sorted(placed)])
    return orders


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
