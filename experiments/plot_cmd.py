"""``pipescope plot KIND INPUT``: draw a run, a sweep or a validation from the files pipescope writes
(docs/plots.md)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING


from pipescope.experiments.cli import as_flag, config_file, integer_flag, usage_error
from pipescope.experiments.figure_formats import FORMATS, format_of
from pipescope.simulator.ir import ScheduleError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KINDS = ("gantt", "memory", "bubble", "throughput", "overlay", "vocab")
RUN_SUFFIXES = (".json", ".json.gz", ".parquet", ".csv", ".yaml", ".yml")
MAX_MICROBATCHES = 500_000  # the config's limit on schedule.microbatches
MAX_TITLE = 300


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``plot`` parser to the ``pipescope`` subcommands."""
    p = sub.add_parser("plot", help="draw a Gantt chart, memory, bubble, throughput, predicted-vs-measured or "
                       "vocabulary figure",
                       description="Draw a figure from a file pipescope wrote (docs/plots.md). gantt and memory read a "
                       "Chrome trace (simulate --trace: ops and memory), a timeline (simulate --timeline: ops only) "
                       "or a config (.yaml, simulated first); bubble, throughput and vocab a sweep's .parquet or .csv; "
                       "overlay a 'validate --json' report, or two timelines: predicted, then measured.")
    p.add_argument("figure", metavar="KIND", choices=KINDS, help=f"one of {', '.join(KINDS)}")
    p.add_argument("inputs", metavar="INPUT", nargs="+", help="the file(s) to draw from")
    p.add_argument("-o", "--out", metavar="FILE", help="the figure to write (.png, .svg or .pdf; default: "
                   "INPUT's name with -KIND.FORMAT, in the current folder)")
    p.add_argument("--format", choices=FORMATS, help="png, svg or pdf (default: -o's suffix, else png)")
    p.add_argument("--title", help="the figure's title (default: what was run)")
    p.add_argument("--mode", choices=("time", "steps"), default="time", help="gantt: x in time, or in unit steps "
                   "(every op one cell, transfers free; compute rows only)")
    p.add_argument("--compute-only", action="store_true", help="gantt: no send, receive and collective lanes")
    p.add_argument("--no-memory", action="store_true", help="gantt: no memory panel")
    p.add_argument("--microbatches", metavar="M", help="gantt from a trace or timeline of a schedule that spans "
                   "iterations (pipedream, 2bw): microbatches per iteration, to mark where each ends")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="with a .yaml INPUT: override one config key (repeatable)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the figure and write it; exit 2 with one line on bad input."""
    try:
        if args.title is not None and len(args.title) > MAX_TITLE:
            raise ValueError(f"--title: got {len(args.title):,} characters, expected at most {MAX_TITLE}")
        _flags_fit(args)
        fmt, out = _output(args)
        fig = FIGURES[args.figure](args)
    except ScheduleError:
        raise  # the CLI reports an invalid schedule itself (exit 1)
    except ValueError as err:
        return usage_error(str(err))
    from pipescope.experiments.plots_style import save_figure
    try:
        save_figure(fig, out, fmt)
    except OSError as err:
        return usage_error(f"-o: cannot write {err.filename or out!r}: {err.strerror}")
    print(f"wrote {args.figure}: {out}")
    return 0


def _flags_fit(args: argparse.Namespace) -> None:
    """A flag of another kind of figure is refused, not passed over (``plot bubble --mode steps`` drew the bubble)."""
    runs = ("gantt", "memory")  # the figures of one run: a trace, a timeline or a config
    flags = [("--mode", args.mode != "time", ("gantt",)), ("--compute-only", args.compute_only, ("gantt",)),
             ("--no-memory", args.no_memory, ("gantt",)), ("--microbatches", args.microbatches is not None, runs),
             ("--set", bool(args.sets), runs)]  # (flag, given, the figures it is for)
    for flag, used, kinds in flags:
        if used and args.figure not in kinds:
            raise ValueError(f"{flag}: only with {' or '.join(kinds)}, not {args.figure}")


def _output(args: argparse.Namespace) -> tuple[str, str]:
    """(format, path): -o's suffix and --format must agree; without -o, INPUT's name beside the current folder."""
    if args.out is None:
        stem = os.path.basename(args.inputs[0])
        for suffix in sorted(RUN_SUFFIXES, key=len, reverse=True):
            if stem.lower().endswith(suffix):
                stem = stem[:-len(suffix)]
                break
        fmt = args.format or "png"
        return fmt, f"{stem or 'plot'}-{args.figure}.{fmt}"
    return format_of(args.out, args.format, "-o"), args.out


def _one_input(args: argparse.Namespace) -> str:
    if len(args.inputs) != 1:
        raise ValueError(f"INPUT: got {len(args.inputs)} files, expected one for {args.figure}")
    return args.inputs[0]


def _shipped_config(name: str) -> str:
    """A shipped config's file for its name (``demo``), as ``simulate --config`` takes it; else ``name``."""
    from pipescope.config import ConfigError, config_path
    try:
        return str(config_path(name))
    except ConfigError:
        return name


def _run(args: argparse.Namespace):
    """The ``RunData`` a gantt or memory figure draws, from a trace, a timeline or a config."""
    from pipescope.experiments import plots_inputs as inputs
    from pipescope.experiments.plots_data import run_data
    path = _one_input(args)
    if not path.lower().endswith(RUN_SUFFIXES):
        path = _shipped_config(path)
    lower = path.lower()
    if not lower.endswith(RUN_SUFFIXES):
        raise ValueError(f"INPUT: got {path[:200]!r}, expected a Chrome trace (.json, .json.gz), a timeline "
                         f"(.parquet, .csv) or a config (.yaml, or a shipped one's name such as demo)")
    if args.sets and not lower.endswith((".yaml", ".yml")):
        raise ValueError("--set: only with a config INPUT (.yaml); a file holds a run that already happened")
    if lower.endswith((".yaml", ".yml")):
        if args.microbatches is not None:
            raise ValueError("--microbatches: only with a trace or timeline INPUT; a config knows its own")
        from pipescope.config import ConfigError
        from pipescope.runner import run
        try:
            config = config_file(path, args.sets, "INPUT")
        except ConfigError as err:  # the file is this command's INPUT, not a --config flag
            raise ConfigError(as_flag(str(err), {"--config": "INPUT"})) from None
        return run_data(run(config))
    m = integer_flag("--microbatches", args.microbatches, 1, MAX_MICROBATCHES) if args.microbatches else None
    if lower.endswith((".parquet", ".csv")):
        return inputs.run_from_timeline(path, m)
    doc = inputs.read_json(path)
    found = inputs.json_kind(doc)
    if found != "trace":
        hint = {"simulate": "a 'simulate --json' summary, which holds no op timeline (write one with simulate "
                            "--trace FILE.json)",
                "validate": "a 'validate --json' report (plot it with overlay)"}.get(found, "not a Chrome trace")
        raise ValueError(f"INPUT: {path[:200]!r} is {hint}; expected a Chrome trace from 'pipescope simulate "
                         f"--trace'")
    return inputs.run_from_trace(doc, path, m)


def _gantt(args: argparse.Namespace) -> Figure:
    from pipescope.experiments.plots_gantt import gantt_figure
    data = _run(args)
    memory = not args.no_memory and args.mode == "time"
    if memory and not data.memory:
        print(f"pipescope plot: {args.inputs[0][:200]!r} holds no memory counters: no memory panel (a timeline file "
              f"has none; a Chrome trace from simulate --trace has them)", file=sys.stderr)
    return gantt_figure(data, args.title, mode=args.mode, comm_lanes=not args.compute_only, memory=memory)


def _memory(args: argparse.Namespace) -> Figure:
    from pipescope.experiments.plots_charts import memory_figure
    if _one_input(args).lower().endswith((".parquet", ".csv")):  # a timeline or a sweep: neither holds memory
        raise ValueError(f"INPUT: {args.inputs[0][:200]!r} is a table (a timeline or a sweep), which holds no memory "
                         f"timeline; expected a Chrome trace from 'pipescope simulate --trace' or a config")
    data = _run(args)
    if not data.memory:
        raise ValueError(f"INPUT: {args.inputs[0][:200]!r} holds no memory timeline (a timeline file has only "
                         f"ops); expected a Chrome trace from 'pipescope simulate --trace' or a config")
    if not data.counted_bytes:
        raise ValueError(f"INPUT: {args.inputs[0][:200]!r} counted no bytes (uniform costs have no model to "
                         f"count); expected a run under analytic or profile costs")
    return memory_figure(data, args.title)


def _sweep(args: argparse.Namespace) -> Figure:
    from pipescope.experiments.plots_charts import bubble_figure, throughput_figure
    from pipescope.experiments.plots_inputs import read_sweep
    from pipescope.experiments.plots_vocab import vocab_figure
    path = _one_input(args)
    if not path.lower().endswith((".parquet", ".csv")):
        raise ValueError(f"INPUT: got {path[:200]!r}, expected a sweep table (.parquet or .csv)")
    frame = read_sweep(path, args.figure)
    draw = {"bubble": bubble_figure, "throughput": throughput_figure, "vocab": vocab_figure}[args.figure]
    return draw(frame, args.title)


def _overlay(args: argparse.Namespace) -> Figure:
    from pipescope.experiments import plots_inputs as inputs
    from pipescope.experiments.plots_charts import overlay_figure, validate_figure
    if len(args.inputs) == 2:
        if not all(p.lower().endswith((".parquet", ".csv")) for p in args.inputs):
            raise ValueError("INPUT: expected two timelines (.parquet or .csv): predicted, then measured")
        predicted, measured = (inputs.compute_rows(p) for p in args.inputs)
        return overlay_figure(predicted, measured, os.path.basename(args.inputs[0]), args.title)
    path = _one_input(args)
    if not path.lower().endswith(".json"):
        raise ValueError(f"INPUT: got {path[:200]!r}, expected a 'validate --json' report (.json) or two timelines")
    doc = inputs.read_json(path)
    if inputs.json_kind(doc) != "validate":
        published = isinstance(doc, dict) and {"runs", "summary", "targets"} <= set(doc)
        hint = (": it is a 'validate --published' report, drawn with 'pipescope validate --published --plot FILE'"
                if published else "")
        raise ValueError(f"INPUT: {path[:200]!r} is not a 'pipescope validate --json' report{hint}")
    return validate_figure(inputs.read_validate(doc, path), args.title)


FIGURES: dict[str, Callable[[argparse.Namespace], Figure]] = {
    "gantt": _gantt, "memory": _memory, "bubble": _sweep, "throughput": _sweep, "overlay": _overlay, "vocab": _sweep}
