"""The memory ledger: per device, static state (weights x versions, gradients, optimizer) plus a
timeline of what ops stash and free (activations, deferred-W inputs, recompute inputs, p2p buffers).

Byte counts per parameter (ZeRO paper's accounting, Adam):
  bf16/fp16 mixed precision: weights 2 (each extra stashed version 2 more), gradients 2 (4 for bf16 under the
  default ``memory.runtime: megatron``, its fp32 main_grad), optimizer 12 (fp32 master copy 4 + momentum 4 +
  variance 4) -> 16 bytes per parameter (18 for bf16 under megatron).
  fp32: weights 4 (+4 per extra version), gradients 4, optimizer 8 (momentum + variance) -> 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipescope.simulator.costs import StageCost
from pipescope.simulator.ir import COMPUTE_KINDS, ActionKind, Role, Schedule
from pipescope.simulator.mesh import NO_SHARDING, Sharding
from pipescope.simulator.models import PRECISIONS
from pipescope.simulator.memory_runtime import buffer_events, grad_bytes, held_grad_bytes, step_counter_bytes
from pipescope.simulator.program import KIND_CODE
from pipescope.simulator.timeline import Timeline


@dataclass(frozen=True)
class StaticMemory:
    """Bytes a device holds for the whole run."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def static_memory(params: int, versions: int, precision: str, runtime: str = "megatron",
                  sharding: Sharding = NO_SHARDING) -> StaticMemory:
    """Weights times the versions held, one gradient buffer (in the runtime's precision: ``memory_runtime``), Adam
    state; under ZeRO each GPU's shard of the states its stage shards (``mesh.Sharding``): what it holds between
    steps. ZeRO-1 keeps the gradients whole, as Megatron's reduce-scatter fills a full-size buffer. An offloaded
    optimizer state, or ZeRO-3 weight shard, is on the host, not here (``offload.host_bytes``)."""
    bytes_per = PRECISIONS[precision]  # simulator/models.py: the one precision table
    weights = 0 if sharding.offload_params else sharding.part(params * bytes_per.weight_bytes * versions, "weights")
    return StaticMemory(weights,
                        sharding.part(params * held_grad_bytes(runtime, precision), "gradients"),
                        0 if sharding.offload else sharding.part(params * bytes_per.optimizer_bytes, "optimizer"))


@dataclass(frozen=True)
class MemoryEvents:
    """Flat (device, time, delta) rows as arrays; ``units`` counts stashed activations in device-stages."""

    device: np.ndarray
    time: np.ndarray
    delta: np.ndarray
    units: np.ndarray


def events(device: np.ndarray, time: np.ndarray, delta: np.ndarray, units: float | np.ndarray = 0.0) -> MemoryEvents:
    """Rows from equally long arrays (``units`` may be one number for all rows)."""
    return MemoryEvents(device, time, delta, np.broadcast_to(np.asarray(units, dtype=np.float64), device.shape))


def concat(parts: list[MemoryEvents]) -> MemoryEvents:
    return MemoryEvents(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("device", "time", "delta", "units")))


@dataclass(frozen=True)
class OpArrays:
    """Per compute op: device, kind, times, and its stage's byte counts (all numpy arrays)."""

    device: np.ndarray
    kind: np.ndarray  # codes into simulator.timeline.KINDS
    start: np.ndarray
    end: np.ndarray
    activation: np.ndarray  # M_B
    weight_grad: np.ndarray  # M_W
    stage_input: np.ndarray  # what F keeps under full recompute
    rebuilt: np.ndarray  # what a backward rebuilds under full recompute


def op_memory_events(ops: OpArrays, recompute: bool, chunks: int) -> MemoryEvents:
    """What compute ops stash and free (docs/schedules.md section 0 bookkeeping).

    The memory effect of each compute kind, in one place: F stashes M_B (only the stage input under recompute);
    I turns it into M_W; W frees M_W;
    a fused B frees everything. Under recompute a backward first rebuilds M_B (``StageCost.rebuilt``).
    """
    unit = 1.0 / chunks
    kept = ops.stage_input if recompute else ops.activation
    forward, weight, input_grad = ops.kind == KIND_CODE[K.F], ops.kind == KIND_CODE[K.W], ops.kind == KIND_CODE[K.I]
    backward = input_grad | (ops.kind == KIND_CODE[K.B])
    rebuilt = ops.rebuilt if recompute else np.zeros_like(ops.activation)
    residue = np.where(input_grad, ops.weight_grad, 0)
    parts = [
        events(ops.device[forward], ops.start[forward], kept[forward], unit),
        events(ops.device[weight], ops.end[weight], -ops.weight_grad[weight]),
        events(ops.device[backward], ops.end[backward], (residue - kept - rebuilt)[backward], -unit),
    ]
    if recompute:
        parts.append(events(ops.device[backward], ops.start[backward], rebuilt[backward]))
    return concat(parts)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's timeline (time ns, bytes in use) and its peaks."""

    times: np.ndarray
    bytes_in_use: np.ndarray
    peak_bytes: int
    peak_activations: float


def device_timelines(events: MemoryEvents, static: list[int], origin: int | None = None) -> list[DeviceMemory]:
    """Cumulative bytes per device; at equal times frees come before allocations. With ``origin`` (the run's start,
    ns), each timeline first holds its static bytes there: a device holds its weights and optimizer state before its
    first op (a later stage's line started at that op)."""
    dev, time, delta, units = events.device, events.time, events.delta, events.units
    order = np.lexsort((units, delta, time, dev))
    dev, time, delta, units = dev[order], time[order], delta[order], units[order]
    out = []
    for d, base in enumerate(static):
        mask = dev == d
        used = base + np.cumsum(delta[mask])
        stash = np.cumsum(units[mask])
        peak = int(used.max()) if used.size else base
        peak_units = float(np.round(stash.max(), 9)) if stash.size else 0.0
        times = time[mask]
        if origin is not None:
            times, used = np.insert(times, 0, origin), np.insert(used, 0, base)
        out.append(DeviceMemory(times, used, max(peak, base), max(peak_units, 0.0)))
    return out


K = ActionKind


def device_params(schedule: Schedule, stage_costs: list[StageCost]) -> list[int]:
    """Each device's parameters: its stages' (one GPU's under tensor parallelism)."""
    weights = [c.params for c in stage_costs]
    return [int(n) for n in np.bincount(schedule.stage_to_device, weights, minlength=schedule.num_devices)]


def ledger(schedule: Schedule, records: Timeline, stage_costs: list[StageCost], precision: str,
           runtime: str = "megatron", gradient_buffers: int = 1, sharding: Sharding = NO_SHARDING,
           overhead_bytes: int = 0) -> tuple[list[DeviceMemory], list[int]]:
    """Per device: static state plus what compute ops stash and p2p buffers hold, over the timeline; ``runtime``
    says which buffers are held how long (``simulator.memory_runtime``); ``gradient_buffers`` counts the gradients
    that many times (2BW's deferred step keeps the next iteration's apart, ``lowering.add_optimizer_steps``);
    ``sharding``: ZeRO's shards of the static states, and the whole ones it gathers for a while (``sharded_events``);
    ``overhead_bytes`` is what every device holds besides tensors (``simulator.memory_overheads``).

    Returns:
        (memory timeline per device, static bytes per device).
    """
    home = np.asarray(schedule.stage_to_device)
    params = device_params(schedule, stage_costs)
    tensors = np.bincount(home, [c.param_tensors for c in stage_costs], minlength=schedule.num_devices)
    state = [static_memory(params[d], schedule.versions(d), precision, runtime, sharding)
             for d in range(schedule.num_devices)]
    static = [s.total + (gradient_buffers - 1) * s.gradients + int(tensors[d]) * step_counter_bytes(runtime)
              + overhead_bytes for d, s in enumerate(state)]
    stage, compute = records.stage, records.mask(Role.COMPUTE)
    at = stage[compute]
    ops = OpArrays(
        device=records.device[compute], kind=records.kind[compute], start=records.start[compute],
        end=records.end[compute],
        activation=np.array([c.activation_bytes for c in stage_costs], dtype=np.int64)[at],
        weight_grad=np.array([c.weight_grad_bytes for c in stage_costs], dtype=np.int64)[at],
        stage_input=np.array([c.input_bytes for c in stage_costs], dtype=np.int64)[at],
        rebuilt=np.array([c.rebuilt for c in stage_costs], dtype=np.int64)[at],
    )
    boundary = np.array([c.boundary_bytes for c in stage_costs], dtype=np.int64)
    parts = [op_memory_events(ops, schedule.recompute, schedule.chunks),
             _held(*buffer_events(records, boundary, runtime)), _vocab_events(records, stage_costs)]
    if sharding.zero >= 2 and sharding.shards > 1:
        parts.append(sharded_events(records, stage_costs, precision, runtime, sharding, schedule))
    origin = int(records.start.min()) if len(records) else 0
    return device_timelines(concat(parts), static, origin), static


def sharded_events(records: Timeline, stage_costs: list[StageCost], precision: str, runtime: str, sharding: Sharding,
                   schedule: Schedule) -> MemoryEvents:
    """What ZeRO-2 and 3 hold whole for a while beyond each GPU's shard (docs/parallelism.md, "Memory"): the
    gradients of the units a backward op (B or W) produces, until their reduce-scatter (two units in flight,
    ``Sharding.in_flight``), and under ZeRO-3 the gathered weights: two units during each op that reads them
    (``reshard_after_forward``); without, what torch's FSDP actions hold (``_fsdp_events``).
    """
    params = [c.params for c in stage_costs]
    per_grad, per_weight = grad_bytes(runtime, precision), PRECISIONS[precision].weight_bytes
    if sharding.zero >= 3 and not sharding.reshard_after_forward:  # torch's FSDP actions ran
        return _fsdp_events(records, schedule, [sharding.gathered(p * per_grad, "gradients") for p in params],
                            [sharding.gathered(p * per_weight, "weights") for p in params])
    edge = [s in (0, len(params) - 1) for s in range(len(params))]  # the embedding's and output layer's stages
    grads = np.array([sharding.in_flight(p * per_grad, "gradients", per_grad, e) for p, e in zip(params, edge)],
                     dtype=np.int64)
    producing = np.flatnonzero(records.is_kind(K.B, K.W))
    stage = records.stage[producing]
    parts = [_held(records.device[producing], records.start[producing], records.end[producing], grads[stage])]
    if sharding.zero >= 3:
        weights = np.array([sharding.in_flight(p * per_weight, "weights", per_weight, e) for p, e in zip(params, edge)],
                           dtype=np.int64)
        reading = np.flatnonzero(records.is_kind(K.F, K.I, K.B))
        stage = records.stage[reading]
        parts.append(_held(records.device[reading], records.start[reading], records.end[reading], weights[stage]))
    return concat(parts)


def _fsdp_events(records: Timeline, schedule: Schedule, grads: list[int], weights: list[int]) -> MemoryEvents:
    """torch's FSDP actions (docs/parallelism.md, "torch's FSDP actions"): a stage's whole weights from the start of
    each UNSHARD's all-gather (the device's gather rows pair with its UNSHARDs in order) until its RESHARD, reached
    when the compute op before it ends; its whole gradients from its first backward op (B or W) until its last
    reduce-scatter ends (torch accumulates them unsharded until REDUCE_GRAD)."""
    compute = np.flatnonzero(records.mask(Role.COMPUTE)).tolist()
    ends = {(int(records.device[i]), records.actions[i]): int(records.end[i]) for i in compute}
    gather_rows = np.flatnonzero(records.is_kind(K.ALL_GATHER))
    rows: list[tuple[int, int, int, int]] = []  # (device, since, until, bytes)
    for d, actions in enumerate(schedule.device_actions):
        gathers = iter(gather_rows[records.device[gather_rows] == d].tolist())
        held: dict[int, int] = {}
        last_end = 0
        for a in actions:
            if a is None:
                continue
            if a.kind in COMPUTE_KINDS:
                last_end = ends[d, a]
            elif a.kind is K.UNSHARD and weights[a.stage] > 0:
                held[a.stage] = int(records.start[next(gathers)])
            elif a.kind is K.RESHARD and a.stage in held:
                rows.append((d, held.pop(a.stage), last_end, weights[a.stage]))
    made = records.is_kind(K.B, K.W)
    reduced = records.is_kind(K.REDUCE_SCATTER)
    for (d, stage), first in _first_starts(records, made).items():
        last = (records.device == d) & (records.stage == stage) & reduced
        if grads[stage] > 0 and last.any():
            rows.append((d, first, int(records.end[last].max()), grads[stage]))
    device, since, until, nbytes = (np.array([row[k] for row in rows], dtype=np.int64) for k in range(4))
    return _held(device, since, until, nbytes)


def _first_starts(records: Timeline, rows: np.ndarray) -> dict[tuple[int, int], int]:
    """(device, stage) -> the earliest start among ``rows`` (a mask)."""
    first: dict[tuple[int, int], int] = {}
    for i in np.flatnonzero(rows).tolist():
        key = (int(records.device[i]), int(records.stage[i]))
        first[key] = min(first.get(key, int(records.start[i])), int(records.start[i]))
    return first


def _vocab_events(records: Timeline, stage_costs: list[StageCost]) -> MemoryEvents:
    """Vocabulary parallelism (docs/memory.md): an S pass stashes its shard's logits and softmax until its T pass
    ends (``StageCost.vocab_bytes`` of the device's stage)."""
    held = np.array([c.vocab_bytes for c in stage_costs], dtype=np.int64)
    s, t = np.flatnonzero(records.is_kind(K.S)), np.flatnonzero(records.is_kind(K.T))
    return concat([events(records.device[s], records.start[s], held[records.stage[s]]),
                   events(records.device[t], records.end[t], -held[records.stage[t]])])


def _held(device: np.ndarray, since: np.ndarray, until: np.ndarray, nbytes: np.ndarray) -> MemoryEvents:
    """Buffers held over [since, until); one held for no time (an instant transfer) is never allocated."""
    kept = until > since
    return concat([events(device[kept], since[kept], nbytes[kept]), events(device[kept], until[kept], -nbytes[kept])])
