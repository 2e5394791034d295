"""The planner: the fastest configuration of a model on a cluster under a memory cap (docs/planner.md).

It searches the space of ``experiments/plan_space.py`` (schedule x tensor width, with and without sequence
parallelism x data-parallel width x pipeline depth x microbatch size x recompute x vocabulary method), every GPU
used and the global batch fixed. Three steps, each through the sweep's executor path (a process pool or Dask):

1. **Screen** every candidate without simulating (``simulator.bounds``): a config ``load_config`` or ``prepare``
   refuses is rejected with its one-line reason; one whose memory lower bound exceeds the cap is rejected as OOM
   on that device by that many bytes; the rest get a throughput upper bound, the samples of an iteration over the
   busiest device's compute in one, or over the all-reduce floor when that is longer (the 2BW planner's equation
   without its p2p terms, which only add).
2. **Simulate** the survivors in order of that bound, a round at a time.
3. **Stop** once no unsimulated candidate's bound beats the ``top``-th best simulated throughput: the bound is a
   true bound, so the ranked table is the one an exhaustive simulation would give (tests/test_plan.py checks it).

Example::

    from pipescope.experiments.plan import plan
    from pipescope.experiments.plan_space import PlanRequest
    report = plan(PlanRequest({"model": {"preset": "gpt-355m"}, "cluster": {"topology": "dgx-a100"}}, 64))
    report.best  # {'schedule': ..., 'tensor': 1, 'width': ..., 'depth': ..., 'microbatch_size': ..., ...}
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import sys
import time
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from pipescope.config import ConfigError
from pipescope.experiments.plan_space import (
    PLAN_KEYS,
    Candidate,
    PlanRequest,
    candidates,
    check_request,
    config_fixed,
    config_fixed_not_for,
    file_keys_searched,
    planned_cluster,
)
from pipescope.experiments.sweep import (MemoryLog, Run, counted_bar, drain, process_pool, run_chunk, run_id,
                                         validated_config)

__all__ = ["PLAN_KEYS", "Candidate", "PlanReport", "PlanRequest", "Screened", "plan", "screen"]


@dataclass(frozen=True)
class Screened:
    """A candidate after screening: its run (None when rejected), bound and the reason it was rejected."""

    candidate: Candidate
    run: Run | None
    bound_samples_per_s: float = 0.0
    memory_bound_bytes: int = 0
    reason: str | None = None
    refined: bool = False  # the bound has had ``refine``

    @property
    def run_id(self) -> str:  # the sweep's drain names what a dead worker lost by it
        return self.run.run_id if self.run else self.candidate.run_id


@dataclass
class PlanReport:
    """``ranked``: simulated candidates that fit, fastest first (one dict each: PLAN_KEYS plus metrics);
    ``rejected``: every other candidate with its reason; ``best``: the first ranked (None if nothing fits). Equal
    throughputs rank by peak memory, least first, then by the plan's keys (so the order does not depend on which
    worker finished first)."""

    ranked: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    gpus: int
    candidates: int
    simulated: int
    wall_s: float
    best: dict[str, Any] | None = field(default=None)
    planned_for: str = ""  # the model, the machines and their GPUs (plan_space.planned_cluster)
    would_fit: dict[str, Any] | None = None  # nothing fits: what would (``_what_would_fit``)
    file_keys_searched: dict[str, Any] = field(default_factory=dict)  # base keys every candidate set for itself
    config_fixed: dict[str, Any] = field(default_factory=dict)  # base parallel keys every candidate ran with
    config_fixed_not_for: list[str] = field(default_factory=list)  # schedules that ran without its ZeRO/offload
    warnings: list[str] = field(default_factory=list)  # what the plan ran with that it doubts (a cap above the GPU's)


def screen(request: PlanRequest, candidate: Candidate) -> Screened:
    """Reject what cannot run or cannot fit; bound the throughput of the rest (module docstring, step 1)."""
    step = candidate.width * candidate.microbatch_size
    if request.global_batch % step:
        return Screened(candidate, None, reason=f"global batch {request.global_batch} is not divisible by width x "
                                                f"microbatch size = {step}")
    from pipescope.runner import model_errors

    try:
        config = validated_config(request.base, candidate.overrides(request.global_batch))
        with model_errors(config):
            return _bounded(candidate, Run(run_id(config), config, {}))
    except ConfigError as err:
        return Screened(candidate, None, reason=str(err))


def _bounded(candidate: Candidate, run: Run) -> Screened:
    from pipescope.runner import prepare_checked
    from pipescope.simulator.bounds import busy_per_iteration_ns, memory_lower_bounds
    from pipescope.simulator.lowering import defers_steps, gradient_buffers

    built = prepare_checked(run.config)
    if candidate.vocab == "redistribute" and _equal_split(built):
        return Screened(candidate, None, reason="redistribute keeps the equal layer split here: the same run as "
                                                "vocab naive")
    costs = built.stage_costs()
    config = built.config
    buffers = gradient_buffers(defers_steps(built.schedule.weight_update, config.cluster.data_parallel))
    sharding = config.parallel.sharding(config.cluster.data_parallel)
    memory = memory_lower_bounds(built.schedule, costs, config.model.precision, config.memory.runtime, buffers,
                                 sharding, built.overheads.total)
    worst = max(range(len(memory)), key=memory.__getitem__)
    capacity = built.capacity
    if capacity is not None and memory[worst] > capacity:
        return Screened(candidate, None, memory_bound_bytes=memory[worst],
                        reason=f"OOM on device {worst} by at least {memory[worst] - capacity:,} bytes (needs at "
                               f"least {memory[worst]:,}, has {capacity:,})")
    floor = max(max(busy_per_iteration_ns(built.schedule, costs)), _allreduce_floor(built, costs))
    return Screened(candidate, run, built.samples_per_iteration / (floor / 1e9), memory[worst])


def _grad_bytes(config) -> int:
    """Bytes per gradient the replicas reduce: the ledger's, from one function (``memory_runtime.grad_bytes``)."""
    from pipescope.simulator.memory_runtime import grad_bytes

    return grad_bytes(config.memory.runtime, config.model.precision)


_RATES: dict[tuple, float] = {}  # per worker process: (cluster, GPU ranks) -> the all-reduce's ns per byte


def _allreduce_floor(built, costs: list) -> int:
    """``bounds.allreduce_floor_ns`` over the run's routed network (analytic costs; otherwise 0, which leaves the
    compute bound alone), and ``_server_floor``: the larger. With tensor parallelism each of a
    device's GPUs all-reduces its own shard (the network's lanes), so the rate is measured with them all. Each
    group's rate is measured once per process."""
    from pipescope.simulator.bounds import allreduce_floor_ns
    from pipescope.simulator.routed import RoutedNetwork

    config = built.config
    if built.model is None or config.cluster.data_parallel <= 1:
        return 0
    network = functools.cache(built.network)  # built only where a rate or the server floor needs it (2.3 ms)
    kind = _gradient_collective(config)

    def ns_per_byte(group: list[int]) -> float:
        return _ns_per_byte(built, network, kind, group)

    # under HSDP a shard group's reduce-scatter is part of what each iteration moves: its own floor, still a floor
    width = config.cluster.data_parallel
    reduced_over = config.parallel.reduce_group(width)
    groups = allreduce_floor_ns(built.schedule, costs, _grad_bytes(config), reduced_over, ns_per_byte)
    # A flush schedule's iteration holds all its all-reduces; a run of several (2BW, PipeDream) takes at least its
    # busiest link's bytes over its rate per iteration (``result.iteration_times``), which is at least the bytes
    # into a server over all the links into it: the server floor bounds every schedule on a routed network (not
    # under HSDP, whose groups' bytes into a server the full group's collective does not bound from below)
    routed = isinstance(network(), RoutedNetwork)
    return max(groups, _server_floor(built, costs, network()) if routed and reduced_over == width else 0)


def _ns_per_byte(built, network, kind, group: list[int]) -> float:
    """The marginal ns per byte of the fastest ``kind`` over ``group`` on the idle network (``network()`` builds
    it; 0 when it is not routed), measured once per process for each cluster, width and GPU ranks."""
    from pipescope.simulator.routed import RoutedNetwork, time_alone

    config = built.config
    # the tensor and context widths too: the same first GPUs with other lanes are another network
    key = (config.cluster, config.faults, config.seed, config.parallel.gpus_per_device, kind,
           tuple(built.cluster.rank_of[d] for d in group))
    if key not in _RATES:
        if not isinstance(network(), RoutedNetwork):
            return 0.0
        one, two = (time_alone(network(), collective=(kind, group, n))[0]
                    for n in (RATE_PROBE_BYTES, 2 * RATE_PROBE_BYTES))
        _RATES[key] = max(0, two - one) / RATE_PROBE_BYTES
    return _RATES[key]


def _timed_reduction_floor(built, replay, network) -> int:
    """The gradient reductions of a flush schedule, timed by when they may start (docs/planner.md, "Three steps"): each
    stage's reduction starts no earlier than its last weight-gradient op (W or B) starts in ``replay`` (a run no
    op of the real one starts before, ``refine``), so on each resource the floors price (a device's replica group;
    a server's links in, ``_server_floor``), all the work of the stages that start at or after any time t is done
    after t, over ``network`` (the run's). One reduction an iteration only (plain data parallelism and ZeRO-1, not
    HSDP) on a routed network; else 0."""
    import numpy as np

    from pipescope.simulator.ir import ActionKind
    from pipescope.simulator.mesh import DeviceMesh
    from pipescope.simulator.routed import RoutedNetwork

    config = built.config
    width = config.cluster.data_parallel
    if (built.model is None or width <= 1 or config.parallel.zero_stage > 1 or config.parallel.reduce_group(width)
            < width or not isinstance(network, RoutedNetwork)):
        return 0
    records = replay.records
    grads = records.is_kind(ActionKind.W, ActionKind.B)
    starts = {int(s): int(records.start[grads & (records.stage == s)].max()) for s in np.unique(records.stage[grads])}
    costs, per_param = replay.stage_costs, _grad_bytes(config)
    mesh = DeviceMesh(built.schedule.num_devices, width)
    kind = _gradient_collective(config)
    capacity = _ingress_capacity(network.fabric)
    work: dict[tuple[str, int], list[tuple[int, float]]] = {}  # resource -> (earliest start, ns of work) per stage
    for stage, start in starts.items():
        nbytes = costs[stage].params * per_param
        group = mesh.data_group(built.schedule.stage_to_device[stage])
        rate = _ns_per_byte(built, lambda: network, kind, group)
        work.setdefault(("group", group[0]), []).append((start, nbytes * rate))
        for node, share in _server_shares(network, kind, group).items():
            if capacity.get(node):
                work.setdefault(("server", node), []).append((start, nbytes * share / capacity[node]))
    return max((_latest_finish(items) for items in work.values()), default=0)


def _latest_finish(items: list[tuple[int, float]]) -> int:
    """The least time by which one resource can have done work items that each start no earlier than their time:
    for every start t, t plus all the work starting at or after t."""
    best, total = 0, 0.0
    for start, ns in sorted(items, reverse=True):
        total += ns
        best = max(best, int(start + total))
    return best


def _gradient_collective(config):
    """What reduces the gradients: an all-reduce, or under ZeRO a reduce-scatter (half the bytes on the wire)."""
    from pipescope.simulator.ir import ActionKind

    return ActionKind.REDUCE_SCATTER if config.parallel.zero_stage else ActionKind.ALL_REDUCE


def _server_floor(built, costs: list, network) -> int:
    """Per iteration, the time every data-parallel group's all-reduce bytes take to enter the busiest server: each
    group's bytes into each server under the algorithm that moves the fewest there (ring, tree or hierarchical,
    whichever the run picks), summed over the groups, over the server's ingress bandwidth (every link into it from
    outside). Groups that share a server's NIC (p3.16xlarge: one for 8 GPUs) share that bandwidth, which the
    per-group floor leaves out."""
    from pipescope.simulator.bounds import gradient_bytes_per_iteration
    from pipescope.simulator.mesh import DeviceMesh

    mesh = DeviceMesh(built.schedule.num_devices, built.config.cluster.data_parallel)
    kind = _gradient_collective(built.config)
    entering: dict[int, float] = {}
    for d, nbytes in enumerate(gradient_bytes_per_iteration(built.schedule, costs, _grad_bytes(built.config))):
        for node, share in _server_shares(network, kind, mesh.data_group(d)).items():
            entering[node] = entering.get(node, 0.0) + nbytes * share
    capacity = _ingress_capacity(network.fabric)
    return max((int(b / capacity[node]) for node, b in entering.items() if capacity.get(node)), default=0)


def _server_shares(network, kind, group: list[int]) -> dict[int, float]:
    """Per server, the bytes entering it from another per byte reduced over ``group``: the least of the algorithms
    the run may pick (ring, tree, hierarchical)."""
    per_byte = [_ingress(phases, network.collectives.server_of)
                for phases in network.collectives.plans_of(kind, group, RATE_PROBE_BYTES).values()]
    return {node: min(moved.get(node, 0) for moved in per_byte) / RATE_PROBE_BYTES for node in set().union(*per_byte)}


def _ingress(phases: list, server: list[int]) -> dict[int, int]:
    """Bytes a collective's phases move into each server from another."""
    moved: dict[int, int] = {}
    for phase in phases:
        for src, dst, nbytes in phase.transfers:
            if server[src] != server[dst]:
                moved[server[dst]] = moved.get(server[dst], 0) + nbytes
    return moved


def _ingress_capacity(fabric) -> dict[int, float]:
    """Per server, the bytes per ns all links into it from outside carry at most (fabric nodes are server -1)."""
    nodes = fabric.graph.nodes
    capacity: dict[int, float] = {}
    for (a, b), rate in zip(fabric.names, fabric.capacity):
        inside, outside = nodes[b].get("node", -1), nodes[a].get("node", -1)
        if inside >= 0 and inside != outside:
            capacity[inside] = capacity.get(inside, 0.0) + rate
    return capacity


RATE_PROBE_BYTES = 256 << 20  # large enough that every algorithm's latency is the same in both probes


def _equal_split(built) -> bool:
    """The layer split ``redistribute`` picked is the equal one (so the run is naive's)."""
    from pipescope.simulator.models import stage_layers

    split = built.config.model.layers_per_stage
    return split is not None and list(split) == stage_layers(sum(split), len(split))


def screen_chunk(request: PlanRequest, chunk: list[Candidate]) -> list[Screened]:
    """Screen a chunk in a worker (with the request bound, the sweep's task signature: a list in, a list out)."""
    return [screen(request, candidate) for candidate in chunk]


def plan(request: PlanRequest, executor: Executor | None = None, workers: int | None = None,
         progress: bool = True) -> PlanReport:
    """Screen, simulate in bound order, stop when the top ``request.top`` are settled (module docstring).

    Args:
        executor: any ``concurrent.futures.Executor`` (``sweep.dask_executor``'s); None: a process pool of
            ``workers`` (default: the CPUs this process may use), shut down at the end.
        progress: tqdm bars on stderr for the two steps.

    Raises:
        ConfigError: the base config or the search space is bad, naming the key.
    """
    started = time.perf_counter()
    check_request(request)
    gpus, planned_for, warnings = planned_cluster(request.base)
    points = candidates(request, gpus)
    workers = workers or len(os.sched_getaffinity(0))
    pool = executor or process_pool(workers)
    try:
        screened = _screen_all(pool, request, points, workers, progress)
        ranked, rejected, simulated = _simulate_in_bound_order(pool, request, screened, workers, progress)
        if not ranked and not any("needs_bytes" in row for row in rejected):
            raise ConfigError(_refused_for(rejected))
        would_fit = None if ranked else _what_would_fit(pool, request, workers, progress)
    finally:
        if executor is None:
            pool.shutdown(wait=True, cancel_futures=True)
    return PlanReport(ranked, rejected, gpus, len(points), simulated, time.perf_counter() - started,
                      best=ranked[0] if ranked else None, planned_for=planned_for,
                      file_keys_searched=file_keys_searched(request), config_fixed=config_fixed(request),
                      config_fixed_not_for=config_fixed_not_for(request), would_fit=would_fit, warnings=warnings)


NODE_FACTORS = (1, 2, 4, 8, 16, 32, 64)  # the cluster's nodes times these, tried in turn when nothing fits
LEAST_MEMORY = {"recompute": ("full",), "microbatch_sizes": (1,)}  # the searched settings that hold the least
FIT_TRIALS = 4  # simulations per node count: the candidates with the least memory bound


def _what_would_fit(pool: Executor, request: PlanRequest, workers: int, progress: bool) -> dict[str, Any] | None:
    """When nothing fits: a plan that fits once simulated, on the cluster as it is with ZeRO-3 (``_fits_sharded``),
    else at the fewest nodes (the cluster's, then 2x, 4x ... 64x) where the search with its least-memory settings
    (full recompute, microbatch 1, the deepest pipelines, and the widest under ZeRO-3) has one;
    the fastest of the ``FIT_TRIALS`` candidates there with the least memory bound, not the best plan there (the
    command it prints plans that). None when none fits up to 64x, or when more nodes stop lowering the least memory
    any candidate needs (the embedding and output layer, say, which no pipeline splits)."""
    if progress:
        print("plan: nothing fits; looking for what would (ZeRO-3, full recompute, microbatch 1, more nodes)",
              file=sys.stderr)
    nodes = validated_config(request.base, {}).cluster.nodes
    sharded = _fits_sharded(pool, request, workers)
    if sharded is not None:
        return {**sharded, "nodes": nodes}
    searched = "full" in request.recompute and 1 in request.microbatch_sizes  # then 1x is the search just run
    least = math.inf
    for factor in NODE_FACTORS[1:] if searched else NODE_FACTORS:
        base = copy.deepcopy(request.base)
        base.setdefault("cluster", {})["nodes"] = nodes * factor
        wider = dataclasses.replace(request, base=base, top=1, zero=_and_zero_3(request.zero), **LEAST_MEMORY)
        try:
            gpus, _, _ = planned_cluster(base)
        except ConfigError:  # a topology of fixed size, say: no more nodes to try
            return None
        # ZeRO-3 where the schedules run it (2BW and PipeDream do not), else the search as asked
        every = _points_or_none(wider, gpus) or _points_or_none(dataclasses.replace(wider, zero=request.zero), gpus)
        points = _deepest([c for c in every if c.zero != 3]) + _widest([c for c in every if c.zero == 3])
        screened = _screen_all(pool, wider, points, workers, False)
        fitting = _least_memory([s for s in screened if s.candidate.zero != 3]) + \
            _least_memory([s for s in screened if s.candidate.zero == 3])  # each family its trials: the fastest wins
        ranked, _, _ = _simulate_in_bound_order(pool, wider, fitting, workers, False)
        if ranked:
            return {**ranked[0], "nodes": nodes * factor, "gpus": gpus}
        needs = min((s.memory_bound_bytes for s in screened if s.memory_bound_bytes), default=math.inf)
        if not fitting and needs >= least:
            return None
        least = min(least, needs)
    return None


def _fits_sharded(pool: Executor, request: PlanRequest, workers: int) -> dict[str, Any] | None:
    """On the cluster as it is: the search with ZeRO-3 and the least-memory settings, every width (sharding saves
    most where the replicas are many); the fastest of the ``FIT_TRIALS`` candidates with the least memory bound, or
    None. Skipped where the request searched ZeRO-3 already."""
    if request.zero is not None and 3 in request.zero:
        return None
    sharded = dataclasses.replace(request, top=1, zero=(3,), **LEAST_MEMORY)
    gpus, _, _ = planned_cluster(sharded.base)
    points = [c for c in _points_or_none(sharded, gpus) if c.zero == 3]
    if not points:  # no schedule or width of the search runs ZeRO-3
        return None
    screened = _screen_all(pool, sharded, points, workers, False)
    ranked, _, _ = _simulate_in_bound_order(pool, sharded, _least_memory(screened), workers, False)
    return {**ranked[0], "gpus": gpus} if ranked else None


def _points_or_none(request: PlanRequest, gpus: int) -> list[Candidate]:
    """The search's candidates, or none where it has none (``candidates`` says why with a ConfigError, which a
    search the user did not ask for must not report)."""
    try:
        return candidates(request, gpus)
    except ConfigError:
        return []


def _refused_for(rejected: list[dict]) -> str:
    """Why a search where nothing ran, none for memory, found nothing: its most common reason (each names its key),
    not where more memory or nodes would help."""
    reasons = Counter(str(row["reason"]) for row in rejected)
    reason, count = reasons.most_common(1)[0] if reasons else ("no candidate", 0)
    return f"{reason} (the reason of {count} of the {len(rejected)} candidates, none refused for memory)"


def _least_memory(screened: list[Screened]) -> list[Screened]:
    """The ``FIT_TRIALS`` candidates that passed the screen with the least memory bound."""
    return sorted((s for s in screened if not s.reason), key=lambda s: s.memory_bound_bytes)[:FIT_TRIALS]


def _and_zero_3(stages: tuple[int, ...] | None) -> tuple[int, ...]:
    """The ZeRO stages a search for what would fit tries: the request's (or none) and stage 3."""
    return tuple(sorted({*(stages or (0,)), 3}))


def _deepest(points: list[Candidate]) -> list[Candidate]:
    """Of each schedule and tensor width, the candidates with the fewest replicas: the deepest pipelines, whose
    GPUs each hold the fewest layers (a screen of every width at 64x the nodes took minutes)."""
    return _extreme(points, min)


def _widest(points: list[Candidate]) -> list[Candidate]:
    """Of each schedule and tensor width, the candidates with the most replicas: where ZeRO cuts the states finest."""
    return _extreme(points, max)


def _extreme(points: list[Candidate], pick) -> list[Candidate]:
    best: dict[tuple[str, int], int] = {}
    for c in points:
        best[c.schedule, c.tensor] = pick(best.get((c.schedule, c.tensor), c.width), c.width)
    return [c for c in points if c.width == best[c.schedule, c.tensor]]


def _screen_all(pool: Executor, request: PlanRequest, points: list[Candidate], workers: int,
                progress: bool) -> list[Screened]:
    bar = counted_bar(len(points), "plan: screen", "config", progress)
    return _map(pool, functools.partial(screen_chunk, request), points, workers, bar,
                chunks_per_worker=4)


def _simulate_in_bound_order(pool: Executor, request: PlanRequest, screened: list[Screened], workers: int,
                             progress: bool) -> tuple[list[dict], list[dict], int]:
    """Simulate survivors a round at a time, best bound first, until the next bound cannot enter the top. A bound
    is refined (``refine``) before its candidate is simulated: a round whose best bounds are not refined yet refines
    them, puts them back in order and looks again."""
    rejected = [_rejection(s.candidate, s.reason, s.memory_bound_bytes) for s in screened if s.reason]
    queue = sorted((s for s in screened if not s.reason), key=lambda s: -s.bound_samples_per_s)
    ranked: list[dict] = []
    simulated, round_size = 0, max(2 * workers, request.top)
    bar = counted_bar(len(queue), "plan: simulate", "config", progress)
    with bar:
        while queue and queue[0].bound_samples_per_s > _kth(ranked, request.top):
            kth = _kth(ranked, request.top)
            batch = [s for s in queue[:4 * round_size] if s.bound_samples_per_s > kth]
            rough = [s for s in batch if not s.refined]
            if rough:
                quiet = counted_bar(len(rough), "plan: refine", "config", False)
                refined = _map(pool, refine_chunk, rough, workers, quiet)
                queue = sorted(queue[len(batch):] + refined +
                               [s for s in batch if s.refined], key=lambda s: -s.bound_samples_per_s)
                continue
            batch, queue = batch[:round_size], queue[min(round_size, len(batch)):]
            simulated += len(batch)
            by_id = {s.run.run_id: s for s in batch}
            rows = MemoryLog()
            lost = drain(pool, [[s.run] for s in batch], rows, 2 * workers, _Quiet(bar), task=run_chunk)
            for row in rows:
                _file(by_id[row["run_id"]], row, ranked, rejected)
            rejected += [_rejection(by_id[rid].candidate, f"lost with a worker: {why}") for rid, why in lost]
            ranked.sort(key=lambda r: (-r["throughput_samples_per_s"], r["peak_memory_bytes"],
                                       [str(r[key]) for key in PLAN_KEYS]))  # the plan itself breaks a tie
    best = _kth(ranked, request.top)
    rejected += [_rejection(s.candidate, f"pruned: at most {s.bound_samples_per_s:.4g} samples/s (its bound), not "
                                         f"above the top {request.top}'s {best:.4g}") for s in queue]
    return ranked, rejected, simulated


def _map(pool: Executor, task, items: list, workers: int, bar, chunks_per_worker: int = 2) -> list:
    """``task`` over ``items`` in chunks (at most 64 items, about ``chunks_per_worker`` per worker) on the pool (the
    sweep's ``drain``), results in the items' order (so the report does not depend on which worker finished
    first); RuntimeError if a worker died with some."""
    size = max(1, min(64, -(-len(items) // (chunks_per_worker * workers))))
    rows = MemoryLog()
    lost = drain(pool, [items[i:i + size] for i in range(0, len(items), size)], rows, 2 * workers, bar, task=task)
    if lost:
        raise RuntimeError(f"plan: {len(lost)} candidates were lost with a worker: {lost[0][1]}")
    order = {_candidate_id(item): i for i, item in enumerate(items)}
    return sorted(rows, key=lambda row: order[_candidate_id(row)])


def _candidate_id(item: Candidate | Screened) -> str:
    return getattr(item, "candidate", item).run_id


def refine(screened: Screened) -> Screened:
    """``screened`` with a tighter bound where one is cheap and true: a flush schedule (one iteration, whose time is
    its makespan) runs no faster than one replica whose transfers each take their time alone on the idle network
    and whose collectives take none (``bounds.AloneTransfers``; on a network that is not routed, a free one), since
    shared links and the all-reduces only delay ops whose order on each device is fixed; and the gradient
    reductions timed from that run (``_timed_reduction_floor``). That costs 10-120 ms; without faults only (jitter
    can make an op faster than its cost)."""
    from pipescope.runner import model_errors, prepare_checked
    from pipescope.simulator.bounds import AloneTransfers
    from pipescope.simulator.faults import FaultsConfig
    from pipescope.simulator.ir import WeightUpdate
    from pipescope.simulator.routed import RoutedNetwork
    from pipescope.simulator.simulate import simulate

    built = prepare_checked(screened.run.config)
    schedule, config = built.schedule, built.config
    if schedule.weight_update is not WeightUpdate.FLUSH or config.faults != FaultsConfig():
        return dataclasses.replace(screened, refined=True)
    try:
        with model_errors(config):
            network = built.network()
            floor = AloneTransfers(network) if isinstance(network, RoutedNetwork) else None
            replay = simulate(schedule, built.costs, floor)
            makespan_s = max(replay.makespan_ns, _timed_reduction_floor(built, replay, network)) / 1e9
    except ConfigError:  # the candidate's own simulation says why, as an error row
        return dataclasses.replace(screened, refined=True)
    bound = min(screened.bound_samples_per_s, built.samples_per_iteration / makespan_s)
    return dataclasses.replace(screened, bound_samples_per_s=bound, refined=True)


def refine_chunk(chunk: list[Screened]) -> list[Screened]:
    """``refine`` over a chunk in a worker (the sweep's task signature)."""
    return [refine(s) for s in chunk]


def _kth(ranked: list[dict], k: int) -> float:
    """The k-th best simulated throughput so far (0 while fewer than k fit)."""
    return ranked[k - 1]["throughput_samples_per_s"] if len(ranked) >= k else 0.0


def _file(screened: Screened, row: dict, ranked: list[dict], rejected: list[dict]) -> None:
    """Put a simulated row in the ranked list, or reject it (an error, or OOM once simulated)."""
    candidate = screened.candidate
    if row["status"] != "ok":
        rejected.append(_rejection(candidate, row["error"]))
    elif row["oom"]:
        over = row["peak_memory_bytes"] - row["memory_capacity_bytes"]
        rejected.append(_rejection(candidate, f"OOM by {over:,} bytes once simulated (peak "
                                              f"{row['peak_memory_bytes']:,}, has {row['memory_capacity_bytes']:,})",
                                   row["peak_memory_bytes"]))
    else:
        ranked.append({**candidate.as_dict(), "microbatches": row["schedule.microbatches"],
                       **{key: row[key] for key in ("throughput_samples_per_s", "tokens_per_s",
                                                    "tokens_per_s_per_gpu", "tflops_per_gpu", "iteration_time_s",
                                                    "peak_memory_bytes", "bubble_rate", "mfu", "hfu")},
                       "bound_samples_per_s": screened.bound_samples_per_s})


def _rejection(candidate: Candidate, reason: str | None, needs_bytes: int = 0) -> dict[str, Any]:
    """A rejected candidate; an OOM one with the bytes it needs (a lower bound if screened, the peak if simulated)."""
    return {**candidate.as_dict(), "reason": reason, **({"needs_bytes": needs_bytes} if needs_bytes else {})}


class _Quiet:
    """One bar for all simulation rounds: ``drain`` enters and updates the bar it is given, so each round gets
    this wrapper, which forwards updates and leaves closing to the caller."""

    def __init__(self, bar):
        self._bar = bar

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        self._bar.update(n)

    def write(self, *args: Any, **kwargs: Any) -> None:
        self._bar.write(*args, **kwargs)


