"""The ``pipescope`` command line (docs/cli.md)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn, TextIO

from pipescope import __version__
from pipescope.config import RANGES, Config, ConfigError, load_config, read_yaml, without_grid
from pipescope.experiments.figure_formats import FORMATS, format_of

if TYPE_CHECKING:
    from pipescope.simulator.training_cost import TrainingGoal
    from pipescope.simulator.result import SimResult
from pipescope.simulator.ir import Schedule, ScheduleError
from pipescope.simulator.readers.units import counted, short_repr
from pipescope.simulator.vocab import SHARDED


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pipescope: error: {message} (see '{self.prog} --help')\n")


EXIT_INVALID_SCHEDULE = 1  # malformed or deadlocking: the problems are listed
EXIT_USAGE = 2  # a bad flag, key, value or file
EXIT_OOM = 3  # simulated fine, but a device's peak memory exceeds its capacity (unless --allow-oom)


def usage_error(message: str) -> int:
    print(f"pipescope: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def integer_flag(flag: str, text: str, low: int, high: int) -> int:
    """A plain decimal flag value from ``low`` to ``high``, for commands that check their own flags (``collective``,
    ``validate``); ValueError naming the flag."""
    if not re.fullmatch(r"[0-9]{1,19}", str(text)) or not low <= int(text) <= high:
        raise ValueError(f"{flag}: got {short_repr(text)}, expected an integer from {low:,} to {high:,}")
    return int(text)


def as_flag(message: str, flags: dict[str, str]) -> str:
    """An error from the config layer, naming the flag the user typed (``flags``: config key -> flag) rather than
    the key it set, where the message starts with one."""
    key = message.split(":", 1)[0]
    return flags[key] + message[len(key):] if key in flags else message


def choice_flag(flag: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, for commands that check their own flags; ValueError naming the flag."""
    if value not in choices:
        raise ValueError(f"{flag}: got {short_repr(value)}, expected one of {', '.join(choices)}")
    return value


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.yaml", help="experiment config: a YAML file with sections schedule, "
                   "model, cluster, parallel, costs, faults, memory and keys iterations, seed (docs/cli.md), or a "
                   "shipped example by name, e.g. demo")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one dotted key, e.g. --set costs.kind=uniform (repeatable; after --config)")
    p.add_argument("--schedule", help="schedule.name: gpipe, 1f1b (= flush), ..., torch:<Name>, csv:<path>; "
                   "see 'pipescope schedules'")
    p.add_argument("--stages", help="schedule.stages: pipeline devices p")
    p.add_argument("--microbatches", help="schedule.microbatches: microbatches per iteration m")
    p.add_argument("--chunks", help="schedule.chunks: stages per device v (interleaved)")
    p.add_argument("--recompute", action="store_true", help="schedule.recompute: recompute activations in backward")


def config_from_args(args: argparse.Namespace):
    sets = list(args.sets)
    if args.schedule is not None:  # quoted: a name such as 'torch:' must stay a string, not become YAML
        sets.append(f"schedule.name={json.dumps(args.schedule)}")
    for key in ("stages", "microbatches", "chunks"):
        if getattr(args, key) is not None:
            sets.append(f"schedule.{key}={getattr(args, key)}")
    if args.recompute:
        sets.append("schedule.recompute=true")
    return config_file(args.config, sets)


def config_file(path: str | None, sets: list[str], flag: str = "--config") -> Config:
    """``load_config`` for a command: an experiment file runs its config without its grid (``--set`` picks a point
    of it), with a note on stderr."""
    if path is None:
        return load_config(None, sets)
    tree, grid = without_grid(read_yaml(path))
    if grid:
        print(f"note: {flag} {path}: running its config without its {' and '.join(grid)} grid (pipescope sweep runs "
              f"the grid)", file=sys.stderr)
    return load_config(None, sets, tree)


OUTPUT_SUFFIXES = {
    "trace": (".json", ".json.gz"),
    "gantt": tuple(f".{fmt}" for fmt in FORMATS),
    "csv": (".csv",),
    "timeline": (".parquet", ".csv"),
}


def check_output_names(args: argparse.Namespace) -> None:
    """Reject an unsupported file type, or one whose writer is not installed, before simulating.

    Suffixes are matched in any case, as the writers do (``t.PARQUET`` is Parquet)."""
    named: dict[str, str] = {}
    for flag, suffixes in OUTPUT_SUFFIXES.items():
        path = getattr(args, flag, None)  # validate has no --csv
        if path is None:
            continue
        if not path.lower().endswith(suffixes):
            raise ConfigError(f"--{flag}: got {path!r}, expected a file name ending in {' or '.join(suffixes)}")
        other = named.setdefault(os.path.realpath(path), flag)  # a symlinked folder is still the same file
        if other != flag:
            raise ConfigError(f"--{flag}: got {path!r}, the file --{other} writes; expected another name")
        check_writable(flag, path)
    if args.timeline and args.timeline.lower().endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"--timeline: {args.timeline!r} is Parquet, which needs pyarrow: "
                          f"pip install 'pipescope[sweep]' (or write a .csv)")


def check_writable(flag: str, path: str) -> None:
    """ConfigError unless ``path`` can be written, so that a folder or a read-only place fails now, not after the
    run: opened for appending, as the writer will (a file this creates is removed again); where its folder is still
    to be made (the writers make it), the nearest folder that exists must be writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ConfigError(f"--{flag}: cannot write {path!r} ({folder!r} is not a writable folder), expected a "
                              "writable file name")
        return
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as err:
        raise ConfigError(f"--{flag}: cannot write {path!r} ({err.strerror}), expected a writable file name") from None
    if not existed:
        os.remove(path)


def add_training_goal_args(p: argparse.ArgumentParser) -> None:
    """``--train-tokens`` and ``--gpu-hour-price`` (``simulate`` and ``plan``)."""
    p.add_argument("--train-tokens", metavar="N", help="tokens to train on (e.g. 1T, 300B, 2e12): adds the time to "
                   "train and its GPU-hours at the simulated speed")
    p.add_argument("--gpu-hour-price", metavar="PRICE", help="price of one GPU-hour in any currency (e.g. 2.49), "
                   "with --train-tokens: adds what the training run costs")


def training_goal(args: argparse.Namespace) -> TrainingGoal | None:
    """The goal ``--train-tokens`` and ``--gpu-hour-price`` ask for (None without them); ConfigError naming the
    flag otherwise."""
    from pipescope.simulator.training_cost import TrainingGoal
    from pipescope.simulator.readers.units import parse_count

    if args.train_tokens is None:
        if args.gpu_hour_price is not None:
            raise ConfigError(f"--gpu-hour-price: got {short_repr(args.gpu_hour_price)} without --train-tokens, "
                              "expected --train-tokens N too (the price is of the training run's GPU-hours)")
        return None
    try:
        tokens = parse_count(args.train_tokens)
    except ValueError as err:
        raise ConfigError(f"--train-tokens: {err}") from None
    try:  # these errors name their flag themselves
        return TrainingGoal(tokens, None if args.gpu_hour_price is None else _price(args.gpu_hour_price))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--gpu-hour-price: got {short_repr(text)}, expected a number such as 2.49") from None
    if value != value:  # nan passes every range check
        raise ValueError(f"--gpu-hour-price: got {short_repr(text)}, expected a number such as 2.49")
    return value


def cmd_simulate(args: argparse.Namespace) -> int:
    from pipescope.runner import run
    check_output_names(args)
    goal = training_goal(args)
    config = config_from_args(args)
    if args.csv and config.schedule.vocab in SHARDED:
        raise ConfigError(f"--csv: schedule.vocab {config.schedule.vocab} adds S/T passes and collectives, which "
                          f"torch's CSV cannot hold; expected schedule.vocab naive or redistribute with --csv")
    with progress_bar("simulate", "op") as progress:
        result = run(config, progress)
    if args.csv:
        result.warnings += _csv_notes(result.schedule, args.csv)
    _write_outputs(result, args)
    estimate = goal.estimate(result.tokens_per_s, result.gpus) if goal else None
    if args.json:
        print(json.dumps(result.summary() | ({"training": estimate} if estimate else {})))
    else:
        from pipescope.experiments.report import table
        print(table(result, estimate=estimate))
        for label, path in (("gantt", args.gantt), ("trace", args.trace), ("csv", args.csv),
                            ("timeline", args.timeline)):
            if path:
                print(f"wrote {label}: {path}")
    return _oom_exit(result, args.allow_oom)


@contextmanager
def progress_bar(desc: str, unit: str, delay_s: float = 2.0, min_interval_s: float = 0.5,
                 file: TextIO | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A callback (done, total) that draws a tqdm bar on stderr, shown only once the work has run ``delay_s``
    and only on a terminal (or on ``file``): a large routed run takes minutes, a small one stays quiet. None off a
    terminal, so the run goes at full speed."""
    if file is None and not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(unit=unit, desc=desc, delay=delay_s, mininterval=min_interval_s, leave=False, file=file or sys.stderr,
               smoothing=0.1)

    def report(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield report
    finally:
        bar.close()


def _oom_exit(result: SimResult, allow_oom: bool) -> int:
    """EXIT_OOM with one line naming the worst device, unless the user asked to go on."""
    ooms = result.oom
    if allow_oom or not ooms:
        return 0
    worst = max(ooms, key=lambda o: o["peak_memory_bytes"])
    print(f"pipescope: OOM on {len(ooms)} of {len(result.devices)} devices: device {worst['device']} needs "
          f"{worst['peak_memory_bytes']:,} bytes, has {worst['capacity_bytes']:,} "
          f"(exit {EXIT_OOM}; --allow-oom exits 0)", file=sys.stderr)
    return EXIT_OOM


def _csv_notes(schedule: Schedule, path: str) -> list[str]:
    """What ``--csv`` cannot hold of ``schedule``: a CSV is one flush of its microbatches, without the weight update
    or the iterations of a schedule that steps without a flush (2BW, PipeDream)."""
    if schedule.iterations == 1 and schedule.weight_update == "flush":
        return []
    return [f"--csv: {path} holds the {schedule.iterations} iterations of {schedule.num_microbatches} microbatches as "
            f"one flush schedule of {schedule.total_microbatches} (a CSV has no weight update): it reads back as "
            f"that, not as {schedule.weight_update} with {schedule.num_microbatches}"]


OUTPUT_WRITERS = {"csv": ("pipescope.simulator.readers.csvio", "write_csv"),
                  "trace": ("pipescope.simulator.trace", "write_trace"),
                  "gantt": ("pipescope.experiments.plots", "write_gantt"),
                  "timeline": ("pipescope.experiments.tables", "write_timeline")}  # flag -> (module, writer)


def _write_outputs(result: SimResult, args: argparse.Namespace) -> None:
    """Each output asked for; ConfigError naming the flag of one that cannot be written after all (the checks
    before the run cannot see everything, e.g. a folder under /proc)."""
    for flag, (module, name) in OUTPUT_WRITERS.items():
        path = getattr(args, flag)
        if path:
            write = getattr(importlib.import_module(module), name)  # on demand: matplotlib only for a Gantt
            try:
                write(result.schedule if flag == "csv" else result, path)
            except OSError as err:
                raise ConfigError(f"--{flag}: cannot write {path!r} ({err.strerror or err}), expected a writable "
                                  f"file name") from None


def cmd_schedules(args: argparse.Namespace) -> int:
    from pipescope.simulator.schedules import ALIASES, GENERATORS
    width = max(len(n) for n in GENERATORS) + 2
    for name, gen in GENERATORS.items():
        aliases = [a for a, target in ALIASES.items() if target == name]
        print(f"{name:<{width}}{gen.description}" + (f" (aliases: {', '.join(aliases)})" if aliases else ""))
    print(f"{'torch:<Name>':<{width}}a torch.distributed.pipelining schedule class replayed from its pipeline_order"
          " (needs torch): GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; 1F1B's"
          " order is malformed (its last rank runs forwards 1..m) and is refused: use 1f1b")
    print(f"{'csv:<path>':<{width}}a schedule in torch's CSV format (one row per rank)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from pipescope.simulator.check import check
    from pipescope.simulator.readers.csvio import read_csv
    if not os.path.isfile(args.file):
        return usage_error(f"FILE: {args.file!r} does not exist or is not a file")
    try:
        microbatches = None if args.microbatches is None else \
            integer_flag("--microbatches", args.microbatches, *RANGES["schedule.microbatches"])
    except ValueError as err:
        return usage_error(str(err))
    try:
        schedule = read_csv(args.file, microbatches)
    except ValueError as err:
        return usage_error(f"FILE: {args.file!r}: {err}")
    try:
        steps = check(schedule)
    except ScheduleError as err:
        print(f"{args.file}: invalid schedule", file=sys.stderr)
        for line in err.problems:
            print(f"  {line}", file=sys.stderr)
        return EXIT_INVALID_SCHEDULE
    torch_steps, stalled = _torch_dry_run(schedule, steps)
    sizes = [counted(schedule.num_devices, "device"), counted(schedule.num_stages, "stage"),
             counted(schedule.total_microbatches, "microbatch", "microbatches"),
             counted(schedule.num_compute_ops(), "op")]
    verdict = "valid for pipescope, not for torch" if stalled else "ok"  # torch's own run stalls: exit 1 below
    print(f"{args.file}: {verdict}: {', '.join(sizes)}, {counted(steps, 'unit-time step')} ({torch_steps})")
    if stalled:
        print(f"{args.file}: torch's dry run refuses it: {stalled}", file=sys.stderr)
        return EXIT_INVALID_SCHEDULE
    return 0


# torch's dry run gives every rank a slot at every step and pops each rank's list from the front, so its time grows
# as devices x steps and as steps^2 (p = 2,000, m = 4: 8 million device-steps, 40 s): past these, check skips it.
TORCH_DRY_RUN_MAX_DEVICE_STEPS = 250_000  # devices x unit-time steps; at most ~6 s
TORCH_DRY_RUN_MAX_STEPS = 10_000


def _torch_dry_run(schedule, unit_steps: int) -> tuple[str, str]:
    """("N with send/recv, as torch's dry run counts", "") from torch itself; the reason when torch stalls; skipped
    (and said so) past TORCH_DRY_RUN_MAX_DEVICE_STEPS or TORCH_DRY_RUN_MAX_STEPS."""
    if schedule.num_devices * unit_steps > TORCH_DRY_RUN_MAX_DEVICE_STEPS or unit_steps > TORCH_DRY_RUN_MAX_STEPS:
        return (f"torch's dry run skipped: {schedule.num_devices:,} devices x {unit_steps:,} steps, over its limits "
                f"of {TORCH_DRY_RUN_MAX_DEVICE_STEPS:,} device-steps and {TORCH_DRY_RUN_MAX_STEPS:,} steps"), ""
    try:
        from pipescope.calibration.torch_schedules import dry_run_steps
        steps, stalled = dry_run_steps(schedule)
    except ImportError:
        return "torch not installed: no dry-run count", ""
    return (f"{steps} with send/recv, as torch's dry run counts" if steps is not None else "torch's dry run stalls",
            stalled)


def cmd_bench(args: argparse.Namespace) -> int:
    from pipescope.experiments import bench_scale
    from pipescope.experiments.bench import run_bench
    try:
        repeat = integer_flag("--repeat", args.repeat, 1, 1000)
        max_gpus = integer_flag("--max-gpus", args.max_gpus, bench_scale.REPLICA_GPUS, 32_768)  # 4,096 nodes
        if args.plot is not None:
            if not args.scale:
                raise ValueError(f"--plot: got {args.plot!r} without --scale; expected --scale (the ladder it draws)")
            format_of(args.plot, name="--plot")
            check_writable("plot", args.plot)
    except (ValueError, ConfigError) as err:
        return usage_error(str(err))
    if args.scale:
        return bench_scale.run_scale(max_gpus, args.json, args.plot)
    return run_bench(repeat, args.quick, args.json, args.network, args.sweep)


def build_parser() -> Parser:
    parser = Parser(prog="pipescope", description="Predict iteration time, bubbles and memory of pipeline-parallel "
                    "training schedules on a cluster, before renting it.")
    parser.add_argument("--version", action="version", version=f"pipescope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser("simulate", help="simulate one configuration and print a table (or --json)",
                       description="Build the schedule, model, cluster and costs a config names (defaults: "
                       "docs/cli.md), replay the schedule on the cluster in a discrete-event simulation, and print "
                       "iteration time, throughput, bubbles and per-device memory; --json, --timeline, --trace and "
                       "--gantt write the same run for machines, notebooks and Perfetto.")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (.json or .json.gz; opens in Perfetto); "
                   "missing parent folders of any output are created")
    p.add_argument("--gantt", metavar="FILE", help="write a Gantt chart (.png, .svg or .pdf)")
    p.add_argument("--csv", metavar="FILE", help="write the schedule run as torch's compute-only CSV")
    p.add_argument("--timeline", metavar="FILE", help="write the op timeline (.parquet or .csv)")
    p.add_argument("--allow-oom", action="store_true", help=f"exit 0 when a device runs out of memory (default: "
                   f"report it and exit {EXIT_OOM})")
    add_training_goal_args(p)
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("schedules", help="list the schedules pipescope can simulate",
                       description="List every schedule name simulate --schedule takes: the generators with their "
                       "aliases, options and bubble, and the csv: and torch: sources.")
    p.set_defaults(func=cmd_schedules)
    p = sub.add_parser("check", help="check a schedule CSV (torch's format) for malformed actions and deadlocks",
                       description="Parse FILE.csv as torch.distributed.pipelining writes schedules (one row per "
                       "device, one action per cell), lower it with its transfers and report its size (exit 0), "
                       "the schedule's problems or the actions a deadlock leaves stuck (exit 1), or a cell that "
                       "is not an action (exit 2).")
    p.add_argument("file", metavar="FILE.csv")
    p.add_argument("--microbatches", help="microbatches per iteration (default: inferred from the file)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="time the engine against a heapq list-scheduler floor",
                       description="Time the simulator on fixed cases (medians of --repeat runs) against a plain "
                       "heapq list scheduler of the same program, the floor any engine pays; --network also times "
                       "whole runs over routed flows. Speed is measured here, not in tests.")
    p.add_argument("--repeat", default="5", help="runs per case; medians are reported (default 5)")
    p.add_argument("--quick", action="store_true", help="only the small case (p=8, m=64)")
    p.add_argument("--network", action="store_true", help="also time whole runs over routed flows with data "
                   "parallelism: 64, 256 and 1,024 GPUs (about a minute)")
    p.add_argument("--sweep", action="store_true", help="also time a sweep of 200 small runs on a process pool and "
                   "on a local Dask cluster, 2 workers each (runs/s and overhead per run)")
    p.add_argument("--scale", action="store_true", help="instead, time whole runs of one 16,384-GPU-class model "
                   "with more and more data-parallel replicas (128 GPUs and up): wall time, peak memory, events/s "
                   "and the exponent of the growth")
    p.add_argument("--max-gpus", default="1024", help="--scale: the largest rung to run, 128 to 32768 GPUs: 128, "
                   "256, 1024 (default), 4096 or 16384; the collective's rungs (512, 4096 and 32768 GPUs, seconds "
                   "each) up to the same. The whole ladder to 1024 takes about 15 s on 2 cores, to 4096 about 35 s, "
                   "to 32768 about 75 s (README, \"Speed\")")
    p.add_argument("--plot", metavar="FILE", help="--scale: draw wall time against GPUs, log-log (.png, .svg, .pdf)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_bench)
    from pipescope.experiments import collective_cmd, plan_cmd, plot_cmd, sweep_cmd, topology_cmd, validate_cmd
    topology_cmd.register(sub)
    collective_cmd.register(sub)
    validate_cmd.register(sub)
    sweep_cmd.register(sub)
    plan_cmd.register(sub)
    plot_cmd.register(sub)
    _register_calibration(sub)
    return parser


def _register_calibration(sub: argparse._SubParsersAction) -> None:
    try:
        from pipescope.calibration.commands import register
    except ImportError as err:
        reason = str(err)
        for name in ("calibrate", "calibrate-comms", "calibrate-gemms"):
            p = sub.add_parser(name, help="(needs torch: pip install 'pipescope[calibration]')")
            p.set_defaults(func=lambda args, name=name, reason=reason: usage_error(
                f"{name} needs torch: pip install 'pipescope[calibration]' ({reason})"))
        return
    register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would point at the top-level help; the subcommand's lists the flags meant
        parser.exit(2, f"pipescope: error: unrecognized arguments: {' '.join(extra)} (see 'pipescope "
                       f"{args.command} --help')\n")
    try:
        return args.func(args)
    except (ConfigError, ScheduleError) as err:
        if isinstance(err, ScheduleError):
            named = getattr(args, "schedule", None)  # a csv: file's name says which file
            print(f"pipescope: invalid schedule{f' {named}' if named else ''}: {err}", file=sys.stderr)
            return EXIT_INVALID_SCHEDULE
        return usage_error(str(err))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `pipescope bench | head`: stop quietly like other CLI tools
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
