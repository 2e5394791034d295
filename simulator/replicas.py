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
Under ZeRO (``GradSync.zero``, docs/parallelism.md) the all-reduce is a reduce-scatter (stages 2 and 3: after every
microbatch's backward, into each replica's accumulated shard); stages 1 and 2 all-gather the updated weights after
the step, and stage 3 all-gathers a stage's weights before the ops that need them instead: before each forward and
each input-gradient backward (``reshard_after_forward``, FSDP's default), unit by unit where the stage's costs have
FSDP's units (each op then runs its units one after another, each after its own gather, and a fused backward
reduce-scatters each unit's gradients as its part ends), each gather prefetched: issued when the unit ``prefetch``
before it in the device's order of need starts (FSDP's default: the one before; the device's first have none, so
they start with the run). Without resharding, stage 3 runs torch.distributed.pipelining's FSDP actions instead
(``_fsdp_syncs``): a gather at each UNSHARD, one reduce-scatter of the iteration's gradients at each REDUCE_GRAD
(Llama 3's choice).
docs/network.md has the rules and what they leave out.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pipescope.simulator.costs import FsdpUnit
from pipescope.simulator.ir import ActionKind, Collective, Role, Schedule, WeightUpdate
from pipescope.simulator.lowering import LAG_WITHOUT_FLUSH, has_fsdp_actions, step_group, step_microbatch
from pipescope.simulator.mesh import NO_SHARDING, DeviceMesh, Sharding
from pipescope.simulator.offload import copy_ns
from pipescope.simulator.program import KIND_CODE, Columns, Program, rescaled_parts

K = ActionKind
DDP_BUCKET_BYTES = 25 << 20  # torch DDP's bucket_cap_mb default
MAX_BUCKETS = 4096  # per stage and iteration: DDP's 25 MiB cuts a 100 GB stage into 4,000; more is a typo
# Per run, every collective of the data-parallel synchronisation (buckets x steps, x microbatches under ZeRO-2/3,
# x shard groups under HSDP): each is a flow that re-plans the fair share of the flows beside it. On a 2-core
# machine 28,824 took 49 s (ZeRO-2, 1.5 MiB buckets), 57,800 took 47 s (HSDP, 64 groups), and 144,120 ran past
# 170 s (docs/cli.md, "Limits").
MAX_SYNCS = 100_000


class SyncError(ValueError):
    """A gradient sync the simulator refuses (too many buckets); the message names the key."""


@dataclass(frozen=True)
class GradSync:
    """How replicas synchronise gradients: bucket size in bytes, overlapped with the backward or all at the end;
    ``sharding``: ZeRO's stage and shards (``mesh.Sharding``: 0 none; 1 Megatron's distributed optimizer, which
    reduce-scatters the gradients, steps its shard and all-gathers the weights after the step, with ``overlap`` behind
    the next iteration's forwards as ``--overlap-param-gather`` does: not in this iteration; 2 sharded gradients,
    reduce-scattered after every microbatch's backward; 3 sharded weights too, gathered before use: see the module
    doc). Shards fewer than the replicas are HSDP's groups."""

    bucket_bytes: int = DDP_BUCKET_BYTES
    overlap: bool = True
    sharding: Sharding = NO_SHARDING

    @property
    def zero(self) -> int:
        return self.sharding.zero

    @property
    def sharded(self) -> bool:
        """Gradients are reduce-scattered and the optimizer state sharded (every ZeRO stage)."""
        return self.zero >= 1


START, AFTER = -1, -2  # _Sync.trigger: it starts with the run; each of its members joins when a sync of ``after`` ends


@dataclass
class _Sync:
    """One bucket's collective: the base entry whose start launches it (or START, AFTER), when after that start,
    the collective (over the ranks of its member replicas) and its base device."""

    trigger: int
    offset: int
    collective: Collective
    blocks: list[int] = field(default_factory=list)  # base entries (later forwards) that wait for its end
    device: int = -1  # -1: the trigger's
    replicas: tuple[int, ...] = ()  # the replicas whose copies join it (empty: all)
    after: tuple[int, ...] = ()  # AFTER: the syncs (indices) whose end makes one member join
    segment: int = 0  # the segment of ``blocks`` that waits for it (an op run unit by unit: ``Program.segments``)
    trigger_segment: int = 0  # the segment of ``trigger`` whose start launches it


def data_parallel(base: Program, schedule: Schedule, width: int, grad_bytes: list[int], sync: GradSync,
                  weight_bytes: list[int] | None = None, held: Sequence[int] | None = None,
                  units: Sequence[tuple[FsdpUnit, ...]] = ()) -> Program:
    """The program of ``width`` replicas of ``base`` with bucketed gradient all-reduces (see the module doc).

    Args:
        base: one pipeline's compiled program; its own collectives (vocabulary parallelism's) are copied into each
            replica over that replica's devices, with their joins.
        schedule: what ``base`` was compiled from (stage map, microbatches per iteration, weight-update rule).
        width: data-parallel replicas w >= 1.
        grad_bytes: per stage, the bytes of its gradients.
        sync: bucket size, overlap, and ZeRO's stage and shards.
        weight_bytes: per stage, the bytes of its weights, which a sharded optimizer all-gathers after its step.
        held: the replicas whose entries and transfers the program holds, ascending (default: all ``width``); the
            collectives still span every replica, and start with the members the program holds (``simulator.fold``).
        units: per stage, FSDP's units (``StageCost.units``): ZeRO-3 gathers them one at a time, and each op that
            reads the weights runs unit by unit (``_param_gathers``); none: a stage's weights at once.
    """
    mesh = DeviceMesh(schedule.num_devices, width, shard=sync.sharding.shards if sync.sharded else 0)
    weights = weight_bytes or [0] * len(grad_bytes)
    segments: dict[int, list[int]] = {}
    if sync.zero >= 3 and width > 1 and not sync.sharding.reshard_after_forward:  # torch's UNSHARD, REDUCE_GRAD run
        if not has_fsdp_actions(schedule):
            raise ValueError("ZeRO-3 without resharding runs torch's FSDP actions: expected a schedule that holds "
                             "them (lowering.add_fsdp_actions)")
        syncs = _fsdp_syncs(base, mesh, grad_bytes, weights, sync.bucket_bytes,
                            [_fetch_ns(nbytes, sync.sharding) for nbytes in weights])
    else:
        orders = _unit_orders(base, weights, units, schedule.recompute) if sync.zero >= 3 and width > 1 else {}
        segments = {entry: [ns for _, _, ns in order] for entry, order in orders.items()}
        syncs = _syncs(base, schedule, mesh, grad_bytes, sync, orders)
        if sync.sharded and sync.zero < 3 and not sync.overlap and width > 1:
            syncs += _weight_gathers(base, schedule, mesh, weights, sync)
        if sync.zero >= 3 and width > 1:
            syncs += _param_gathers(base, mesh, weights, sync.sharding, orders)
    syncs = _hybrid(syncs, mesh, base) if mesh.hybrid else syncs
    if len(syncs) > MAX_SYNCS:
        groups = f" and {len(mesh.shard_replicas())} shard groups" if mesh.hybrid else ""
        raise SyncError(f"cluster.bucket_size: got {sync.bucket_bytes:,} bytes, which makes {len(syncs):,} "
                        f"data-parallel collectives over the run's {schedule.num_stages} stages, "
                        f"{schedule.num_microbatches * schedule.iterations} microbatches{groups}; expected at most "
                        f"{MAX_SYNCS:,} (ZeRO-2 and 3 reduce-scatter every bucket after every microbatch): larger "
                        f"buckets, fewer microbatches or stages, or larger shard groups")
    return _replicate(base, mesh, syncs, range(width) if held is None else held, segments)


def _hybrid(syncs: list[_Sync], mesh: DeviceMesh, base: Program) -> list[_Sync]:
    """HSDP (docs/parallelism.md): each sync over every replica, run over the shard groups instead. A gradient
    reduce-scatter is one per shard group, then each shard is all-reduced over its replicate group (the replicas
    holding that shard), which every member joins when its group's reduce-scatter ends; what waited for the
    reduction waits for the all-reduce. A weight gather is one per shard group."""
    out: list[_Sync] = []
    for s in syncs:
        home, c = _home(s, base), s.collective
        scattered = []
        for replicas in mesh.shard_replicas():
            part = replace(s, collective=c._replace(group=mesh.ranks(replicas, home)),
                           blocks=[] if c.kind is K.REDUCE_SCATTER else s.blocks, device=home, replicas=replicas)
            scattered.append(len(out))
            out.append(part)
        if c.kind is K.REDUCE_SCATTER:
            shard = -(-c.nbytes // mesh.shard_size)
            for replicas in mesh.replicate_replicas():
                reduced = c._replace(kind=K.ALL_REDUCE, group=mesh.ranks(replicas, home), nbytes=shard)
                out.append(_Sync(AFTER, 0, reduced, s.blocks, home, replicas, tuple(scattered)))
    return out


def _home(s: _Sync, base: Program) -> int:
    """The base device a sync's members run on: its own, else its trigger's."""
    return s.device if s.device >= 0 else base.device[s.trigger]


def _weight_gathers(base: Program, schedule: Schedule, mesh: DeviceMesh, weight_bytes: list[int], sync: GradSync
                    ) -> list[_Sync]:
    """A sharded optimizer's all-gather of each stage's updated weights, in buckets, once its step ends (a flush
    schedule's: the iteration waits for them)."""
    cols = base.columns
    steps = cols.kind == KIND_CODE[K.OPT]
    found = []
    for stage, nbytes in enumerate(weight_bytes):
        group = tuple(mesh.data_group(schedule.stage_to_device[stage]))
        for step in np.flatnonzero(steps & (cols.stage == stage)).tolist():
            for j, size in enumerate(_split(nbytes, sync.bucket_bytes) if nbytes > 0 else []):
                collective = Collective(stage, K.ALL_GATHER, int(cols.microbatch[step]), group, size, j)
                found.append(_Sync(step, base.duration[step], collective))
    return found


GATHERED_KINDS = (K.F, K.I, K.B)  # the ops that read a stage's weights (W reads activations and output gradients)


def _fetch_ns(weight_bytes: int, sharding: Sharding) -> int:
    """ns before a member of a gather of ``weight_bytes`` joins: with the weight shards on the host (ZeRO-Infinity,
    ``parallel.offload: parameters``), the copy of its shard up at its PCIe share; else 0."""
    if not sharding.offload_params:
        return 0
    if sharding.host_rate <= 0:
        raise ValueError(f"Sharding.host_rate: got {sharding.host_rate}, expected the positive bytes/s of a GPU's "
                         f"copies from its host (the weight shards are there)")
    return copy_ns(sharding.part(weight_bytes, "weights"), sharding.host_rate)


UnitOrder = list[tuple[int, FsdpUnit, int]]  # an op's units in the order it runs them: (forward place, unit, its ns)


def _unit_orders(base: Program, weight_bytes: list[int], units: Sequence[tuple[FsdpUnit, ...]], recompute: bool
                 ) -> dict[int, UnitOrder]:
    """Per op that reads a stage's weights (F, I, B) where the stage has FSDP's units (docs/parallelism.md,
    "Units"): its units in the order it runs them, forward order in F and reversed in a backward, each with its
    share of the op's time (scaled to the op's own, to the nanosecond)."""
    cols, codes = base.columns, {KIND_CODE[kind]: kind for kind in GATHERED_KINDS}
    orders: dict[int, UnitOrder] = {}
    for i in np.flatnonzero(np.isin(cols.kind, list(codes)) & (cols.role == Role.COMPUTE)).tolist():
        stage = int(cols.stage[i])
        mine = units[stage] if stage < len(units) else ()
        if len(mine) < 2 or weight_bytes[stage] <= 0:
            continue
        kind = codes[int(cols.kind[i])]
        placed = list(enumerate(mine)) if kind is K.F else list(enumerate(mine))[::-1]
        # in proportion to the units' shares: the op's own time may be apart from their sum (a profile's measured
        # fused backward, a run's measured op times)
        ns = rescaled_parts([unit.pass_ns(kind.value, recompute) for _, unit in placed], base.duration[i])
        orders[i] = [(place, unit, t) for (place, unit), t in zip(placed, ns)]
    return orders


def _unit_shares(nbytes: int, order: UnitOrder) -> list[tuple[int, int, int]]:
    """(segment, forward place, bytes) of each unit of an op that has parameters: ``nbytes`` of the stage's, in
    proportion to the unit's parameters."""
    total = sum(unit.params for _, unit, _ in order)
    return [(j, place, nbytes * unit.params // total) for j, (place, unit, _) in enumerate(order) if unit.params]


def _param_gathers(base: Program, mesh: DeviceMesh, weight_bytes: list[int], sharding: Sharding,
                   orders: dict[int, UnitOrder]) -> list[_Sync]:
    """ZeRO-3's all-gathers before each op that reads a stage's weights (``reshard_after_forward``, the module doc):
    one a unit where the op runs unit by unit (``orders``), each unit after its own gather; else one of the stage's
    weights before the op. A device's gathers go in the order it needs them, each launched as the one ``prefetch``
    before it starts its segment (the first ones with the run), each member joining after its shard's copy up where
    the shards are on the host."""
    cols, codes = base.columns, [KIND_CODE[kind] for kind in GATHERED_KINDS]
    found = []
    for d, steps in enumerate(base.device_steps):
        needed: list[tuple[int, int, int, int, int]] = []  # (entry, segment, stage, forward place, bytes)
        for i in (i for i in steps if base.role[i] is Role.COMPUTE and cols.kind[i] in codes):
            stage = int(cols.stage[i])
            if i in orders:
                needed += [(i, j, stage, place, nbytes) for j, place, nbytes in _unit_shares(weight_bytes[stage],
                                                                                            orders[i])]
            elif weight_bytes[stage] > 0:
                needed.append((i, 0, stage, 0, weight_bytes[stage]))
        group, prefetch = tuple(mesh.data_group(d)), sharding.prefetch
        for k, (entry, segment, stage, place, nbytes) in enumerate(needed):
            launch = needed[k - prefetch] if k >= prefetch else None
            collective = Collective(stage, K.ALL_GATHER, int(cols.microbatch[entry]), group, nbytes, place)
            found.append(_Sync(launch[0] if launch else START, _fetch_ns(nbytes, sharding), collective, [entry], d,
                               segment=segment, trigger_segment=launch[1] if launch else 0))
    return found


def _fsdp_syncs(base: Program, mesh: DeviceMesh, grad_bytes: list[int], weight_bytes: list[int], bucket: int,
                fetch_ns: list[int]) -> list[_Sync]:
    """torch's FSDP actions run (docs/parallelism.md, "torch's FSDP actions"): each UNSHARD all-gathers its stage's
    weights, each REDUCE_GRAD reduce-scatters its stage's gradients (in buckets), issued as the device reaches it, so
    when the compute op before it ends (with the run when none is). A gather holds back the stage's next op that reads
    the weights; a reduce-scatter holds back the stage's optimizer step. RESHARD moves nothing (the ledger frees the
    weights there). A gather's members join ``fetch_ns`` of its stage later (``_fetch_ns``)."""
    cols, found = base.columns, []
    reading = np.isin(cols.kind, [KIND_CODE[kind] for kind in GATHERED_KINDS])
    for d in range(mesh.pipeline):
        entries = np.flatnonzero(cols.device == d).tolist()
        group, before = tuple(mesh.data_group(d)), START
        for i, waiting in zip(entries, _next_uses(base, entries, reading)):
            if base.role[i] is Role.COMPUTE:
                before = i
                continue
            kind, stage = base.actions[i].kind, int(cols.stage[i])
            offset, microbatch = (base.duration[before], int(cols.microbatch[before])) if before >= 0 else (0, 0)
            if kind is K.UNSHARD and weight_bytes[stage] > 0:
                collective = Collective(stage, K.ALL_GATHER, microbatch, group, weight_bytes[stage], 0)
                found.append(_Sync(before, offset + fetch_ns[stage], collective, waiting, d))
            elif kind is K.REDUCE_GRAD and grad_bytes[stage] > 0:
                for j, size in enumerate(_split(grad_bytes[stage], bucket)):
                    collective = Collective(stage, K.REDUCE_SCATTER, microbatch, group, size, j)
                    found.append(_Sync(before, offset, collective, waiting, d))
    return found


def _syncs(base: Program, schedule: Schedule, mesh: DeviceMesh, grad_bytes: list[int], sync: GradSync,
           orders: dict[int, UnitOrder] | None = None) -> list[_Sync]:
    """Every bucket all-reduce of every stage and step group (an iteration, or a microbatch under PipeDream:
    ``lowering.step_group``), in a fixed order. ZeRO-2 and 3 reduce-scatter after every microbatch's backward
    instead, into the shard each replica accumulates (DeepSpeed's and FSDP's micro-step reduction; a backward run
    unit by unit, ``orders``, one unit's gradients as its part ends, FSDP's post-backward), and the
    iteration's optimizer step waits for them all."""
    if mesh.data < 2:
        return []
    cols, m, update = base.columns, schedule.num_microbatches, schedule.weight_update
    per_microbatch = sync.zero >= 2
    groups = cols.microbatch if per_microbatch else step_group(update, m, cols.microbatch)
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
        group = tuple(mesh.data_group(home))
        buckets = _split(nbytes, sync.bucket_bytes)
        mine = cols.stage == stage
        for g in np.unique(groups[grads & mine]).tolist():
            if sync.overlap:
                trigger = int(np.flatnonzero(grads & mine & (groups == g)).max())
                offsets = [base.duration[trigger] * (j + 1) // len(buckets) for j in range(len(buckets))]
            else:
                trigger = int(np.flatnonzero(compute & (cols.device == home) & (groups == g)).max())
                offsets = [base.duration[trigger]] * len(buckets)
            if per_microbatch:  # the iteration's step waits; the next forwards wait for the step
                later = np.array([], dtype=np.int64)
                step = np.flatnonzero(steps & mine & (iteration == g // m))
            else:
                if update is WeightUpdate.ASYNC_STASH:  # the stage's next forward runs on the newest weights
                    later = np.flatnonzero(forwards & mine & (np.arange(len(steps)) > trigger))
                else:
                    later = np.flatnonzero(forwards & mine & (iteration == g + lag))
                step = np.flatnonzero(steps & mine & (groups == g))
            blocks = [int(later.min())] if len(later) else []
            blocks += step.tolist()  # the optimizer step applies the reduced gradients
            last_microbatch = g if per_microbatch else step_microbatch(update, m, g)
            kind = K.REDUCE_SCATTER if sync.sharded else K.ALL_REDUCE
            if sync.overlap and orders and trigger in orders:  # FSDP: each unit's gradients as its backward ends
                order = orders[trigger]
                found += [_Sync(trigger, order[j][2], Collective(stage, kind, last_microbatch, group, size, place),
                                blocks, trigger_segment=j) for j, place, size in _unit_shares(nbytes, order)]
                continue
            for j, (size, offset) in enumerate(zip(buckets, offsets)):
                collective = Collective(stage, kind, last_microbatch, group, size, j)
                found.append(_Sync(trigger, offset, collective, blocks))
    return found


def _next_uses(base: Program, entries: list[int], reading: np.ndarray) -> list[list[int]]:
    """Per entry of one device (in order), what an FSDP action there holds back: for an UNSHARD, its stage's next op
    that reads the weights; for a REDUCE_GRAD, its stage's optimizer steps after it (one walk backwards)."""
    cols = base.columns
    is_step = cols.kind == KIND_CODE[K.OPT]
    next_read: dict[int, int] = {}
    later_steps: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for i in reversed(entries):
        stage, kind = int(cols.stage[i]), base.actions[i].kind
        out.append([next_read[stage]] if kind is K.UNSHARD and stage in next_read
                   else list(later_steps.get(stage, ())) if kind is K.REDUCE_GRAD else [])
        if reading[i]:
            next_read[stage] = i
        elif is_step[i]:
            later_steps.setdefault(stage, []).append(i)
    return out[::-1]


def _split(nbytes: int, bucket: int) -> list[int]:
    """``nbytes`` in buckets of at most ``bucket`` bytes (the last one smaller); SyncError past MAX_BUCKETS."""
    count = max(1, math.ceil(nbytes / bucket))
    if count > MAX_BUCKETS:
        raise SyncError(f"cluster.bucket_size: got {bucket:,} bytes, which cuts a stage's {nbytes:,} gradient bytes "
                        f"into {count:,} buckets; expected at most {MAX_BUCKETS:,} buckets (DDP's default is 25MiB)")
    return [bucket] * (count - 1) + [nbytes - bucket * (count - 1)]


def _replicate(base: Program, mesh: DeviceMesh, syncs: list[_Sync], held: Sequence[int],
               segments: dict[int, list[int]]) -> Program:
    """Entries: each held replica's copy of the base entries (``held``, ascending: every replica, or those a folded run
    simulates), then each member entry of the syncs (one per member replica held). Flows: the held replicas'
    transfers, then one flow per sync shared by its members. An op run unit by unit (``segments``, per base entry)
    is so in every replica, each segment waiting for the syncs that block it."""
    n, flows, width = base.num_entries, base.num_flows, len(held)
    every = tuple(range(mesh.data))
    position = {r: j for j, r in enumerate(held)}
    members = [(c, r) for c, s in enumerate(syncs) for r in (s.replicas or every) if r in position]
    total = width * n + len(members)
    first_sync_flow = width * flows
    homes = [_home(s, base) for s in syncs]

    def moved(c: Collective | None, r: int) -> Collective | None:  # a base collective over replica r's devices
        return c if c is None or not r else c._replace(group=tuple(mesh.device(r, d) for d in c.group))

    def signal(s: int, j: int) -> int:  # a base signal in the j-th held replica
        return s + j * n if s < n else total + j * flows + (s - n)

    out = Program(actions=[], device=[], role=[], device_steps=[], launches=[], duration=[], waits=[], flow_of=[],
                  columns=base.columns)
    # what each base entry waits for: in every replica (a sync over all of them), or in some (HSDP's groups)
    blocked: dict[int, list[int]] = {}
    blocked_in: list[dict[int, list[int]]] = [{} for _ in range(mesh.data)]
    for c, s in enumerate(syncs):
        for entry in s.blocks:
            if s.segment:  # a later segment of an op run unit by unit waits: below, per replica
                continue
            if not s.replicas:
                blocked.setdefault(entry, []).append(total + first_sync_flow + c)
            for r in s.replicas:
                blocked_in[r].setdefault(entry, []).append(total + first_sync_flow + c)
    for j, r in enumerate(held):
        out.actions += [moved(a, r) if role is Role.COLLECTIVE else a for a, role in zip(base.actions, base.role)]
        out.device += [mesh.device(r, d) for d in base.device]
        out.role += base.role
        out.launches += [tuple(f + j * flows for f in fs) for fs in base.launches]
        out.duration += base.duration
        mine = blocked_in[r]  # merged once per replica, so the entries' loop looks up one table
        waits = {i: blocked.get(i, []) + mine.get(i, []) for i in blocked.keys() | mine.keys()} if mine else blocked
        out.waits += [[signal(s, j) for s in w] + waits.get(i, []) for i, w in enumerate(base.waits)]
        out.flow_of += [f + j * flows if f >= 0 else -1 for f in base.flow_of]
        out.device_steps += [[i + j * n for i in steps] for steps in base.device_steps]
    out.actions += [syncs[c].collective for c, _ in members]
    out.device += [mesh.device(r, homes[c]) for c, r in members]
    out.role += [Role.COLLECTIVE] * len(members)
    out.launches += [()] * len(members)
    out.duration += [0] * len(members)
    out.waits += [[] for _ in members]
    out.flow_of += [first_sync_flow + c for c, _ in members]
    out.joins = {i + j * n: [(f + j * flows, offset) for f, offset in joined]
                 for j in range(width) for i, joined in base.joins.items()}
    for c, r in members:
        s, flow = syncs[c], first_sync_flow + c
        if s.trigger == START:
            out.start_joins.append((flow, s.offset))
        elif s.trigger_segment:
            out.segment_joins.setdefault((s.trigger + position[r] * n, s.trigger_segment), []).append((flow, s.offset))
        elif s.trigger >= 0:
            out.joins.setdefault(s.trigger + position[r] * n, []).append((flow, s.offset))
        for entry in s.blocks if s.segment else ():
            out.segment_waits.setdefault((entry + position[r] * n, s.segment), []).append(total + flow)
    out.segments = {i + j * n: ns for j in range(width) for i, ns in segments.items()}
    for c, s in enumerate(syncs):
        for earlier in s.after:  # each member of ``s`` joins when one of these ends
            out.flow_joins.setdefault(first_sync_flow + earlier, []).append(first_sync_flow + c)
    if width < mesh.data:  # a folded run (simulator.fold): the members of the replicas not held are folded away
        out.joiners = {first_sync_flow + c: count for c, count in Counter(c for c, _ in members).items()}
    for j, r in enumerate(held):
        out.flow_src += [mesh.device(r, d) if d >= 0 else -1 for d in base.flow_src]
        out.flow_dst += [mesh.device(r, d) if d >= 0 else -1 for d in base.flow_dst]
        out.flow_bytes += base.flow_bytes
        out.flow_producer += [i + j * n if i >= 0 else -1 for i in base.flow_producer]
        out.flow_collective += [moved(c, r) for c in base.flow_collective]
    out.flow_src += [-1] * len(syncs)
    out.flow_dst += [-1] * len(syncs)
    out.flow_bytes += [s.collective.nbytes for s in syncs]
    out.flow_producer += [-1] * len(syncs)
    out.flow_collective += [s.collective for s in syncs]
    out.columns = Columns.of(out.actions, np.asarray(out.device, dtype=np.int64))
    return out
