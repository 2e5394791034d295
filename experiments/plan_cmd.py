"""``pipescope plan``: the fastest configuration of a model on a cluster under a memory cap (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

from pipescope.config import ConfigError
from pipescope.experiments.cli import (add_training_goal_args, as_flag, choice_flag, integer_flag, training_goal,
                                       usage_error)
from pipescope.experiments.processes import sigterm_as_ctrl_c
from pipescope.experiments.sweep_cmd import DASK_ADDRESS, MAX_WORKERS
from pipescope.simulator.readers.units import (counted, format_bytes, format_count, format_duration, format_time,
                                               parse_size, short_repr)

if TYPE_CHECKING:  # the simulator loads when a plan runs, not for every 'pipescope --help'
    from pipescope.experiments.plan import PlanReport
    from pipescope.experiments.plan_space import PlanRequest

MAX_GLOBAL_BATCH = 1 << 20
MAX_TOP = 1000
REASONS_SHOWN = 8
EXIT_NOTHING_FITS = 1  # a finding, as the CLI's exit codes go: every candidate was rejected


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` parser to the ``pipescope`` subcommands."""
    from pipescope.experiments.plan_space import DEFAULT_MICROBATCH_SIZES, DEFAULT_SCHEDULES

    p = sub.add_parser(
        "plan", help="find the fastest schedule, data-parallel width, pipeline depth, microbatch size and "
                     "recompute for a model on a cluster under a memory cap",
        description="Search schedule x tensor width x data-parallel width x pipeline depth x microbatch size x "
                    "recompute, using every GPU of the cluster and a fixed global batch. Candidates that cannot "
                    "run or cannot fit are rejected with their reason before anything is simulated; the rest are "
                    "simulated in order of a throughput bound, until no bound can beat the top N "
                    "(docs/planner.md).")
    p.add_argument("--model", help="model.preset (default: the --config file's model, else gpt-1.3b)")
    p.add_argument("--topology", help="cluster.topology: a built-in machine or a topology file (default: the "
                   "--config file's, else dgx-h100; see 'pipescope topology')")
    p.add_argument("--nodes", help="cluster.nodes: machines in the cluster (default: the --config file's, else 1)")
    p.add_argument("--global-batch", required=True, help="samples per optimizer step, over all replicas")
    p.add_argument("--memory-cap", help="bytes per GPU, e.g. 16GiB (default: the GPU's memory)")
    p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES), help="comma-separated schedule names "
                   f"(default {','.join(DEFAULT_SCHEDULES)})")
    p.add_argument("--microbatch-sizes", default=",".join(map(str, DEFAULT_MICROBATCH_SIZES)),
                   help="comma-separated microbatch sizes to try (default "
                        f"{','.join(map(str, DEFAULT_MICROBATCH_SIZES))})")
    p.add_argument("--tensor", default="1,2,4,8", help="comma-separated tensor-parallel widths t to try "
                   "(parallel.tensor; widths that do not divide a node's GPUs or the heads are rejected; default "
                   "1,2,4,8)")
    p.add_argument("--sequence", default="off,on", help="sequence parallelism where t > 1 (parallel.sequence): "
                   "off, on, or off,on for both (default off,on)")
    p.add_argument("--depths", help="comma-separated pipeline depths to keep (default: every depth; 1 plans without "
                   "pipelining, e.g. tensor and data parallelism only)")
    p.add_argument("--vocab", default="naive,redistribute,vocab-1,vocab-2,interlaced", help="comma-separated "
                   "schedule.vocab methods, each tried with the schedules it exists for (the sharded ones with 1f1b "
                   "and v-half, not with t > 1; default all)")
    p.add_argument("--zero", help="comma-separated ZeRO stages to try (parallel.zero: 0 none, 1 optimizer state, 2 and "
                   "gradients, 3 and weights sharded over the data-parallel replicas; with replicas and a flush "
                   "schedule only). Default: not searched, the config's parallel.zero applies")
    p.add_argument("--offload", help="comma-separated parallel.offload settings to try: none, optimizer (the "
                   "optimizer state and step on the host: ZeRO-Offload; flush schedules and analytic costs only), "
                   "parameters (ZeRO-3's weight shards too: ZeRO-Infinity; tried with ZeRO-3 only: --zero 3 or the "
                   "config's parallel.zero 3). Default: not searched, the config's applies")
    p.add_argument("--context", help="comma-separated context-parallel degrees cp to try (parallel.context: each "
                   "pipeline device is tensor x cp GPUs, of one node or of whole nodes; flash attention and analytic "
                   "costs only). Default: not searched, the config's parallel.context applies")
    p.add_argument("--shard-groups", help="comma-separated HSDP shard groups to try beside sharding over every "
                   "replica (parallel.shard_group, in replicas; each must divide the width into 2 or more groups; "
                   "needs --zero with a stage 1 to 3). Default: not searched")
    p.add_argument("--recompute", default="none,selective,full", help="comma-separated: none, selective (the "
                   "attention core only), full (default all three)")
    p.add_argument("--config", metavar="FILE.yaml", help="a config every candidate starts from (model, cluster, "
                   "costs, ...); a flag given overrides its key, and the keys the search sets (schedule, stages, "
                   "microbatches, tensor width, ...) are the search's, which the output says")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one dotted key of that config (repeatable)")
    p.add_argument("--top", default="10", help="rows of the ranked table, all of them exact (default 10)")
    p.add_argument("--workers", metavar="N", help="worker processes (default: the CPUs this process may use)")
    p.add_argument("--dask", metavar="local|tcp://HOST:PORT", help="run on Dask as 'pipescope sweep' does (a tcp "
                   "address is trusted input: Dask unpickles what its scheduler sends)")
    p.add_argument("--json", action="store_true", help="print one JSON object: best, ranked, rejected")
    add_training_goal_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Check the flags, plan, print the table or JSON; exit 2 on bad input."""
    try:
        request, workers = _request(args)
        goal = training_goal(args)
        with sigterm_as_ctrl_c():  # a killed plan shuts its pool down, as Ctrl-C does
            report = _plan(request, workers, args)
    except (ConfigError, ValueError) as err:
        flags = FIELD_FLAGS | ({"cluster.memory": "--memory-cap"} if args.memory_cap is not None else {})
        return usage_error(as_flag(str(err), flags))  # cluster.memory from --config stays its key
    except OSError as err:  # worker processes that cannot start, say; dask_executor names --dask itself (a ConfigError)
        return usage_error(f"plan: {err}")
    if goal is not None:  # every candidate uses every GPU, so ranking by cost is ranking by speed
        for row in report.ranked:
            row.update(goal.estimate(row["tokens_per_s"], report.gpus))
    print(json.dumps(as_json(report)) if args.json else summary(report, request.top))
    return 0 if report.best is not None else EXIT_NOTHING_FITS


def _plan(request: PlanRequest, workers: int, args: argparse.Namespace) -> PlanReport:
    from pipescope.experiments.plan import plan

    if args.dask is None:
        return plan(request, workers=workers, progress=not args.no_progress)
    from pipescope.experiments.sweep import dask_executor

    with dask_executor(args.dask, workers) as (executor, threads):
        return plan(request, executor, threads, progress=not args.no_progress)


# The PlanRequest fields plan_space's errors name, and the flags that set them
FIELD_FLAGS = {"global_batch": "--global-batch", "microbatch_sizes": "--microbatch-sizes", "tensor": "--tensor",
               "depths": "--depths", "schedules": "--schedules", "vocab": "--vocab", "recompute": "--recompute",
               "top": "--top", "zero": "--zero", "offload": "--offload", "shard_groups": "--shard-groups",
               "context": "--context"}
# The keys each candidate sets (plan_space.Candidate.overrides) or the flags set, and the flags that choose them
SEARCHED_BY = {"schedule.name": "--schedules", "schedule.stages": "--depths", "schedule.microbatches":
               "--global-batch", "schedule.recompute": "--recompute", "schedule.vocab": "--vocab",
               "model.microbatch_size": "--microbatch-sizes", "cluster.data_parallel": "--depths and --tensor",
               "parallel.tensor": "--tensor", "parallel.sequence": "--sequence",
               # and what plan_space.base_config writes from the flags
               "model.preset": "--model", "cluster.topology": "--topology", "cluster.nodes": "--nodes",
               "cluster.memory": "--memory-cap"}


def _request(args: argparse.Namespace) -> tuple[PlanRequest, int | None]:
    from pipescope.config import config_tree
    from pipescope.experiments.plan_space import OPTIONAL_AXES, RECOMPUTE, VOCAB_METHODS, PlanRequest, base_config
    from pipescope.simulator.offload import OFFLOADS

    if args.dask is not None and args.dask != "local" and not re.fullmatch(DASK_ADDRESS, args.dask):
        raise ValueError(f"--dask: got {short_repr(args.dask)}, expected local or tcp://HOST:PORT")
    cap = None
    if args.memory_cap is not None:
        try:  # its range is cluster.memory's, checked with the config (FIELD_FLAGS names the flag)
            cap = parse_size(args.memory_cap)
        except ValueError as err:
            raise ValueError(f"--memory-cap: {err}") from None
    searched = SEARCHED_BY | {key: FIELD_FLAGS[field] for field, keys in OPTIONAL_AXES
                              if getattr(args, field) is not None for key in keys}
    for item in args.sets:  # a searched key set here would be overridden by every candidate, silently
        key = item.split("=", 1)[0].strip()
        if key in searched:
            raise ValueError(f"--set: {key} is what the planner searches, expected {searched[key]} instead")
        if key in ("model.from_hf", "model.preset") and args.model is not None:  # both typed: which one is meant?
            raise ValueError(f"--model: got {args.model!r} beside --set {key}, expected one of the two")
    nodes = None if args.nodes is None else integer_flag("--nodes", args.nodes, 1, 4096)
    base = base_config(args.model, args.topology, nodes, cap, config_tree(args.config, args.sets))
    request = PlanRequest(
        base, integer_flag("--global-batch", args.global_batch, 1, MAX_GLOBAL_BATCH),
        schedules=tuple(_names("--schedules", args.schedules)),
        microbatch_sizes=tuple(integer_flag("--microbatch-sizes", v, 1, MAX_GLOBAL_BATCH)
                               for v in _names("--microbatch-sizes", args.microbatch_sizes)),
        recompute=tuple(choice_flag("--recompute", v, RECOMPUTE) for v in _names("--recompute", args.recompute)),
        vocab=tuple(choice_flag("--vocab", v, VOCAB_METHODS) for v in _names("--vocab", args.vocab)),
        sequence=tuple(choice_flag("--sequence", v, ("off", "on")) == "on"
                       for v in _names("--sequence", args.sequence)),
        tensor=tuple(integer_flag("--tensor", v, 1, 1024) for v in _names("--tensor", args.tensor)),
        zero=None if args.zero is None else tuple(integer_flag("--zero", v, 0, 3) for v in _names("--zero", args.zero)),
        offload=None if args.offload is None else tuple(choice_flag("--offload", v, OFFLOADS)
                                                        for v in _names("--offload", args.offload)),
        context=None if args.context is None else tuple(integer_flag("--context", v, 1, 1024)
                                                        for v in _names("--context", args.context)),
        shard_groups=None if args.shard_groups is None else tuple(
            integer_flag("--shard-groups", v, 1, 100_000) for v in _names("--shard-groups", args.shard_groups)),
        depths=None if args.depths is None else tuple(integer_flag("--depths", v, 1, 100_000)
                                                      for v in _names("--depths", args.depths)),
        top=integer_flag("--top", args.top, 1, MAX_TOP))
    workers = integer_flag("--workers", args.workers, 1, MAX_WORKERS) if args.workers is not None else None
    return request, workers


def _names(flag: str, text: str) -> list[str]:
    """The items of a comma-separated flag, each once, in order; ValueError naming the flag if one is empty (a
    stray comma may have eaten a value)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ValueError(f"{flag}: got {short_repr(text)}, expected a comma-separated list without empty items")
    return list(dict.fromkeys(parts))


def as_json(report: PlanReport) -> dict:
    """``best`` (schedule, tensor, width, depth, microbatch_size, recompute and its metrics), ``ranked``,
    ``rejected`` (each with ``reason``) and the counts."""
    return {"best": report.best, "ranked": report.ranked, "rejected": report.rejected, "gpus": report.gpus,
            "candidates": report.candidates, "simulated": report.simulated, "plan_wall_s": report.wall_s,
            "planned_for": report.planned_for, "file_keys_searched": report.file_keys_searched,
            "config_fixed": report.config_fixed, "config_fixed_not_for": report.config_fixed_not_for,
            "warnings": report.warnings,
            "would_fit": report.would_fit}


def summary(report: PlanReport, top: int) -> str:
    """The ranked table, then rejections grouped by reason."""
    lines = [f"plan: {report.planned_for}: {counted(report.candidates, 'candidate')}, {report.simulated} simulated, "
             f"{len(report.ranked)} fit, {len(report.rejected)} rejected; {format_time(report.wall_s)}"]
    lines += [f"warning: {warning}" for warning in report.warnings]
    if report.file_keys_searched:
        lines.append("not used from the config (the search sets them): " + ", ".join(
            f"{key}={_as_set(value)}" for key, value in report.file_keys_searched.items()))
    if report.config_fixed:
        exempt = report.config_fixed_not_for
        lines.append("every plan runs with, from the config: " + ", ".join(
            f"{key}={_as_set(value)}" for key, value in report.config_fixed.items())
            + (f" (its ZeRO, HSDP and offload not in {' and '.join(exempt)} plans, which step without a flush)"
               if exempt else ""))
    if report.best is None:
        lines += ["nothing fits: every candidate was rejected (reasons below)", *_nothing_fits(report)]
    else:
        lines.append(_ranked_table(report.ranked[:top]))
        b = report.best
        zero = (f"ZeRO-{b['zero']}, " if b["zero"] else "") + _sharding_words(b)
        context = f" x context {b['context']}" if b.get("context") else ""
        lines.append(f"best: {b['schedule']}, width {b['width']} x depth {b['depth']} x tensor {b['tensor']}{context}, "
                     f"microbatch {b['microbatch_size']} x {b['microbatches']}, "
                     f"{'sequence-parallel, ' if b['sequence'] else ''}{zero}recompute {b['recompute']}, "
                     f"vocabulary {b['vocab']}: "
                     f"{b['throughput_samples_per_s']:.1f} samples/s"
                     + (f", {format_count(b['tokens_per_s'])} tokens/s, MFU {b['mfu']:.1%}" if b["mfu"] else ""))
        if b["schedule"] in NO_FLUSH:
            lines.append(f"note: {b['schedule']} {NO_FLUSH[b['schedule']]}; its samples/s are the steady state, fill "
                         "and drain left out. For the flush schedules' training semantics, leave it out of --schedules")
    groups = Counter(_reason_class(r["reason"]) for r in report.rejected)
    for reason, count in groups.most_common(REASONS_SHOWN):
        example = next(r for r in report.rejected if _reason_class(r["reason"]) == reason)
        lines.append(f"rejected {count}: {reason} (e.g. {_label(example)}: {example['reason']})")
    return "\n".join(lines)


# What a winner without a flush changes in training, said beside it (docs/schedules.md, the weight update rules)
NO_FLUSH = {"pipedream": "trains asynchronously: no flush, each microbatch's backward uses the weights its forward "
                         "stashed, which lag the newest by up to depth - 1 updates",
            "2bw": "updates the weights with a one-step delay (W(t+1) = W(t) - lr * grad f(W(t-1))), two weight "
                   "versions, no flush"}


def _nothing_fits(report: PlanReport) -> list[str]:
    """The OOM candidate that needs the least memory, and the fewest nodes at which a plan fits."""
    lines = []
    ooms = [r for r in report.rejected if "needs_bytes" in r]
    if ooms:
        closest = min(ooms, key=lambda r: r["needs_bytes"])
        lines.append(f"closest to fitting: {_label(closest)}: {closest['reason']}")
    fit = report.would_fit
    if fit is None:
        lines.append("no plan fits with full recompute and microbatch 1 (and ZeRO-3) on up to 64x the nodes, or more "
                     "nodes stopped lowering the memory it needs: each GPU needs memory that pipelining, recompute "
                     "and sharding do not split (the CUDA context and NCCL's buffers, or an embedding no pipeline "
                     "splits, say)")
    else:
        zero = f" --zero {fit['zero']}" if fit.get("zero") else ""
        lines.append(f"would fit: {counted(fit['nodes'], 'node')} ({fit['gpus']} GPUs) with full recompute and "
                     f"microbatch 1"
                     f"{' and ZeRO-' + str(fit['zero']) if zero else ''}, e.g. {_label(fit)}: "
                     f"{fit['throughput_samples_per_s']:.1f} samples/s, peak {format_bytes(fit['peak_memory_bytes'])} "
                     f"(pipescope plan --nodes {fit['nodes']}{zero} --recompute full --microbatch-sizes 1 ...)")
    return lines


OFFLOAD_COLUMN = {"optimizer": "host", "parameters": "host+w"}  # the ranked table's offload column


def _sharding_words(row: dict) -> str:
    """``optimizer on the host, HSDP groups of 2, `` for the best line: the searched offload and shard group."""
    words = {"optimizer": "optimizer on the host, ", "parameters": "optimizer and weights on the host, "}.get(
        row.get("offload"), "")
    group = row.get("shard_group")
    return words + (f"HSDP groups of {group}, " if group is not None else "")


def _as_set(value: Any) -> str:
    """A config value as ``--set`` writes it (``false``, not Python's ``False``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _ranked_table(rows: list[dict]) -> str:
    goal = bool(rows) and "time_to_train_s" in rows[0]
    priced = goal and rows[0]["cost"] is not None
    # a column only where the axis was searched
    zero, offload, hsdp, cp = (any(r.get(key) is not None for r in rows)
                               for key in ("zero", "offload", "shard_group", "context"))
    # (title, usual width, alignment, cell); a left-aligned column's cells start with the space that separates it
    columns = [("#", 3, ">", lambda i, r: i), (" schedule", 13, "<", lambda i, r: f" {r['schedule']}"),
               ("t", 3, ">", lambda i, r: r["tensor"]), ("sp", 4, ">", lambda i, r: "yes" if r["sequence"] else "-")]
    columns += [("cp", 4, ">", lambda i, r: r["context"])] if cp else []
    columns += [("w", 4, ">", lambda i, r: r["width"]), ("d", 4, ">", lambda i, r: r["depth"])]
    columns += [("ZeRO", 5, ">", lambda i, r: r["zero"])] if zero else []
    columns += [("offload", 8, ">", lambda i, r: OFFLOAD_COLUMN.get(r["offload"], "-"))] if offload else []
    columns += [("HSDP", 5, ">", lambda i, r: r["shard_group"] or "-")] if hsdp else []
    columns += [("mb", 4, ">", lambda i, r: r["microbatch_size"]), ("m", 5, ">", lambda i, r: r["microbatches"]),
                (" recompute", 11, "<", lambda i, r: f" {r['recompute']}"),
                ("vocab", 13, "<", lambda i, r: r["vocab"]),
                ("samples/s", 10, ">", lambda i, r: f"{r['throughput_samples_per_s']:.1f}"),
                ("tokens/s", 10, ">", lambda i, r: _or_dash(r["tokens_per_s"], format_count)),
                ("TFLOP/s", 8, ">", lambda i, r: _or_dash(r["tflops_per_gpu"], "{:.1f}".format)),
                ("MFU", 7, ">", lambda i, r: _or_dash(r["mfu"], "{:.1%}".format)),
                ("iteration", 12, ">", lambda i, r: format_time(r["iteration_time_s"])),
                ("peak GiB", 9, ">", lambda i, r: f"{r['peak_memory_bytes'] / 2**30:.2f}"),
                ("bubble", 7, ">", lambda i, r: f"{r['bubble_rate']:.1%}")]
    columns += [("to train", 12, ">", lambda i, r: _or_dash(r["time_to_train_s"], format_duration))] if goal else []
    columns += [("cost", 12, ">", lambda i, r: _or_dash(r["cost"], "{:,.0f}".format))] if priced else []
    cells = [[str(cell(i, r)) for _, _, _, cell in columns] for i, r in enumerate(rows, 1)]
    # each column its usual width, or wider by what a cell needs to keep a space from the column beside it
    widths = [max([width, len(title)] + [len(row[c]) + 1 for row in cells])
              for c, (title, width, _, _) in enumerate(columns)]
    return "\n".join("".join(f"{text:{align}{width}}" for text, width, (_, _, align, _) in zip(texts, widths, columns))
                     for texts in [[title for title, _, _, _ in columns], *cells])


def _or_dash(value: float | None, show) -> str:
    return "-" if value is None else show(value)


def _reason_class(reason: str) -> str:
    """The kind of a rejection: its text up to the first number or colon-separated detail."""
    if reason.startswith("OOM"):
        return "OOM"
    if reason.startswith("pruned"):
        return "pruned by the throughput bound"
    return re.split(r"[:(=]", reason, maxsplit=1)[0].strip()


def _label(row: dict) -> str:
    sequence = "on" if row["sequence"] else "off"
    zero = "".join(f" {key}={row[key]}" for key in ("zero", "offload", "shard_group", "context")
                   if row.get(key) is not None)
    return (f"{row['schedule']} w={row['width']} d={row['depth']} t={row['tensor']} sp={sequence}{zero}"
            f" mb={row['microbatch_size']} recompute={row['recompute']} vocab={row['vocab']}")
