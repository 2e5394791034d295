"""Data parallelism: w copies of a compiled pipeline program, each stage's replicas all-reducing its gradients.

Replica r's device d is device ``r * D + d``; its entries, transfers and pipeline collectives (clipping's norm
all-reduce) are the base program's, shifted. Every stage all-reduces its gradients among its w replicas once per
optimizer step (once per iteration; once per backward under PipeDream, which steps after each), in DDP-like buckets:
with ``overlap`` (DDP's default) bucket j of K is ready (j+1)/K of the way through the stage's last weight-gradient op
of the step (W, or a fused B: the backward fills buckets from the output layer back) and starts as soon as every
replica has it; without, every bucket starts after the device's last op of the step. A collective does not hold its
members' compute streams (it runs on the communication stream, as DDP's does); the optimizer step waits for it, and
so does the first forward that runs on the updated weights: for 2BW, whose update W(t+1) = W(t) - lr * grad f(W(t-1))
is applied one iteration late, the stage's first forward of iteration k+2; for PipeDream the stage's next forward.
docs/network.md has the rules and what they leave out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipescope.simulator.ir import ActionKind, Collective, Role, Schedule, WeightUpdate
from pipescope.simulator.lowering import LAG_WITHOUT_FLUSH, step_group, step_microbatch
from pipescope.simulator.program import KIND_CODE, Columns, Program

K = ActionKind
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's bucket_cap_mb default
MAX_BUCKETS = 4096  # per stage and iteration: DDP's 25 MiB cuts a 100 GB stage into 4,000; more is a typo


class SyncError(ValueError):
    """A gradient sync the simulator refuses (too many buckets); the message names the key."""


@dataclass(frozen=True)
class GradSync:
    """How replicas synchronise gradients: bucket size in bytes, overlapped with the backward or all at the end;
    ``sharded``: Megatron's distributed optimizer (ZeRO-1), which reduce-scatters the gradients instead, steps its
    shard and all-gathers the weights after the step (with ``overlap``, behind the next iteration's forwards, as
    ``--overlap-param-gather`` does: not in this iteration)."""

    bucket_bytes: int = DDP_BUCKET_BYTES
    overlap: bool = True
    sharded: bool = False


@dataclass
class _Sync:
    """One bucket's all-reduce: the base entry whose start launches it, when after that start, and its bytes."""

    trigger: int
    offset: int
    collective: Collective
    blocks: list[int] = field(default_factory=list)  # base entries (later forwards) that wait for its end


def data_parallel(base: Program, schedule: Schedule, width: int, grad_bytes: list[int], sync: GradSync,
                  weight_bytes: list[int] | None = None) -> Program:
    """The program of ``width`` replicas of ``base`` with bucketed gradient all-reduces (see the module doc).

    Args:
        base: one pipeline's compiled program; its own collectives (vocabulary parallelism's) are copied into each
            replica over that replica's devices, with their joins.
        schedule: what ``base`` was compiled from (stage map, microbatches per iteration, weight-update rule).
        width: data-parallel replicas w >= 1.
        grad_bytes: per stage, the bytes of its gradients.
        sync: bucket size, overlap, and whether the optimizer is sharded.
        weight_bytes: per stage, the bytes of its weights, which a sharded optimizer all-gathers after its step.
    """
    syncs = _syncs(base, schedule, width, grad_bytes, sync)
    if sync.sharded and not sync.overlap and width > 1:
        syncs += _weight_gathers(base, schedule, width, weight_bytes or [0] * len(grad_bytes), sync)
    return _replicate(base, width, syncs)


def _weight_gathers(base: Program, schedule: Schedule, width: int, weight_bytes: list[int], sync: GradSync
                    ) -> list[_Sync]:
    """A sharded optimizer's all-gather of each stage's updated weights, in buckets, once its step ends (a flush
    schedule's: the iteration waits for them)."""
    cols, devices = base.columns, schedule.num_devices
    steps = cols.kind == KIND_CODE[K.OPT]
    found = []
    for stage, nbytes in enumerate(weight_bytes):
        group = tuple(r * devices + schedule.stage_to_device[stage] for r in range(width))
        for step in np.flatnonzero(steps & (cols.stage == stage)).tolist():
            for j, size in enumerate(_split(nbytes, sync.bucket_bytes) if nbytes > 0 else []):
                collective = Collective(stage, K.ALL_GATHER, int(cols.microbatch[step]), group, size, j)
                found.append(_Sync(step, base.duration[step], collective))
    return found


def _syncs(base: Program, schedule: Schedule, width: int, grad_bytes: list[int], sync: GradSync) -> list[_Sync]:
    """Every bucket all-reduce of every stage and step group (an iteration, or a microbatch under PipeDream:
    ``lowering.step_group``), in a fixed order."""
    if width < 2:
        return []
    cols, m, devices, update = base.columns, schedule.num_microbatches, schedule.num_devices, schedule.weight_update
    groups = step_group(update, m, cols.microbatch)
    iteration = cols.microbatch // m
    steps = cols.kind == KIND_CODE[K.OPT]
    compute = (cols.role == Role.COMPUTE) & ~steps  # the optimizer step waits for the all-reduce: never its trigger
    grads = compute & np.isin(cols.kind, [KIND_CODE[K.W], KIND_CODE[K.B]])
    forwards = compute & (cols.kind == KIND_CODE[K.F])
    lag = LAG_WITHOUT_FLUSH if schedule.iterations > 1 else schedule.iterations
    found = []
    for stage, nbytes in enumerate(grad_bytes):
        if nbytes <= 0:
            continue
        home = schedule.stage_to_device[stage]
        group = tuple(r * devices + home for r in range(width))
        buckets = _split(nbytes, sync.bucket_bytes)
        mine = cols.stage == stage
        for g in np.unique(groups[grads & mine]).tolist():
            if sync.overlap:
                trigger = int(np.flatnonzero(grads & mine & (groups == g)).max())
                offsets = [base.duration[trigger] * (j + 1) // len(buckets) for j in range(len(buckets))]
            else:
                trigger = int(np.flatnonzero(compute & (cols.device == home) & (groups == g)).max())
                offsets = [base.duration[trigger]] * len(buckets)
            if update is WeightUpdate.ASYNC_STASH:  # the stage's next forward runs on the newest weights
                later = np.flatnonzero(forwards & mine & (np.arange(len(steps)) > trigger))
            else:
                later = np.flatnonzero(forwards & mine & (iteration == g + lag))
            step = np.flatnonzero(steps & mine & (groups == g))
            blocks = [int(later.min())] if len(later) else []
            blocks += step.tolist()  # the optimizer step applies the reduced gradients
            last_microbatch = step_microbatch(update, m, g)
            kind = K.REDUCE_SCATTER if sync.sharded else K.ALL_REDUCE
            for j, (size, offset) in enumerate(zip(buckets, offsets)):
                collective = Collective(stage, kind, last_microbatch, group, size, j)
                found.append(_Sync(trigger, offset, collective, blocks))
    return found


def _split(nbytes: int, bucket: int) -> list[int]:
    """``nbytes`` in buckets of at most ``bucket`` bytes (the last one smaller); SyncError past MAX_BUCKETS."""
    count = max(1, math.ceil(nbytes / bucket))
    if count > MAX_BUCKETS:
        raise SyncError(f"cluster.bucket_size: got {bucket:,} bytes, which cuts a stage's {nbytes:,} gradient bytes "
                        f"into {count:,} buckets; expected at most {MAX_BUCKETS:,} buckets (DDP's default is 25MiB)")
    return [bucket] * (count - 1) + [nbytes - bucket * (count - 1)]


def _replicate(base: Program, width: int, syncs: list[_Sync]) -> Program:
    """Entries: each replica's copy of the base entries, then each replica's member entries of the syncs. Flows:
    each replica's transfers, then one flow per sync shared by its replicas."""
    n, flows, devices = base.num_entries, base.num_flows, len(base.device_steps)

    def moved(c: Collective | None, r: int) -> Collective | None:  # a base collective over replica r's devices
        return c if c is None or not r else c._replace(group=tuple(d + r * devices for d in c.group))
    members = len(syncs)
    total = width * (n + members)
    first_sync_flow = width * flows

    def signal(s: int, r: int) -> int:  # a base signal in replica r
        return s + r * n if s < n else total + r * flows + (s - n)

    out = Program(actions=[], device=[], role=[], device_steps=[], launches=[], duration=[], waits=[], flow_of=[],
                  columns=base.columns)
    blocked: dict[int, list[int]] = {}
    for c, s in enumerate(syncs):
        for entry in s.blocks:
            blocked.setdefault(entry, []).append(total + first_sync_flow + c)
    for r in range(width):
        out.actions += [moved(a, r) if role is Role.COLLECTIVE else a for a, role in zip(base.actions, base.role)]
        out.device += [d + r * devices for d in base.device]
        out.role += base.role
        out.launches += [tuple(f + r * flows for f in fs) for fs in base.launches]
        out.duration += base.duration
        out.waits += [[signal(s, r) for s in w] + blocked.get(i, []) for i, w in enumerate(base.waits)]
        out.flow_of += [f + r * flows if f >= 0 else -1 for f in base.flow_of]
        out.device_steps += [[i + r * n for i in steps] for steps in base.device_steps]
    for r in range(width):
        out.actions += [s.collective for s in syncs]
        out.device += [base.device[s.trigger] + r * devices for s in syncs]
        out.role += [Role.COLLECTIVE] * members
        out.launches += [()] * members
        out.duration += [0] * members
        out.waits += [[] for _ in syncs]
        out.flow_of += [first_sync_flow + c for c in range(members)]
    out.joins = {i + r * n: [(f + r * flows, offset) for f, offset in joined]
                 for r in range(width) for i, joined in base.joins.items()}
    for c, s in enumerate(syncs):
        for r in range(width):
            out.joins.setdefault(s.trigger + r * n, []).append((first_sync_flow + c, s.offset))
    for r in range(width):
        out.flow_src += [d + r * devices if d >= 0 else -1 for d in base.flow_src]
        out.flow_dst += [d + r * devices if d >= 0 else -1 for d in base.flow_dst]
        out.flow_bytes += base.flow_bytes
        out.flow_producer += [i + r * n if i >= 0 else -1 for i in base.flow_producer]
        out.flow_collective += [moved(c, r) for c in base.flow_collective]
    out.flow_src += [-1] * members
    out.flow_dst += [-1] * members
    out.flow_bytes += [s.collective.nbytes for s in syncs]
    out.flow_producer += [-1] * members
    out.flow_collective += [s.collective for s in syncs]
    out.columns = Columns.of(out.actions, np.asarray(out.device, dtype=np.int64))
    return out
