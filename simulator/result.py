"""Simulation results: built from a timeline and the stage costs, so a replay and a measured run compare field by
field. Iteration time, bubble rate, per-device busy/span/idle/memory, MFU and the resolved config."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from pipescope.simulator.costs import StageCost
from pipescope.simulator.ir import ActionKind, Role, Schedule
from pipescope.simulator.memory_overheads import NO_OVERHEADS, Overheads
from pipescope.simulator.program import KIND_CODE
from pipescope.simulator.memory import DeviceMemory, ledger
from pipescope.simulator.mesh import NO_SHARDING, Sharding
from pipescope.simulator.timeline import Timeline, uncovered_ns
from pipescope.simulator.readers.units import format_bytes, format_time


@dataclass(frozen=True)
class DeviceStats:
    """One device's numbers; ``span_s`` is end of its last compute op minus start of its first."""

    device: int
    busy_s: float
    span_s: float
    idle_fraction: float
    peak_memory_bytes: int
    peak_activations: float
    static_memory_bytes: int
    exposed_comm_s: float = 0.0
    exposed_allreduce_s: float = 0.0


@dataclass(eq=False, repr=False)  # equal only to itself: comparing arrays field by field raises
class SimResult:
    """Everything one simulation measured.

    Attributes:
        iteration_ns: the makespan of one iteration; for schedules without a flush that span
            several iterations, the steady-state time between consecutive iterations' ends.
        fill_drain_ns: for multi-iteration runs, the makespan minus iterations x steady state.
        bubble_rate: 1 - sum(busy) / (D x max span) over the whole run (docs/schedules.md section 0).
        records: every action's device, stream, start and end (``timeline`` is the same as a DataFrame).
        devices: one entry per device of every replica; ``memory`` has replica 0's only (every replica holds the
            same), its ``times`` in ns.
        config: the resolved ``pipescope.Config`` this result came from, when it came from one.
    """

    schedule: Schedule
    records: Timeline
    devices: list[DeviceStats]
    memory: list[DeviceMemory]
    iteration_ns: int
    fill_drain_ns: int
    makespan_ns: int
    bubble_rate: float
    samples_per_iteration: int
    sim_wall_s: float = 0.0
    memory_capacity_bytes: int | None = None
    model_flops_per_iteration: float | None = None
    peak_flops_per_device: float | None = None
    hardware_flops_per_iteration: float | None = None  # model FLOPs plus what recompute runs again
    warnings: list[str] = field(default_factory=list)
    config: Any = None
    links: list[dict] = field(default_factory=list)  # per directed edge that carried bytes (RoutedNetwork)
    network: dict = field(default_factory=dict)  # flows, rate updates, collective algorithms used
    link_spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # busiest edges: busy spans (ns)
    stage_costs: list[StageCost] = field(default_factory=list)  # what the ledger was fed, to rebuild a result from
    precision: str = "bf16"  # another timeline of the same run (``with_timeline``)
    memory_runtime: str = "megatron"  # whose buffers the ledger counted (``simulator.memory_runtime``)
    gradient_buffers: int = 1  # 2 where steps are deferred (2BW with replicas, ``lowering.add_optimizer_steps``)
    kernels: list[dict] = field(default_factory=list)  # analytic costs: the roofline per kernel (docs/costs.md)
    memory_overheads: Overheads = NO_OVERHEADS  # per GPU, besides tensors; in every device's static bytes
    cluster_name: str = ""  # the topology's own name (a file's ``name``), for the report's headline
    cluster_nodes: int = 0  # the servers of the machine the run had (a full graph's own count), 0: unknown
    tokens_per_sample: int | None = None  # the sequence length, when the cost model knows the model
    gpus_per_device: int = 1  # the tensor-parallel width: a pipeline device is that many GPUs
    model_params: int | None = None  # the model's parameters, each once (``ModelSpec.total_params``), when known

    def __repr__(self) -> str:
        """One line: the default would print the whole schedule and timeline (100 KB for a demo run)."""
        s = self.schedule
        peak = self.peak_memory_bytes
        memory = f"peak memory {format_bytes(peak)}" if peak else "no memory counted"
        return (f"<SimResult {s.name} p={s.num_devices} m={s.num_microbatches} v={s.chunks}: iteration "
                f"{format_time(self.iteration_time_s)}, bubble rate {self.bubble_rate:.2%}, {memory}, "
                f"{len(self.records):,} actions>")

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_ns / 1e9

    @property
    def throughput_samples_per_s(self) -> float:
        return self.samples_per_iteration / self.iteration_time_s if self.iteration_ns else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max(d.peak_memory_bytes for d in self.devices)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second over the pipeline's peak, when the cost model knows both."""
        return self._utilization(self.model_flops_per_iteration)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs (the model's plus the forwards recompute runs again) per second over the pipeline's peak:
        the convention of sources that count recompute, such as Megatron-LM's equation 3."""
        return self._utilization(self.hardware_flops_per_iteration)

    @property
    def gpus(self) -> int:
        """GPUs the run uses: every replica's pipeline devices, each ``gpus_per_device`` GPUs."""
        return self.records.num_devices * self.gpus_per_device

    @property
    def tokens_per_s(self) -> float | None:
        """Training tokens per second over all replicas (samples/s x sequence length), when the model is known."""
        return self.throughput_samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        tokens = self.tokens_per_s
        return tokens / self.gpus if tokens is not None else None

    @property
    def tflops_per_gpu(self) -> float | None:
        """Model TFLOP/s each GPU achieves (MFU x the GPU's peak, in 10^12 FLOP/s), as Megatron-LM reports."""
        mfu = self.mfu
        return mfu * self.peak_flops_per_device / self.gpus_per_device / 1e12 if mfu is not None else None

    def _utilization(self, flops: float | None) -> float | None:
        if not flops or not self.peak_flops_per_device or not self.iteration_ns:
            return None
        return flops / self.iteration_time_s / (self.peak_flops_per_device * self.schedule.num_devices)

    @property
    def data_parallel(self) -> int:
        """Pipeline replicas the run simulated (their devices follow each other: replica r's device d is r*D + d)."""
        return self.records.num_devices // self.schedule.num_devices

    @property
    def exposed_allreduce_s(self) -> float:
        """The most gradient all-reduce time any device spends not hidden behind its compute."""
        return max((d.exposed_allreduce_s for d in self.devices), default=0.0)

    @property
    def oom(self) -> list[dict]:
        """Devices whose peak exceeds the device memory: device, needed and available bytes (empty, so false, when
        every device fits)."""
        cap = self.memory_capacity_bytes
        if cap is None:
            return []
        return [{"device": d.device, "peak_memory_bytes": d.peak_memory_bytes, "capacity_bytes": cap}
                for d in self.devices if d.peak_memory_bytes > cap]

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """One row per action: device, stream, action, kind, stage, chunk, microbatch, start_ns, end_ns, bytes."""
        return self.records.to_frame()

    def summary(self) -> dict:
        """The JSON object ``simulate --json`` prints (docs/cli.md's fields and a few more)."""
        s = self.schedule
        return {
            "schedule": s.name,
            "stages": s.num_stages,
            "devices": s.num_devices,
            "data_parallel": self.data_parallel,
            "chunks": s.chunks,
            "microbatches": s.num_microbatches,
            "iterations": s.iterations,
            "weight_update": s.weight_update,
            "recompute": _recompute(self.config, s),
            "layers_per_stage": _layer_split(self.config),
            **_what_ran(self.config, self.tokens_per_sample, self.cluster_nodes),
            "iteration_time_s": self.iteration_time_s,
            "fill_drain_s": self.fill_drain_ns / 1e9,
            "makespan_s": self.makespan_ns / 1e9,
            "bubble_rate": self.bubble_rate,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "gpus": self.gpus,
            "model_params": self.model_params,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_overheads": self.memory_overheads.as_dict(),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "oom": self.oom,
            "sim_wall_s": self.sim_wall_s,
            "ops": int(self.records.mask(Role.COMPUTE).sum()),
            "transfers": int(self.records.mask(Role.SEND).sum()),
            "exposed_allreduce_s": self.exposed_allreduce_s,
            "network": self.network,
            "warnings": self.warnings,
            "per_device": [{
                "device": d.device, "busy_s": d.busy_s, "span_s": d.span_s, "idle_fraction": d.idle_fraction,
                "peak_memory_bytes": d.peak_memory_bytes, "peak_activations": d.peak_activations,
                "static_memory_bytes": d.static_memory_bytes,
                "weight_versions": s.versions(d.device % s.num_devices), "exposed_comm_s": d.exposed_comm_s,
                "exposed_allreduce_s": d.exposed_allreduce_s,
            } for d in self.devices],
            "links": self.links,
            "kernels": self.kernels,
        }


PARALLEL_KEYS = ("tensor", "sequence", "tp_comm_overlap", "context", "context_comm", "shard_group",
                 "reshard_after_forward", "zero_prefetch", "offload")


def _what_ran(config: Any, seq: int | None, nodes: int) -> dict[str, Any]:
    """The model, machine and parallel layout a run's config gave it, as its text headline says them (empty for a
    run built without a config; ``model`` null under uniform costs, which simulate none): ``parallel.zero`` is the
    stage that ran (1 under ``distributed_optimizer``), the nodes the machine's (``nodes``: a full graph's own count;
    0, the config's)."""
    if config is None:
        return {}
    m, c, p = config.model, config.cluster, config.parallel
    costs = getattr(getattr(config.costs, "kind", None), "value", None)
    uniform = costs == "uniform"  # no model simulated
    model = {"name": m.label, "seq": seq, "microbatch_size": m.microbatch_size, "precision": m.precision,
             "attention": m.attention if costs == "analytic" else None}  # a profile timed what calibrate ran
    return {"model": None if uniform else model,
            "cluster": {"topology": c.topology, "nodes": nodes or c.nodes},
            "parallel": {"zero": p.zero_stage, **{key: getattr(p, key) for key in PARALLEL_KEYS}}}


def _recompute(config: Any, schedule: Schedule) -> str:
    """``none``, ``selective`` or ``full``: the config's mode (the schedule knows only whether F's are rerun)."""
    mode = getattr(getattr(config, "schedule", None), "recompute", None)
    return mode if isinstance(mode, str) else ("full" if schedule.recompute else "none")


def _layer_split(config: Any) -> list[int] | None:
    """The transformer blocks per stage the run used (analytic and profile costs), else None."""
    split = getattr(getattr(config, "model", None), "layers_per_stage", None)
    return list(split) if split is not None else None


def iteration_times(schedule: Schedule, microbatch: np.ndarray, start: np.ndarray, end: np.ndarray,
                    step: np.ndarray, allreduce: np.ndarray | None = None, device: np.ndarray | None = None,
                    busiest_link_ns: int = 0) -> tuple[int, int, int]:
    """(iteration, fill/drain, makespan) in ns from the timed rows of a run, simulated or measured; ``step`` marks
    the optimizer steps. One iteration: iteration = makespan. Several: the median gap between iteration ends, where
    an iteration ends with its backwards (the steps after them delay what follows, so the gaps include them), and at
    least the time a device's gradient all-reduces keep it busy per iteration (rows marked by ``allreduce``, on
    ``device``) and the time the busiest shared link needs per iteration for what the run sent over it
    (``busiest_link_ns``, ``Network.busiest_link_ns``: every iteration sends the same bytes). Without those floors,
    a run whose all-reduces fall behind its compute, or whose groups share a link that cannot carry an iteration's
    bytes in an iteration, would look as fast as its compute for the few iterations simulated, while the backlog
    builds slowly (docs/network.md, "Data parallelism")."""
    makespan = int(end.max() - start.min())
    if schedule.iterations <= 1:
        return makespan, 0, makespan
    ends = np.zeros(schedule.iterations, dtype=np.int64)
    np.maximum.at(ends, microbatch[~step] // schedule.num_microbatches, end[~step])
    steady = int(statistics.median((ends[1:] - ends[:-1]).tolist()))
    if allreduce is not None and device is not None and allreduce.any():
        steady = max(steady, _busiest_union_ns(device[allreduce], start[allreduce], end[allreduce])
                     // schedule.iterations)
    steady = max(steady, link_floor_ns(busiest_link_ns, schedule.iterations))
    return steady, max(0, makespan - schedule.iterations * steady), makespan


def link_floor_ns(busiest_link_ns: int, iterations: int) -> int:
    """The least a run's iteration takes while its busiest link carries an iteration's share of its bytes."""
    return -(-busiest_link_ns // iterations)


def _busiest_union_ns(device: np.ndarray, start: np.ndarray, end: np.ndarray) -> int:
    """The largest, over devices, of the time covered by the union of that device's intervals."""
    order = np.lexsort((start, device))
    device, start, end = device[order], start[order], end[order]
    best = 0
    for d in np.unique(device):
        mask = device == d
        s, e = start[mask], end[mask]
        reach = np.maximum.accumulate(e)  # how far the intervals so far cover
        covered_from = np.maximum(s, np.concatenate(([s[0]], reach[:-1])))
        best = max(best, int(np.maximum(e - covered_from, 0).sum()))
    return best


def build_result(schedule: Schedule, records: Timeline, stage_costs: list[StageCost], precision: str,
                 samples_per_iteration: int, memory_runtime: str = "megatron", gradient_buffers: int = 1,
                 sharding: Sharding = NO_SHARDING, memory_overheads: Overheads = NO_OVERHEADS,
                 busiest_link_ns: int = 0, **extra: Any) -> SimResult:
    """Derive every statistic from the timeline's compute and collective rows and the memory ledger.

    Args:
        schedule: what ran (compute-only or lowered).
        records: the timeline of a replay or of a measured run; with data parallelism, of every replica (replica r's
            device d is r*D + d; replicas run the same program, so the memory ledger of replica 0 stands for all).
        stage_costs: bytes each stage stashes and holds, for the memory ledger.
        precision: bytes per parameter and activation.
        memory_runtime: whose buffers the memory ledger counts (``simulator.memory_runtime``).
        gradient_buffers: gradient buffers per stage (2 where 2BW defers its steps).
        sharding: ZeRO's stage and shards (``mesh.Sharding``; none by default).
        memory_overheads: what every GPU holds besides tensors (CUDA context, NCCL, workspace).
        busiest_link_ns: what the run's busiest shared link needed for its bytes (``Network.busiest_link_ns``), a
            floor of a several-iteration run's steady state (``iteration_times``).
        samples_per_iteration: for throughput.
        **extra: further ``SimResult`` fields (memory capacity, MFU inputs, warnings, config, wall time).
    """
    compute, collective = records.mask(Role.COMPUTE), records.mask(Role.COLLECTIVE)
    device, start, end = records.device[compute], records.start[compute], records.end[compute]
    p, pipeline = records.num_devices, schedule.num_devices
    busy, first, last = np.zeros(p, dtype=np.int64), np.full(p, np.iinfo(np.int64).max), np.zeros(p, dtype=np.int64)
    np.add.at(busy, device, end - start)
    stalls = records.stalls
    np.add.at(busy, stalls[:, 0], stalls[:, 1] - stalls[:, 2])  # an op's waits between its units are not work
    np.minimum.at(first, device, start)
    np.maximum.at(last, device, end)
    span = np.where(np.bincount(device, minlength=p) > 0, last - first, 0)
    max_span = int(span.max()) or 1
    replica0 = records if p == pipeline else records.subset(records.device < pipeline, pipeline)
    memory, static = ledger(schedule, replica0, stage_costs, precision, memory_runtime, gradient_buffers,
                            sharding, memory_overheads.total)
    comm = records.mask(Role.SEND) | records.mask(Role.RECV) | collective
    exposed_comm, exposed_allreduce = uncovered_ns(records, [comm, collective], compute)
    busy_ns, span_ns = busy.tolist(), span.tolist()  # Python numbers: a notebook shows 0.07, not np.float64(0.07)
    devices = [DeviceStats(d, busy_ns[d] / 1e9, span_ns[d] / 1e9, 1.0 - busy_ns[d] / max_span,
                           int(memory[d % pipeline].peak_bytes), float(memory[d % pipeline].peak_activations),
                           int(static[d % pipeline]), float(exposed_comm[d]) / 1e9, float(exposed_allreduce[d]) / 1e9)
               for d in range(p)]
    timed = compute | collective
    kind = records.kind[timed]
    iteration, fill_drain, makespan = iteration_times(schedule, records.microbatch[timed], records.start[timed],
                                                      records.end[timed], kind == KIND_CODE[ActionKind.OPT],
                                                      kind == KIND_CODE[ActionKind.ALL_REDUCE], records.device[timed],
                                                      busiest_link_ns)
    bubble = 1.0 - int(busy.sum()) / (p * max_span)
    return SimResult(schedule, records, devices, memory, iteration, fill_drain, makespan, bubble,
                     samples_per_iteration, stage_costs=stage_costs, precision=precision,
                     memory_runtime=memory_runtime, gradient_buffers=gradient_buffers,
                     memory_overheads=memory_overheads, **extra)


def with_timeline(result: SimResult, records: Timeline) -> SimResult:
    """``result``'s run over another timeline of the same program (a measured one): every statistic, and the memory
    ledger, from those times."""
    rebuilt = build_result(result.schedule, records, result.stage_costs, result.precision,
                           result.samples_per_iteration, result.memory_runtime, result.gradient_buffers,
                           memory_overheads=result.memory_overheads, config=result.config, warnings=[])
    rebuilt.cluster_name = result.cluster_name
    rebuilt.cluster_nodes = result.cluster_nodes
    rebuilt.gpus_per_device, rebuilt.tokens_per_sample = result.gpus_per_device, result.tokens_per_sample
    rebuilt.model_params = result.model_params
    return rebuilt
