"""``pipescope validate``: calibrate (or load a profile), simulate, run the same program for real, report the error.

The real run is ``executor.run`` (gloo ranks on this machine, one thread each, or nccl ranks with a GPU
each; AdamW with clipping after each iteration); the prediction is ``pipescope.run`` on the profile. Warm-up
iterations are dropped and the median of the measured ones is compared: iteration time (the optimizer steps
included, as both timelines have them), busy time, each op matched by device and name (``sOPTk`` included), and
each device's peak memory: the memory ledger against what the executor tracked in its warm-up iteration (the CUDA
allocator's peak on GPUs; docs/validation.md says what differs and why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd

from pipescope.calibration.presets import check_harness_model
from pipescope.config import ConfigError, load_config
from pipescope.experiments.cli import as_flag, check_output_names, integer_flag
from pipescope.experiments.processes import run_in_group, sigterm_as_ctrl_c
from pipescope.experiments.validate_stages import (
    STAGE_TIMING_ITERATIONS,
    op_error_summary,
    op_table_lines,
    relative_error as _relative,
    time_stages,
)
from pipescope.simulator.ir import COMPUTE_KINDS, Action, ActionKind
from pipescope.simulator.lowering import comm_pair
from pipescope.simulator.models import PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run a schedule for real on this machine and compare with the prediction",
                       description="Calibrate the model on this machine (or load --profile), simulate the schedule on "
                       "that profile, run the same lowered program over real torch.distributed ranks (gloo on CPU, "
                       "one thread each), and report the predicted against the measured iteration time, busy time, "
                       "per-op durations and peak memory per device. Warm-up iterations are dropped; the median of "
                       "--iterations is used.")
    p.add_argument("--schedule", default="1f1b", help="any schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, "
                   "v-half, v-min, pipedream, 2bw (default 1f1b)")
    p.add_argument("--stages", default="2", help="pipeline devices p = ranks (default 2)")
    p.add_argument("--microbatches", default="4", help="microbatches m (default 4)")
    p.add_argument("--chunks", help="stages per device v (default: the schedule's)")
    p.add_argument("--recompute", action="store_true", help="recompute activations: F keeps only its stage input "
                   "and every backward runs the forward again first")
    p.add_argument("--model", help=f"preset to calibrate (default {DEFAULT_MODEL}; see 'pipescope calibrate "
                   "--help'); with --profile, the profile's model, which it must match")
    p.add_argument("--microbatch-size", default="1", help="samples per microbatch (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default; gloo ranks), or cuda: the pipeline over nccl "
                   "ranks, one GPU each, when torch sees as many GPUs as --stages; with fewer, every stage timed on "
                   "one GPU, op by op, against the profile's op times")
    p.add_argument("--profile", metavar="DIR", help="a 'pipescope calibrate --precision fp32' folder of this "
                   "--device to use instead of calibrating (the executor runs fp32)")
    p.add_argument("--iterations", default="5", help="measured iterations, after the warm-up (default 5)")
    p.add_argument("--warmup", default="5", help="warm-up iterations, not measured (default 5; memory is tracked in "
                   "the first): a fresh rank's first iterations run up to 2x slower")
    p.add_argument("--op-times", choices=("profile", "stages"),
                   help="where the simulation's op times come from: the calibration profile's kernel benches "
                   "(profile, the default on GPUs), or every stage timed in the executor on one rank, one op after "
                   "another, as Megatron's pipeline simulator does (stages, the default on a CPU, whose per-op "
                   "overheads the kernel benches miss: the error is then the schedule model's own; with "
                   "more ranks than CPU cores, as many such ranks at once as the pipeline has, by CPU time; "
                   "docs/validation.md)")
    p.add_argument("--timeout", default="120", help="seconds without progress before the run is stopped")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--gantt", metavar="FILE", help="overlay Gantt: predicted above measured (.png, .svg, .pdf)")
    p.add_argument("--timeline", metavar="FILE", help="the first measured iteration's op timeline, in simulate's "
                   "columns (.parquet or .csv), to open beside simulate --timeline")
    p.add_argument("--trace", metavar="FILE", help="the first measured iteration as a Chrome trace (.json or "
                   ".json.gz), beside simulate --trace; its memory counters are the ledger over the measured times")
    p.add_argument("--max-error", help="exit 1 when |iteration_time_error| is above this (e.g. 0.1); with "
                   "--published, when the worst run's |error| is above it, or a run failed")
    published = p.add_argument_group("published runs", "score the simulator on runs measured on real clusters "
                                     "(docs/validation.md, \"Published runs\"); none of the flags above but --json "
                                     "and --max-error apply")
    published.add_argument("--published", nargs="*", metavar="NAME", help="simulate every run of the corpus as its "
                           "configuration says (or the runs and sources NAME) and report predicted against measured, "
                           "the signed error per run and the mean and worst per source; settings a source left "
                           "unstated are chosen as its authors would have (the fastest that fits)")
    published.add_argument("--corpus", metavar="FILE", help="a corpus file in the format of the shipped one "
                           "(experiments/published/runs.yaml, the default)")
    published.add_argument("--workers", metavar="N", help="worker processes (default: the CPUs this process may use)")
    published.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    published.add_argument("--dask", metavar="local|tcp://HOST:PORT", help="run on Dask instead of a process pool "
                           "(as 'pipescope sweep --dask'; the address is trusted input)")
    published.add_argument("--plot", metavar="FILE", help="predicted against measured on log-log axes, one marker "
                           "per source, the y = x line and a ±10%% band (.png, .svg, .pdf)")
    p.set_defaults(func=cmd_validate)
    PUBLISHED_OFF.update({name: p.get_default(name) for name in EXECUTOR_FLAGS})


# The flags of a run on this machine's ranks, which --published does not read, and the flags only it reads
EXECUTOR_FLAGS = ("schedule", "stages", "microbatches", "chunks", "recompute", "model", "microbatch_size", "device",
                  "profile", "iterations", "warmup", "op_times", "timeout", "gantt", "timeline", "trace")
PUBLISHED_FLAGS = ("corpus", "workers", "dask", "plot")
PUBLISHED_OFF: dict[str, object] = {}  # each executor flag's default, filled by register


def cmd_validate(args: argparse.Namespace) -> int:
    if args.published is not None:
        return _published(args)
    for name in PUBLISHED_FLAGS + ("no_progress",):
        if getattr(args, name) not in (None, False):
            print(f"pipescope: error: --{name.replace('_', '-')}: only with --published", file=sys.stderr)
            return 2
    try:
        limit = _number("--max-error", args.max_error) if args.max_error is not None else None
        check_output_names(args)  # a bad file name fails now, not after a run of tens of seconds
        report, predicted, measured = validate(args)
    except ConfigError as err:
        print(f"pipescope: error: {as_flag(str(err), FLAG_OF_KEY)}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"pipescope: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a rank died or hung (RunError), or calibration failed
        print(f"pipescope: error: {err}", file=sys.stderr)
        return 1
    if args.gantt:
        from pipescope.experiments.plots import write_overlay_gantt
        write_overlay_gantt(predicted, measured, args.gantt, report["schedule"])
        _wrote("gantt", args.gantt)
    print(json.dumps(report) if args.json else _table(report))
    if limit is not None and abs(report["iteration_time_error"]) > limit:
        print(f"pipescope: iteration time error {report['iteration_time_error']:+.1%} is above --max-error "
              f"{limit:g}", file=sys.stderr)
        return 1
    return 0


def _published(args: argparse.Namespace) -> int:
    """``validate --published``: the corpus of published runs (``published_cmd``); exit 2 on bad input."""
    from pipescope.experiments.published_cmd import cmd_published
    from pipescope.experiments.sweep_cmd import MAX_WORKERS, check_pool_flags

    try:
        for name, default in PUBLISHED_OFF.items():
            if getattr(args, name) != default:
                raise ValueError(f"--{name.replace('_', '-')}: not with --published, which runs each published run's "
                                 f"own configuration")
        args.max_error = _number("--max-error", args.max_error) if args.max_error is not None else None
        workers = integer_flag("--workers", args.workers, 1, MAX_WORKERS) if args.workers is not None else None
        check_pool_flags(workers, args.dask)
        if args.plot is not None:  # checked before the runs: a picture that cannot be written fails now, in a line
            from pipescope.experiments.cli import check_writable
            from pipescope.experiments.figure_formats import format_of
            format_of(args.plot, name="--plot")
            check_writable("plot", args.plot)
        with sigterm_as_ctrl_c():
            return cmd_published(args, args.published, workers)
    except (ConfigError, ValueError) as err:
        print(f"pipescope: error: {err}", file=sys.stderr)
        return 2


def validate(args: argparse.Namespace) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(report, predicted compute rows, measured compute rows)."""
    mode = _mode(args)
    iterations = integer_flag("--iterations", args.iterations, 1, 100)
    warmup = integer_flag("--warmup", args.warmup, 1, 100)
    timeout = integer_flag("--timeout", args.timeout, 1, 3600)
    # on a CPU, said before anything is timed (calibrate, or the run of a given profile) and once the flags are good
    busy = busy_machine(os.getloadavg()[0], len(os.sched_getaffinity(0))) if mode == CPU else None
    if not args.profile:
        _check_flags(args)
        _say_busy(busy)
    with tempfile.TemporaryDirectory() as folder:
        profile = args.profile or _calibrate(args, folder, comms=mode != ONE_GPU)
        config = load_config(None, _sets(args, profile))
        config, warnings = _shared_cores(config) if mode == CPU else (config, [])
        from pipescope.runner import prepare, run_prepared
        built = prepare(config)
        _check_one_pipeline(built.schedule)
        _check_profile(built.costs, profile, args.device, args.model if args.profile else None, mode != ONE_GPU)
        if args.profile:
            _say_busy(busy)
        warnings += [busy] if busy else []
        op_times, table = getattr(args, "op_times", None) or DEFAULT_OP_TIMES[mode], None
        if op_times == "stages":
            spec = _spec(built.schedule, built.config, STAGE_TIMING_ITERATIONS, warmup, timeout, args.device)
            built, table = _time_stages(built, spec, mode)
        if mode == ONE_GPU:  # the ops, stage by stage, against the profile's (docs/validation.md, "GPUs")
            return _ops_report(built.schedule, table), None, None
        _phase("simulate")
        result = run_prepared(built)
        backend = "gloo" if mode == CPU else "nccl"
        _phase(f"run ({result.schedule.num_devices} {backend} ranks, {warmup} warm-up + {iterations} iterations)")
        rows, memory, cpu = _measure(result, result.config, iterations, warmup, timeout, args.device)
    _write_measured(result, rows, args)
    predicted, measured = _compute_rows(result.timeline), _compute_rows(rows)
    report = {**_report(result, predicted, measured, memory, cpu), "op_times": op_times,
              "warnings": warnings + result.warnings}  # the simulation's too: unmeasured sizes, noisy rows
    if table is not None:
        report.update(stage_ops=table, **op_error_summary(table))
    return report, predicted, measured


FLAG_OF_KEY = {"schedule.name": "--schedule", "schedule.stages": "--stages", "schedule.microbatches": "--microbatches",
               "schedule.chunks": "--chunks", "model.preset": "--model", "model.microbatch_size": "--microbatch-size",
               "costs.profile": "--profile"}  # the config keys validate's flags set


PIPELINE_FLAGS = ("gantt", "timeline", "trace", "max_error")  # what only a pipeline run over ranks serves
CPU, GPUS, ONE_GPU = "cpu", "gpus", "one-gpu"  # where validate runs: gloo ranks, nccl ranks, or stages on one GPU
# On a CPU the kernel benches miss the per-op overheads of the interpreter and gloo that a real rank pays (30-35%
# at hidden 512, docs/validation.md), so the default times the stages in the executor and the error left is the
# schedule model's own; on GPUs the profile is what is being checked
DEFAULT_OP_TIMES = {CPU: "stages", GPUS: "profile", ONE_GPU: "stages"}


def _mode(args: argparse.Namespace) -> str:
    """Where ``--device`` runs: ``cpu``; ``gpus`` (one nccl rank per pipeline device) when torch sees a GPU for
    each; else ``one-gpu``, every stage timed on one GPU (one-line errors for another device, none, or a flag the
    one-GPU run cannot serve)."""
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device: got {args.device!r}, expected cpu or cuda")
    if args.device == "cpu":
        return CPU
    import torch
    if not torch.cuda.is_available():
        raise ValueError("--device: got 'cuda', but torch sees no CUDA device here; expected cpu")
    return cuda_mode(args, torch.cuda.device_count())


def cuda_mode(args: argparse.Namespace, gpus: int) -> str:
    """``gpus`` or ``one-gpu`` for ``--device cuda`` on a machine with ``gpus`` GPUs."""
    stages = integer_flag("--stages", args.stages, 1, 100_000)
    if gpus >= stages:
        return GPUS
    for name in PIPELINE_FLAGS:
        if getattr(args, name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)!r} with --device cuda on {gpus} "
                             f"GPU(s), expected {stages} GPUs, one per stage device (with fewer, validate times the "
                             "stages on one GPU and runs no pipeline)")
    if getattr(args, "op_times", None) == "profile":
        raise ValueError("--op-times: got 'profile' with --device cuda on fewer GPUs than --stages, expected stages "
                         "(on one GPU the profile is what the measured ops are compared with)")
    return ONE_GPU


CALIBRATION_TIMEOUT_S = 600  # per calibration command; then it is stopped, with the ranks it started
DEFAULT_MODEL = "tiny-512"  # what validate calibrates without --model: ops that outweigh a CPU's per-op overheads
EXECUTOR_PRECISION = "fp32"  # the executor builds every stage in fp32 (docs/validation.md, "GPUs")


def _check_profile(costs, profile: str, device: str, preset: str | None, transfers: bool) -> None:
    """The executor runs the profile's model in fp32 on ``device``: a ``--profile`` of another ``--model``
    (``preset``, when given), or timed in another precision or on another device, would be compared with ops it never
    timed, and a pipeline's transfers need the profile's p2p fit (else the default topology's links stand in for
    gloo's); one line naming the flag. ``costs``: the ``ProfiledCosts`` loaded and checked from it."""
    meta = costs.meta
    model = meta["model"]  # with its shape: the runner refuses a profile without
    if preset is not None and _differs(preset, model):
        shape = ", ".join(f"{key}={model.get(key)}" for key in ("layers", "hidden", "heads", "vocab"))
        raise ValueError(f"--model: got {preset!r}, but --profile {profile} measured {model.get('name')!r} with "
                         f"{shape}; expected its model (or leave --model out)")
    if meta.get("precision") != EXECUTOR_PRECISION:
        raise ValueError(f"--profile: {profile} was calibrated in {meta.get('precision')}, expected "
                         f"{EXECUTOR_PRECISION}, the precision the executor runs (calibrate --precision fp32)")
    measured_on = meta["device"].get("type") if isinstance(meta.get("device"), dict) else None
    if measured_on != device:
        raise ValueError(f"--profile: {profile} was calibrated on {measured_on}, expected a {device} profile for "
                         f"--device {device}")
    if transfers and costs.comms_fit is None:
        raise ValueError(f"--profile: {profile} has no comms.json, expected the transfers measured too "
                         f"(torchrun --nproc-per-node 2 -m pipescope.calibration.comms --out {profile}), or no "
                         "--profile")


def _differs(preset: str, model: dict) -> bool:
    """Whether the profile's ``model`` is not the preset (by name or by any dimension but seq)."""
    spec = PRESETS.get(preset)
    return spec is None or model.get("name") != preset or any(
        model.get(key) != getattr(spec, key) for key in ("layers", "hidden", "heads", "vocab"))


def _time_stages(built, spec, mode: str):
    """``time_stages``: every stage on one rank, one op after another; with more ranks than cores (``host_cores``
    set), as many copies of that rank at once as the pipeline has ranks, each op timed by its thread's CPU time:
    what an op costs when ranks take turns on the cores, the caches refilled after each switch, without the wait
    for a core, which ``cluster.host_cores`` models (docs/validation.md, "More ranks than cores")."""
    ranks = built.schedule.num_devices
    shared = built.config.cluster.host_cores is not None
    copies = f"{ranks} copies at once, by CPU time" if shared else "one op after another"
    _phase(f"time every stage on one {'rank' if mode == CPU else 'GPU'}, {copies}")
    return time_stages(built, spec, ranks if shared else 1, cpu_time=shared)


def _ops_report(schedule, table: list[dict]) -> dict:
    """The one-GPU report: every stage's ops measured against the profile's."""
    return {"schedule": schedule.name, "stages": schedule.num_devices, "microbatches": schedule.num_microbatches,
            "device": "cuda", "op_times": "stages", "stage_ops": table, **op_error_summary(table), "warnings": []}


def _say_busy(warning: str | None) -> None:
    if warning:
        print(f"pipescope validate: warning: {warning}", file=sys.stderr, flush=True)


def busy_machine(load: float, cores: int) -> str | None:
    """A warning when other work already keeps the CPU cores busy (the 1-minute load average above half of them):
    calibrate and the run then time that work too, and the error can reach -50% (docs/validation.md)."""
    if load <= cores / 2:
        return None
    return (f"the machine is busy before validate starts (load average {load:.1f} on {cores} CPU cores): the "
            f"timings share the cores with that work, so expect a large error; run validate on a quiet machine")


def _shared_cores(config):
    """(config, warnings): with more ranks than CPU cores, the simulation shares the cores between the ranks as the
    OS does (``cluster.host_cores``), and a warning, also printed, says so (docs/validation.md, "More ranks than
    cores")."""
    ranks, cores = config.schedule.stages, len(os.sched_getaffinity(0))
    if ranks <= cores:
        return config, []
    warning = (f"{ranks} ranks on {cores} CPU cores: the ranks take turns on the cores, which the simulation "
               f"models (cluster.host_cores={cores}); gloo's transfers then wait for a core too, which it does not")
    print(f"pipescope validate: warning: {warning}", file=sys.stderr, flush=True)
    cluster = dataclasses.replace(config.cluster, host_cores=cores)
    return dataclasses.replace(config, cluster=cluster), [warning]


def _check_flags(args: argparse.Namespace) -> None:
    """The schedule and model the flags name, built under analytic costs before a calibration of tens of seconds:
    ``--stages 0`` or more stages than the model has layers fails now, in one line."""
    from pipescope.runner import prepare
    built = prepare(load_config(None, _sets(args, None) + [f"model.preset={json.dumps(args.model or DEFAULT_MODEL)}"]))
    _check_one_pipeline(built.schedule)


def _check_one_pipeline(schedule) -> None:
    """A bidirectional schedule's two copies of the model are not built by the real executor: one line, exit 2."""
    if schedule.pipelines > 1:
        raise ConfigError(f"--schedule: {schedule.name} runs {schedule.pipelines} pipelines (two copies of the "
                          f"model), which the real executor does not build; expected a schedule of one pipeline")


def _sets(args: argparse.Namespace, profile: str | None) -> list[str]:
    """The config the flags give: on the profile's costs, or analytic ones without a profile."""
    costs = ["costs.kind=profile", f"costs.profile={json.dumps(profile)}"] if profile else ["costs.kind=analytic"]
    sets = [f"schedule.name={json.dumps(args.schedule)}", f"schedule.stages={args.stages}",
            f"schedule.microbatches={args.microbatches}", *costs, f"model.microbatch_size={args.microbatch_size}",
            "memory.runtime=torch"]  # the executor holds buffers as torch's pipelining runtime does
    sets += ["schedule.recompute=true"] if getattr(args, "recompute", False) else []
    return sets + ([f"schedule.chunks={args.chunks}"] if args.chunks else [])


def _calibrate(args: argparse.Namespace, folder: str, comms: bool) -> str:
    model = args.model or DEFAULT_MODEL
    check_harness_model(model)  # before a calibration subprocess says so, wrapped in its own error
    _phase(f"calibrate {model} on {args.device}")
    command = [sys.executable, "-m", "pipescope.calibration.commands", "calibrate", "--model", model,
               "--device", args.device, "--out", folder, "--microbatch-sizes", str(args.microbatch_size),
               "--vocab-shards", "1", "--budget-s", "0.3", "--precision", EXECUTOR_PRECISION]
    _run_step("calibrate", command)
    if not comms:  # one GPU, no transfers: the per-op comparison needs no comms profile
        return folder
    backend = "nccl" if args.device == "cuda" else "gloo"
    _phase(f"calibrate-comms (p2p and collectives over {args.stages} {backend} ranks)")
    from pipescope.executor.run import free_port
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.stages),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    largest = "64MiB" if args.device == "cuda" else "1MiB"  # a GPU model's activations; CPU's stay small
    _run_step("calibrate-comms", torchrun + ["-m", "pipescope.calibration.comms", "--out", folder, "--backend",
                                             backend, "--min-bytes", "4KiB", "--max-bytes", largest])
    return folder


def _run_step(name: str, command: list[str]) -> None:
    """Run one calibration command (one thread per process, as the executor's ranks); RuntimeError with its last
    line if it fails."""
    done = run_in_group(command, CALIBRATION_TIMEOUT_S, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done is None:
        raise RuntimeError(f"{name} failed: still running after {CALIBRATION_TIMEOUT_S} s, stopped")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{name} failed: {last}")


def _spec(schedule, config, iterations: int, warmup: int, timeout: int, device: str = "cpu"):
    """The executor's ``RunSpec`` of ``schedule`` on the config's model."""
    from pipescope.executor.run import RunSpec
    from pipescope.calibration.presets import Shape

    m = config.model
    shape = Shape(m.preset or "custom", m.layers, m.hidden, m.heads, m.seq, m.vocab)
    split = tuple(m.layers_per_stage) if m.layers_per_stage else None
    return RunSpec(schedule, shape, m.microbatch_size, split, iterations=iterations, warmup=warmup, seed=config.seed,
                   timeout_s=timeout, device=device)


def _measure(result, config, iterations: int, warmup: int, timeout: int,
             device: str) -> tuple[pd.DataFrame, list, list[list[int]]]:
    """Every measured row of every iteration (columns as the timeline's and ``iteration``, times from the
    iteration's first compute op), each rank's measured memory (``executor.memory.RankMemory``), and per iteration
    each rank's process CPU time (ns)."""
    from pipescope.executor.run import execute_timed

    run = execute_timed(_spec(result.schedule, config, iterations, warmup, timeout, device))
    frames = []
    for index, ranks in enumerate(run.rows):
        rows = [(device, *row) for device, device_rows in enumerate(ranks) for row in device_rows]
        frame = pd.DataFrame(rows, columns=ROW_COLUMNS)
        origin = _compute_rows(frame)["start_ns"].min()
        frames.append(frame.assign(start_ns=frame["start_ns"] - origin, end_ns=frame["end_ns"] - origin,
                                   iteration=index))
    return pd.concat(frames, ignore_index=True), run.memory, run.cpu_ns


def _write_measured(result, measured: pd.DataFrame, args: argparse.Namespace) -> None:
    """``--timeline`` and ``--trace``: the first measured iteration as a result of the simulator's kind
    (``result.with_timeline``), written by the simulator's own writers: the predicted timeline's rows, each with
    its measured times, from the run's first row."""
    if not (args.timeline or args.trace):
        return
    from pipescope.experiments.tables import write_timeline
    from pipescope.simulator.program import KINDS
    from pipescope.simulator.result import with_timeline
    from pipescope.simulator.trace import write_trace
    spans = measured_spans(measured[measured["iteration"] == 0], result.schedule.stage_to_device)
    template = result.records
    keys = zip(template.device.tolist(), (KINDS[k].value for k in template.kind), template.stage.tolist(),
               template.microbatch.tolist())
    found = [spans.get(key) for key in keys]
    start = np.array([span[0] if span else 0 for span in found], np.int64)
    end = np.array([span[1] if span else 0 for span in found], np.int64)
    kept = np.array([span is not None for span in found], bool)
    if not kept.all():  # every built-in schedule's run has every row; say so if one ever does not
        missing = template.actions[int(np.flatnonzero(~kept)[0])]
        print(f"pipescope validate: warning: {int((~kept).sum())} predicted rows were not measured (the first: "
              f"{missing}); the measured timeline leaves them out", file=sys.stderr, flush=True)
    origin = start[kept].min()
    records = dataclasses.replace(template, start=start - origin, end=end - origin).subset(kept, template.num_devices)
    real = with_timeline(result, records)
    if args.timeline:
        write_timeline(real, args.timeline)
        _wrote("timeline", args.timeline)
    if args.trace:
        write_trace(real, args.trace)
        _wrote("trace", args.trace)


def _wrote(what: str, path: str) -> None:
    """Say where an output went, on stderr: stdout holds the report (one JSON object with --json)."""
    print(f"pipescope validate: wrote {what}: {path}", file=sys.stderr, flush=True)


def measured_spans(rows: pd.DataFrame, stage_to_device) -> dict[tuple[int, str, int, int], tuple[int, int]]:
    """(device, kind, stage, microbatch) -> (start_ns, end_ns) of one measured iteration's rows. A transfer's SEND
    and RECV rows both span from the later of its two posts (neither side can move bytes before) to the receiver's
    wait returning (its row's end): when the data arrived, or the latest it can have (docs/validation.md)."""
    spans = {(int(d), k, int(s), int(mb)): (int(a), int(b)) for d, k, s, mb, a, b in
             zip(rows["device"], rows["kind"], rows["stage"], rows["microbatch"], rows["start_ns"], rows["end_ns"])}
    for (device, kind, stage, microbatch), (posted, _) in list(spans.items()):
        producer = SENT_BY.get(kind)
        if producer is None:
            continue
        _, recv = comm_pair(Action(stage, producer, microbatch), stage_to_device)
        key = (stage_to_device[recv.stage], recv.kind.value, recv.stage, microbatch)
        if key in spans:
            start = max(posted, spans[key][0])
            spans[device, kind, stage, microbatch] = spans[key] = (start, max(start, spans[key][1]))
    return spans


SENT_BY = {ActionKind.SEND_F.value: ActionKind.F, ActionKind.SEND_B.value: ActionKind.B}  # B, or I: the same pair


ROW_COLUMNS = ["device", "action", "kind", "stage", "microbatch", "start_ns", "end_ns"]  # the executor's rows


def _compute_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """F, I, W, B and the optimizer steps (OPT), with ``iteration`` if the frame has it: the ops that take a
    device's compute time on both sides."""
    kinds = {k.value for k in COMPUTE_KINDS | {ActionKind.OPT}}
    rows = frame[frame["kind"].isin(kinds)]
    return rows[[c for c in [*ROW_COLUMNS, "iteration"] if c in rows]].reset_index(drop=True)


def _report(result, predicted: pd.DataFrame, measured: pd.DataFrame, memory: list, cpu: list[list[int]]) -> dict:
    """Iteration, busy, bubble and peak-memory errors per device, each rank's CPU time (the median over the
    iterations), and per-op duration and start errors (signed, relative)."""
    spans = measured.groupby("iteration").apply(lambda rows: _iteration_ns(result.schedule, rows), include_groups=False)
    median_iteration = statistics.median(spans.tolist())
    typical = int((spans - median_iteration).abs().idxmin())  # the measured iteration closest to the median
    real = measured[measured["iteration"] == typical]
    predicted_s, measured_s = result.iteration_time_s, median_iteration / 1e9
    joined = predicted.merge(real, on=["device", "action"], suffixes=("_p", "_m"))
    duration_p = joined["end_ns_p"] - joined["start_ns_p"]
    duration_m = (joined["end_ns_m"] - joined["start_ns_m"]).clip(lower=1)
    duration_error = (duration_p - duration_m) / duration_m
    start_error = ((joined["start_ns_p"] - predicted["start_ns"].min()) - joined["start_ns_m"]) / median_iteration
    devices, per_iteration = [], 1e9 * result.schedule.iterations  # PipeDream and 2BW: several per program
    for d in sorted(set(predicted["device"])):
        busy_p = _busy(predicted, d) / per_iteration
        busy_m = _busy(real, d) / per_iteration
        devices.append({"device": d, "predicted_busy_s": busy_p, "measured_busy_s": busy_m,
                        "busy_error": _relative(busy_p, busy_m),
                        "predicted_bubble": 1 - busy_p / predicted_s, "measured_bubble": 1 - busy_m / measured_s,
                        "measured_cpu_s": statistics.median(run[d] for run in cpu) / per_iteration,
                        **_memory(result.devices[d], memory[d])})
    worst = max(devices, key=lambda device: abs(device["memory_error"]))
    return {"schedule": result.schedule.name, "stages": result.schedule.num_devices,
            "microbatches": result.schedule.num_microbatches, "iterations_measured": int(spans.size),
            "predicted_iteration_time_s": predicted_s, "measured_iteration_time_s": measured_s,
            "iteration_time_error": _relative(predicted_s, measured_s),
            "op_duration_error_median": float(duration_error.median()),
            "op_duration_error_p90": float(duration_error.abs().quantile(0.9)),
            "op_start_error_median": float(start_error.median()),
            "op_start_error_p90": float(start_error.abs().quantile(0.9)),
            "memory_error": worst["memory_error"], "per_device": devices}


def _iteration_ns(schedule, rows: pd.DataFrame) -> int:
    """One measured run's iteration time, as the simulator defines it (``simulator.result``): its span, or for a
    schedule spanning iterations the median gap between iteration ends (their last backwards)."""
    from pipescope.simulator.result import iteration_times
    return iteration_times(schedule, rows["microbatch"].to_numpy(), rows["start_ns"].to_numpy(),
                           rows["end_ns"].to_numpy(), (rows["kind"] == ActionKind.OPT.value).to_numpy())[0]


STATIC = ("weights", "gradients", "optimizer")


def _memory(predicted, measured) -> dict:
    """One device's peak memory, the ledger's and the executor's, its static part, and the signed relative error."""
    return {"predicted_peak_memory_bytes": predicted.peak_memory_bytes,
            "measured_peak_memory_bytes": measured.peak_bytes,
            "memory_error": _relative(predicted.peak_memory_bytes, measured.peak_bytes),
            "predicted_static_memory_bytes": predicted.static_memory_bytes,
            "measured_static_memory_bytes": sum(measured.at_peak[k] for k in STATIC) if STATIC[0] in measured.at_peak
            else None,  # the CUDA allocator's peak has no categories
            "measured_peak_category": measured.peak_category, "measured_at_peak": measured.at_peak}


def _busy(frame: pd.DataFrame, device: int) -> int:
    rows = frame[frame["device"] == device]
    return int((rows["end_ns"] - rows["start_ns"]).sum())


OP_TIME_SOURCES = {"profile": "the profile", "stages": "each stage timed on one rank"}


def _table(report: dict) -> str:
    if "predicted_iteration_time_s" not in report:  # one GPU: the per-op table only
        summary = (f"{report['schedule']}: p={report['stages']} m={report['microbatches']}, every stage on one "
                   f"{report['device']} device: op time error median {report['op_time_error_median']:+.1%}, p90 "
                   f"|error| {report['op_time_error_p90']:.1%} (the profile against the executor)")
        return "\n".join([summary, *op_table_lines(report["stage_ops"])])
    source = OP_TIME_SOURCES[report["op_times"]]
    lines = [f"{report['schedule']}: p={report['stages']} m={report['microbatches']}, median of "
             f"{report['iterations_measured']} measured iterations, op times from {source}",
             f"iteration time  predicted {report['predicted_iteration_time_s'] * 1e3:.3f} ms  measured "
             f"{report['measured_iteration_time_s'] * 1e3:.3f} ms  error {report['iteration_time_error']:+.1%}",
             f"op durations    error median {report['op_duration_error_median']:+.1%}, p90 |error| "
             f"{report['op_duration_error_p90']:.1%}",
             f"op starts       error median {report['op_start_error_median']:+.1%} of the iteration, p90 |error| "
             f"{report['op_start_error_p90']:.1%}",
             f"peak memory     worst error {report['memory_error']:+.1%}",
             "device  busy predicted  busy measured   error  bubble predicted  measured  peak memory predicted  "
             "measured   error"]
    for d in report["per_device"]:
        lines.append(f"{d['device']:>6} {d['predicted_busy_s'] * 1e3:>12.3f} ms {d['measured_busy_s'] * 1e3:>11.3f} ms "
                     f"{d['busy_error']:>+7.1%} {d['predicted_bubble']:>16.1%} {d['measured_bubble']:>9.1%} "
                     f"{d['predicted_peak_memory_bytes'] / 2**20:>17.2f} MiB "
                     f"{d['measured_peak_memory_bytes'] / 2**20:>8.2f} MiB {d['memory_error']:>+7.1%}")
    if "stage_ops" in report:
        lines += ["the profile's op times against each stage timed on one rank:", *op_table_lines(report["stage_ops"])]
    return "\n".join(lines)


def _phase(text: str) -> None:
    print(f"pipescope validate: {text}", file=sys.stderr, flush=True)


def _number(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{flag}: got {text!r}, expected a non-negative number")
    return value
