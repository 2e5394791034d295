"""Bounds a schedule's result cannot beat, from its order and its stage costs alone (no replay).

The planner (``experiments/plan.py``, docs/planner.md) prunes with them before it simulates anything, so both must
be true bounds, never estimates:

- **busy time**: a device cannot finish an iteration faster than the compute it runs in one, so the iteration
  time is at least the busiest device's compute per iteration, and the throughput at most samples over that;
- **all-reduce**: with w replicas, an iteration cannot be shorter than its gradient all-reduce's bytes take on
  the busiest replica group of the idle network;
- **a replay with each transfer alone**: a flush schedule's iteration is no shorter than one replica's replay in
  which every transfer takes what it takes on the otherwise idle network and every collective takes nothing
  (``AloneTransfers``): fair sharing only slows a flow, collectives and the replicas' syncs only delay ops, and
  each device runs its ops in a fixed order, so every op starts no earlier in the real run;
- **memory**: what a device holds at its peak is at least its static state (weights x versions, gradients,
  optimizer state) plus what its compute ops stash, and that stash depends only on the device's own op order
  (docs/schedules.md section 0's bookkeeping). The timed ledger adds p2p buffers on top, never less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipescope.simulator.costs import StageCost
from pipescope.simulator.ir import ActionKind, Schedule
from pipescope.simulator.lowering import step_group
from pipescope.simulator.memory import OpArrays, device_params, device_timelines, op_memory_events, static_memory
from pipescope.simulator.mesh import NO_SHARDING, DeviceMesh, Sharding
from pipescope.simulator.network import Clock, FifoLinks
from pipescope.simulator.program import KIND_CODE, op_durations
from pipescope.simulator.routed import RoutedNetwork, time_alone


def busy_per_iteration_ns(schedule: Schedule, stage_costs: Sequence[StageCost]) -> list[int]:
    """Compute ns each device runs per iteration: its F, I, W and B ops, recompute included, plus, for a flush
    schedule, one optimizer step per stage (where the cost model gives it time). A schedule that spans iterations
    (PipeDream, 2BW) is timed by the gaps between iteration ends, and with few iterations one gap holds no step
    (docs/schedules.md, "The optimizer step"), so its steps are left out of the bound."""
    durations = op_durations(stage_costs, schedule.recompute)
    busy = [0] * schedule.num_devices
    for device in range(schedule.num_devices):
        total = sum(durations[a.stage, a.kind] for a in schedule.compute_actions(device))
        busy[device] = total // schedule.iterations
    if schedule.iterations == 1:
        for stage, device in enumerate(schedule.stage_to_device):
            busy[device] += durations[stage, ActionKind.OPT]
    return busy


def memory_lower_bounds(schedule: Schedule, stage_costs: Sequence[StageCost], precision: str,
                        runtime: str = "megatron", gradient_buffers: int = 1, sharding: Sharding = NO_SHARDING,
                        overhead_bytes: int = 0) -> list[int]:
    """Per device, bytes its peak cannot be under: static state (as ``memory.runtime`` counts it, with
    ``gradient_buffers`` and ``sharding`` as the ledger takes them, and the overheads beside tensors) plus
    its ops' stash, replayed in list order."""
    params = device_params(schedule, stage_costs)
    state = [static_memory(params[d], schedule.versions(d), precision, runtime, sharding)
             for d in range(schedule.num_devices)]
    static = [s.total + (gradient_buffers - 1) * s.gradients + overhead_bytes for s in state]
    return [memory.peak_bytes for memory in device_timelines(_ordered_events(schedule, stage_costs), static)]


def _ordered_events(schedule: Schedule, stage_costs: Sequence[StageCost]):
    """The stash events of every compute op, each device's ops at consecutive instants in list order (an op
    starts at 2i and ends at 2i + 1, so the ledger sees the order a timed run has)."""
    devices, kinds, stages = [], [], []
    for device in range(schedule.num_devices):
        for action in schedule.compute_actions(device):
            devices.append(device)
            kinds.append(KIND_CODE[action.kind])
            stages.append(action.stage)
    at = np.asarray(stages, dtype=np.int64)
    slot = np.zeros(len(devices), dtype=np.int64)
    device = np.asarray(devices, dtype=np.int64)
    for d in range(schedule.num_devices):  # position within the device's own list
        mask = device == d
        slot[mask] = np.arange(int(mask.sum()), dtype=np.int64)

    def column(name: str) -> np.ndarray:
        return np.array([getattr(c, name) for c in stage_costs], dtype=np.int64)[at]

    ops = OpArrays(device=device, kind=np.asarray(kinds, dtype=np.int64), start=2 * slot, end=2 * slot + 1,
                   activation=column("activation_bytes"), weight_grad=column("weight_grad_bytes"),
                   stage_input=column("input_bytes"), rebuilt=column("rebuilt"))
    return op_memory_events(ops, schedule.recompute, schedule.chunks)


def allreduce_floor_ns(schedule: Schedule, stage_costs: Sequence[StageCost], grad_bytes: int, width: int,
                       ns_per_byte: Callable[[list[int]], float]) -> int:
    """Per iteration, the time the data-parallel gradient all-reduce's bytes alone take on the busiest group.

    Every optimizer step all-reduces (under ZeRO reduce-scatters) each device's gradients over its ``width``
    replicas (``DeviceMesh.data_group``): once per iteration, or once per microbatch under PipeDream
    (``lowering.step_group``). Successive all-reduces cross the same links, so no run finishes iterations faster
    than that (the second term of the 2BW planner's equation, docs/schedules.md section 3).
    ``ns_per_byte(group)`` is the marginal time per byte of the fastest all-reduce over ``group`` on the idle
    network: latencies are left out, so the product stays a floor however the bytes are bucketed.
    """
    if width <= 1:
        return 0
    mesh = DeviceMesh(schedule.num_devices, width)
    return max(int(nbytes * ns_per_byte(mesh.data_group(d)))
               for d, nbytes in enumerate(gradient_bytes_per_iteration(schedule, stage_costs, grad_bytes)))


def gradient_bytes_per_iteration(schedule: Schedule, stage_costs: Sequence[StageCost], grad_bytes: int) -> list[int]:
    """Per device, the gradient bytes its data-parallel all-reduces move per iteration: its stages' gradients
    (``grad_bytes`` each: ``memory_runtime.grad_bytes``, what the ledger holds and the simulation reduces), once
    per optimizer step (once an iteration; once a microbatch under PipeDream)."""
    per_device = [0] * schedule.num_devices
    for stage, device in enumerate(schedule.stage_to_device):
        per_device[device] += stage_costs[stage].params * grad_bytes
    m = schedule.num_microbatches
    steps = len({step_group(schedule.weight_update, m, microbatch) for microbatch in range(m)})
    return [steps * nbytes for nbytes in per_device]


class AloneTransfers(FifoLinks):
    """The floor of a routed network (module doc): each transfer as long as it takes alone on ``routed`` (once per
    source, destination and size), nothing held, and every collective instant."""

    def __init__(self, routed: RoutedNetwork):
        super().__init__(lambda src, dst, nbytes: (time_alone(routed, [(src, dst, nbytes, 0)])[0], 0))

    def start_collective(self, clock: Clock, now: int, flow: int, kind: ActionKind, group: Sequence[int]) -> int:
        clock.finish_at(flow, now)
        return now
