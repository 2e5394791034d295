"""The planner: the fastest configuration of a model on a cluster under a memory cap (docs/planner.md).

It searches schedule x tensor width (with and without sequence parallelism) x data-parallel width x pipeline
depth x microbatch size x recompute (none, selective, full), with every GPU used (tensor x width x depth = GPUs)
and the global batch fixed (microbatches = batch / (width x microbatch size)). Three steps, each through the sweep's
executor path (a process pool or Dask):

1. **Screen** every candidate without simulating (``simulator.bounds``): a config ``load_config`` or ``prepare``
   refuses is rejected with its one-line reason; one whose memory lower bound exceeds the cap is rejected as OOM
   on that device by that many bytes; the rest get a throughput upper bound, the samples of an iteration over the
   busiest device's compute in one (the 2BW planner's equation without its communication terms, which only add).
2. **Simulate** the survivors in order of that bound, a round at a time.
3. **Stop** once no unsimulated candidate's bound beats the ``top``-th best simulated throughput: the bound is a
   true bound, so the ranked table is the one an exhaustive simulation would give (tests/test_plan.py checks it).

Example::

    from pipescope.experiments.plan import PlanRequest, plan
    report = plan(PlanRequest({"model": {"preset": "gpt-355m"}, "cluster": {"topology": "dgx-a100"}}, 64))
    report.best  # {'schedule': ..., 'tensor': 1, 'width': ..., 'depth': ..., 'microbatch_size': ..., ...}
"""

from __future__ import annotations

import copy
import functools
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from pipescope.config import ConfigError
from pipescope.experiments.sweep import Run, drain, process_pool, run_chunk, run_id, validated_config

# The 2BW paper's planner space plus the zero-bubble and V families (issue 14); PipeDream's weight stashing rarely
# fits, but the planner says so rather than leaving it out.
DEFAULT_SCHEDULES = ("2bw", "1f1b", "gpipe", "pipedream", "interleaved", "zb-h1", "zb-v", "v-half")
DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)
PLAN_KEYS = ("schedule", "tensor", "width", "depth", "microbatch_size", "recompute", "sequence", "vocab")
RECOMPUTE = ("none", "selective", "full")  # schedule.recompute (simulator/parallel.py)
VOCAB_METHODS = ("naive", "redistribute", "vocab-1", "vocab-2", "interlaced")  # simulator/vocab.py VocabMethod


@dataclass(frozen=True)
class Candidate:
    """One point of the search: what ``best`` reports (``PLAN_KEYS``)."""

    schedule: str
    tensor: int
    width: int
    depth: int
    microbatch_size: int
    recompute: str  # one of RECOMPUTE
    sequence: bool = False  # sequence parallelism (only with tensor > 1)
    vocab: str = "naive"  # schedule.vocab (docs/schedules.md section 7)

    def overrides(self, global_batch: int) -> dict[str, Any]:
        """The dotted config keys this candidate sets (``global_batch`` divisible by width x microbatch size)."""
        keys = {"schedule.name": self.schedule, "schedule.stages": self.depth,
                "schedule.microbatches": global_batch // (self.width * self.microbatch_size),
                "schedule.recompute": self.recompute, "model.microbatch_size": self.microbatch_size,
                "cluster.data_parallel": self.width, "schedule.vocab": self.vocab}
        if self.tensor != 1:
            keys["parallel.tensor"] = self.tensor
            keys["parallel.sequence"] = self.sequence
        return keys

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in PLAN_KEYS}

    @property
    def run_id(self) -> str:  # the sweep's drain names what a dead worker lost by it
        return ", ".join(f"{key}={value}" for key, value in self.as_dict().items())


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a config mapping (the sections of docs/cli.md: model, cluster with topology, nodes and memory,
    costs) and the search space."""

    base: dict[str, Any]
    global_batch: int
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCH_SIZES
    recompute: tuple[str, ...] = RECOMPUTE
    tensor: tuple[int, ...] = (1, 2, 4, 8)
    sequence: tuple[bool, ...] = (False, True)
    depths: tuple[int, ...] | None = None  # None: every pipeline depth that divides the GPUs
    vocab: tuple[str, ...] = VOCAB_METHODS
    top: int = 5


@dataclass(frozen=True)
class Screened:
    """A candidate after screening: its run (None when rejected), bound and the reason it was rejected."""

    candidate: Candidate
    run: Run | None
    bound_samples_per_s: float = 0.0
    memory_bound_bytes: int = 0
    reason: str | None = None


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


def gpu_count(base: dict[str, Any]) -> int:
    """GPUs of the cluster the base config names (its topology x nodes); ConfigError naming the key if it cannot."""
    from pipescope.topologies.cluster import gpu_nodes
    from pipescope.topologies.topology_io import load_topology

    cluster = validated_config(base, {}).cluster
    try:
        graph = load_topology(cluster.topology, cluster.nodes, cluster.fabric, cluster.oversubscription)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return len(gpu_nodes(graph))


def candidates(request: PlanRequest, gpus: int) -> list[Candidate]:
    """Every point of the space that uses all ``gpus``, in a fixed order."""
    out = []
    for tensor in request.tensor:
        if gpus % tensor:
            continue
        for width in _divisors(gpus // tensor):
            depth = gpus // tensor // width
            if request.depths is not None and depth not in request.depths:
                continue
            for b in request.microbatch_sizes:
                for name in _schedules_at(depth, request.schedules):
                    out += [Candidate(name, tensor, width, depth, b, r, q, v) for r in request.recompute
                            for q in (request.sequence if tensor > 1 else (False,))
                            for v in _vocab_methods(name, depth, tensor, request.vocab)]
    return out


def _vocab_methods(schedule: str, depth: int, tensor: int, methods: tuple[str, ...]) -> list[str]:
    """The vocabulary methods that exist for this schedule (the sharded ones with 1F1B and V-Half only, and not
    with tensor parallelism) and change something (none without pipelining)."""
    from pipescope.simulator.vocab import SHARDED, VocabMethod, vocab_method

    if depth == 1:
        return [VocabMethod.NAIVE.value] if VocabMethod.NAIVE.value in methods else list(methods[:1])
    kept = []
    for method in methods:
        try:
            parsed = vocab_method(method, schedule)
        except ValueError:
            continue
        if not (tensor > 1 and parsed in SHARDED):
            kept.append(method)
    return kept


def _schedules_at(depth: int, schedules: tuple[str, ...]) -> tuple[str, ...]:
    """Without pipelining every schedule is the same data-parallel run: plan it once (as 1F1B when asked for)."""
    if depth > 1:
        return schedules
    return ("1f1b",) if "1f1b" in schedules else schedules[:1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def screen(request: PlanRequest, candidate: Candidate) -> Screened:
    """Reject what cannot run or cannot fit; bound the throughput of the rest (module docstring, step 1)."""
    step = candidate.width * candidate.microbatch_size
    if request.global_batch % step:
        return Screened(candidate, None, reason=f"global batch {request.global_batch} is not divisible by width x "
                                                f"microbatch size = {step}")
    try:
        config = validated_config(request.base, candidate.overrides(request.global_batch))
        return _bounded(candidate, Run(run_id(config), config, {}))
    except ConfigError as err:
        return Screened(candidate, None, reason=str(err))


def _bounded(candidate: Candidate, run: Run) -> Screened:
    from pipescope.runner import prepare
    from pipescope.simulator.bounds import busy_per_iteration_ns, memory_lower_bounds
    from pipescope.simulator.lowering import defers_steps

    built = prepare(run.config)
    if candidate.vocab == "redistribute" and _equal_split(built):
        return Screened(candidate, None, reason="redistribute keeps the equal layer split here: the same run as "
                                                "vocab naive")
    costs = built.stage_costs()
    config = built.config
    buffers = 2 if defers_steps(built.schedule.weight_update, config.cluster.data_parallel) else 1
    memory = memory_lower_bounds(built.schedule, costs, config.model.precision, config.memory.runtime, buffers)
    worst = max(range(len(memory)), key=memory.__getitem__)
    capacity = built.capacity
    if capacity is not None and memory[worst] > capacity:
        return Screened(candidate, None, memory_bound_bytes=memory[worst],
                        reason=f"OOM on device {worst} by at least {memory[worst] - capacity:,} bytes (needs at "
                               f"least {memory[worst]:,}, has {capacity:,})")
    samples = built.schedule.num_microbatches * built.config.model.microbatch_size * built.config.cluster.data_parallel
    floor = max(max(busy_per_iteration_ns(built.schedule, costs)), _allreduce_floor(built, costs))
    return Screened(candidate, run, samples / (floor / 1e9), memory[worst])


_RATES: dict[tuple, float] = {}  # per worker process: (cluster, GPU ranks) -> the all-reduce's ns per byte


def _allreduce_floor(built, costs: list) -> int:
    """``bounds.allreduce_floor_ns`` over the run's routed network (analytic costs; otherwise 0, which leaves the
    compute bound alone). With tensor parallelism the simulator runs a device's all-reduce from the first of its
    GPUs, as ``Cluster.rank_of`` places it, so the floor is taken there too. Each group's rate is measured once
    per process."""
    from pipescope.simulator.bounds import allreduce_floor_ns
    from pipescope.simulator.ir import ActionKind
    from pipescope.simulator.routed import RoutedNetwork, time_alone

    config = built.config
    if built.model is None or config.cluster.data_parallel <= 1:
        return 0
    network = None

    def ns_per_byte(group: list[int]) -> float:
        nonlocal network
        key = (config.cluster, config.faults, config.seed, tuple(built.cluster.rank_of[d] for d in group))
        if key not in _RATES:
            network = network or built.network()
            if not isinstance(network, RoutedNetwork):
                return 0.0
            one, two = (time_alone(network, collective=(ActionKind.ALL_REDUCE, group, n))[0]
                        for n in (RATE_PROBE_BYTES, 2 * RATE_PROBE_BYTES))
            _RATES[key] = max(0, two - one) / RATE_PROBE_BYTES
        return _RATES[key]

    return allreduce_floor_ns(built.schedule, costs, config.model.precision, config.cluster.data_parallel,
                              ns_per_byte)


RATE_PROBE_BYTES = 256 << 20  # large enough that every algorithm's latency is the same in both probes


def _equal_split(built) -> bool:
    """The layer split ``redistribute`` picked is the equal one (so the run is naive's)."""
    from pipescope.simulator.models import stage_layers

    split = built.config.model.layers_per_stage
    return split is not None and list(split) == stage_layers(sum(split), len(split))


def screen_chunk(request: PlanRequest, chunk: list[Candidate]) -> list[Screened]:
    """Screen a chunk in a worker (with the request bound, the sweep's task signature: a list in, a list out)."""
    return [screen(request, candidate) for candidate in chunk]


class _Rows(list):
    """An in-memory stand-in for the sweep's run log: ``drain`` appends each finished chunk's rows."""

    def append(self, rows: list) -> None:  # type: ignore[override]
        self.extend(rows)


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
    _check_request(request)
    gpus = gpu_count(request.base)
    points = candidates(request, gpus)
    workers = workers or len(os.sched_getaffinity(0))
    pool = executor or process_pool(workers)
    try:
        screened = _screen_all(pool, request, points, workers, progress)
        ranked, rejected, simulated = _simulate_in_bound_order(pool, request, screened, workers, progress)
    finally:
        if executor is None:
            pool.shutdown(wait=True, cancel_futures=True)
    return PlanReport(ranked, rejected, gpus, len(points), simulated, time.perf_counter() - started,
                      best=ranked[0] if ranked else None)


def _check_request(request: PlanRequest) -> None:
    if request.global_batch < 1:
        raise ConfigError(f"--global-batch: got {request.global_batch}, expected a positive integer")
    for key, values in (("--microbatch-sizes", request.microbatch_sizes), ("--tensor", request.tensor),
                        ("--depths", request.depths or (1,))):
        if not values or any(v < 1 for v in values):
            raise ConfigError(f"{key}: got {list(values)}, expected positive integers")
    if not request.schedules:
        raise ConfigError("--schedules: got none, expected at least one schedule name")
    bad_vocab = [v for v in request.vocab if v not in VOCAB_METHODS]
    if bad_vocab or not request.vocab:
        raise ConfigError(f"--vocab: got {list(request.vocab)}, expected some of {', '.join(VOCAB_METHODS)}")
    bad = [r for r in request.recompute if r not in RECOMPUTE]
    if bad or not request.recompute:
        raise ConfigError(f"--recompute: got {list(request.recompute)}, expected some of {', '.join(RECOMPUTE)}")
    from pipescope.simulator.schedules import named_generator

    for name in request.schedules:  # a typo fails before any work, not once per candidate
        try:
            named_generator(name)
        except ValueError as err:
            raise ConfigError(f"--schedules: {err}") from None
    if request.top < 1:
        raise ConfigError(f"--top: got {request.top}, expected a positive integer")


def _screen_all(pool: Executor, request: PlanRequest, points: list[Candidate], workers: int,
                progress: bool) -> list[Screened]:
    size = max(1, min(64, -(-len(points) // (4 * workers))))
    rows = _Rows()
    lost = drain(pool, [points[i:i + size] for i in range(0, len(points), size)], rows, 2 * workers,
                 _bar(len(points), "screen", progress), task=functools.partial(screen_chunk, request))
    if lost:
        raise RuntimeError(f"plan: {len(lost)} candidates were lost with a worker: {lost[0][1]}")
    return list(rows)


def _simulate_in_bound_order(pool: Executor, request: PlanRequest, screened: list[Screened], workers: int,
                             progress: bool) -> tuple[list[dict], list[dict], int]:
    """Simulate survivors a round at a time, best bound first, until the next bound cannot enter the top."""
    rejected = [_rejection(s.candidate, s.reason) for s in screened if s.reason]
    queue = sorted((s for s in screened if not s.reason), key=lambda s: -s.bound_samples_per_s)
    by_id = {s.run.run_id: s for s in queue}
    ranked: list[dict] = []
    done, round_size = 0, max(2 * workers, request.top)
    bar = _bar(len(queue), "simulate", progress)
    with bar:
        while done < len(queue) and queue[done].bound_samples_per_s > _kth(ranked, request.top):
            batch = queue[done:done + round_size]
            done += len(batch)
            rows = _Rows()
            drain(pool, [[s.run] for s in batch], rows, 2 * workers, _Quiet(bar), task=run_chunk)
            for row in rows:
                _file(by_id[row["run_id"]], row, ranked, rejected)
            ranked.sort(key=lambda r: (-r["throughput_samples_per_s"], r["peak_memory_bytes"],
                                       [str(r[key]) for key in PLAN_KEYS]))  # the plan itself breaks a tie
    best = _kth(ranked, request.top)
    rejected += [_rejection(s.candidate, f"pruned: at most {s.bound_samples_per_s:.4g} samples/s (the busiest "
                                         f"device's compute), not above the top {request.top}'s {best:.4g}")
                 for s in queue[done:]]
    return ranked, rejected, done


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
                                              f"{row['peak_memory_bytes']:,}, has {row['memory_capacity_bytes']:,})"))
    else:
        ranked.append({**candidate.as_dict(), "microbatches": row["schedule.microbatches"],
                       **{key: row[key] for key in ("throughput_samples_per_s", "iteration_time_s",
                                                    "peak_memory_bytes", "bubble_rate", "mfu")},
                       "bound_samples_per_s": screened.bound_samples_per_s})


def _rejection(candidate: Candidate, reason: str | None) -> dict[str, Any]:
    return {**candidate.as_dict(), "reason": reason}


def _bar(total: int, step: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="config", desc=f"plan: {step}", disable=not enabled, smoothing=0.1)


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


def base_config(model: str, topology: str, nodes: int, memory_cap: int | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config mapping of ``pipescope plan``'s flags, ``extra`` (a config file's sections) beneath them."""
    base = copy.deepcopy(extra or {})
    base.setdefault("model", {})["preset"] = model
    cluster = base.setdefault("cluster", {})
    cluster.update({"topology": topology, "nodes": nodes})
    if memory_cap is not None:
        cluster["memory"] = memory_cap
    return base
