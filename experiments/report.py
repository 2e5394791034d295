"""Human-readable tables for the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipescope.simulator.costs import CostKind
from pipescope.simulator.ir import Role
from pipescope.simulator.result import SimResult
from pipescope.simulator.readers.units import format_bytes, format_count, format_duration, format_time

if TYPE_CHECKING:
    from pipescope.config import Config
    from pipescope.simulator.parallel import ParallelConfig


def _headline(result: SimResult) -> str:
    config = result.config
    s, m, c = result.schedule, config.model, config.cluster
    costs = config.costs.kind
    uniform = costs is CostKind.UNIFORM
    seq = f" s={result.tokens_per_sample}" if result.tokens_per_sample else ""  # a from_hf file's own length too
    eager = " eager" if costs is CostKind.ANALYTIC and m.attention == "eager" else ""  # flash: the default
    model = "uniform costs" if uniform else f"{m.label}{seq} mb={m.microbatch_size} {m.precision}{eager} ({costs})"
    return (f"{s.name}: p={s.num_devices} m={s.num_microbatches} v={s.chunks}"
            f"{_options(config)}  weight update {s.weight_update}  {model}  "
            f"on {_cluster(result)} x{result.cluster_nodes or c.nodes}")


def _cluster(result: SimResult) -> str:
    """The topology's name; a file's own name with the file beside it (``my-box (box.yaml)``)."""
    topology, name = result.config.cluster.topology, result.cluster_name
    return topology if name in ("", topology) else f"{name} ({topology})"


def _options(config: Config) -> str:
    """`` recompute`` or `` selective recompute``, then `` t=2`` (or `` t=2 sequence-parallel``) under tensor
    parallelism, `` cp=2`` under context parallelism and `` w=4`` with data-parallel replicas (`` w=4 ZeRO-3``
    sharded over them, with HSDP's groups, resharding and prefetch), and `` offload optimizer``."""
    text = {"full": " recompute", "selective": " selective recompute"}.get(config.schedule.recompute, "")
    p, w = config.parallel, config.cluster.data_parallel
    text += f" t={p.tensor}{' sequence-parallel' if p.sequence else ''}" if p.tensor > 1 else ""
    text += f" cp={p.context}" + (" all-gather" if p.context_comm == "all_gather" else "") if p.context > 1 else ""
    return text + (f" w={w}" if w > 1 else "") + (_sharding(p) if p.zero_stage and w > 1 else "") + \
        (f" offload {p.offload}" if p.offload != "none" else "")


def _sharding(p: ParallelConfig) -> str:
    """`` ZeRO-3``, with HSDP's shard group, no resharding after the forward and a deeper prefetch where set."""
    text = f" ZeRO-{p.zero_stage}" + (f" HSDP groups of {p.shard_group}" if p.shard_group else "")
    if p.zero_stage >= 3:
        text += "" if p.reshard_after_forward else " no-reshard"
        text += f" prefetch {p.zero_prefetch}" if p.zero_prefetch > 1 and p.reshard_after_forward else ""
    return text


def _samples_per_s(rate: float) -> str:
    """Two decimals, or three significant digits below 0.1 (an hours-long step is not 0.00 samples/s)."""
    return f"{rate:.2f}" if rate >= 0.1 else f"{rate:.3g}"


def _totals(result: SimResult) -> list[str]:
    lines = [f"iteration time {format_time(result.iteration_time_s)}   "
             f"throughput {_samples_per_s(result.throughput_samples_per_s)} samples/s   "
             f"bubble rate {result.bubble_rate:.2%}"]
    if result.tokens_per_s is not None:  # FLOPs only where the model's are counted (analytic costs)
        flops = "" if result.tflops_per_gpu is None else (f"   {result.tflops_per_gpu:.1f} TFLOP/s per GPU   "
                                                          f"MFU {result.mfu:.1%}   HFU {result.hfu:.1%}")
        lines.append(f"{format_count(result.tokens_per_s)} tokens/s ({format_count(result.tokens_per_s_per_gpu)} "
                     f"per GPU, {result.gpus:,} GPUs){flops}")
    if result.schedule.iterations > 1:
        lines.append(f"steady state over {result.schedule.iterations} iterations; fill + drain "
                     f"{format_time(result.fill_drain_ns / 1e9)}; whole run {format_time(result.makespan_ns / 1e9)}")
    cap = result.memory_capacity_bytes
    if result.peak_memory_bytes == 0:
        return lines  # uniform costs without byte sizes: nothing to say about memory
    lines.append(f"peak memory {format_bytes(result.peak_memory_bytes)}"
                 + (f" of {format_bytes(cap)} per device" if cap else ""))
    for oom in result.oom:
        lines.append(f"OOM: device {oom['device']} needs {format_bytes(oom['peak_memory_bytes'])} "
                     f"({oom['peak_memory_bytes']} bytes) of {format_bytes(oom['capacity_bytes'])}")
    return lines


def _device_rows(result: SimResult) -> list[str]:
    header = (f"{'device':>6}  {'busy':>12}  {'span':>12}  {'idle':>6}  {'peak memory':>12}  {'peak act':>8}  "
              f"{'versions':>8}")
    rows = [header]
    p = result.schedule.num_devices  # with data parallelism, device r * p + i is replica r's pipeline device i
    counted = result.peak_memory_bytes > 0  # uniform costs count activations, not bytes
    for d in result.devices:
        memory = format_bytes(d.peak_memory_bytes) if counted else "-"
        rows.append(f"{d.device:>6}  {format_time(d.busy_s):>12}  {format_time(d.span_s):>12}  "
                    f"{d.idle_fraction:>6.1%}  {memory:>12}  {d.peak_activations:>8.3g}  "
                    f"{result.schedule.versions(d.device % p):>8}")
    return rows


def training_line(estimate: dict) -> str:
    """``to train on 300 B tokens: 21.8 days, 2,094 GPU-hours, cost 5,235`` (``TrainingGoal.estimate``)."""
    head = f"to train on {format_count(estimate['train_tokens'])} tokens"
    if estimate["time_to_train_s"] is None:
        return f"{head}: unknown (uniform costs know no model, so no tokens/s)"
    cost = f", cost {estimate['cost']:,.0f}" if estimate["cost"] is not None else ""
    return (f"{head}: {format_duration(estimate['time_to_train_s'])}, "
            f"{estimate['gpu_hours']:,.0f} GPU-hours{cost}")


def _folded(result: SimResult) -> str:
    """How many of the replicas ran: where alike ones were folded (``simulator.fold``), or why all of them ran."""
    folding = result.network.get("folding")
    if not folding:
        return ""
    if folding["simulated"] < folding["replicas"]:
        return (f" ({folding['simulated']} of {folding['replicas']} replicas replayed, the others alike: "
                f"docs/network.md, \"Folding identical replicas\")")
    return f" (all {folding['replicas']} replicas replayed: {folding['why_not']})"


def table(result: SimResult, max_rows: int = 16, estimate: dict | None = None) -> str:
    """Headline, totals (with the training estimate, when given) and a per-device table (elided in the middle past
    ``max_rows`` devices)."""
    rows = _device_rows(result)
    if len(rows) - 1 > max_rows:
        half = max_rows // 2
        rows = rows[: half + 1] + [f"{'...':>6}  ({len(rows) - 1 - max_rows} devices not shown)"] + rows[-half:]
    warnings = [f"warning: {w}" for w in result.warnings]
    ops, transfers = result.records.mask(Role.COMPUTE).sum(), result.records.mask(Role.SEND).sum()
    sim = f"simulated {ops} ops and {transfers} transfers in {result.sim_wall_s:.2f} s{_folded(result)}"
    goal = [training_line(estimate)] if estimate else []
    return "\n".join([_headline(result), *_totals(result), *goal, "", *rows, *warnings, sim])
