"""Two ways of timing the stages for 4 ranks on 2 cores, against the same real runs (opt-in: pytest -m benchmark -s
tests/benchmarks/test_stage_timing_paired.py; docs/validation.md "More ranks than cores").

Each round times every stage twice, as one rank by the wall clock and as four ranks at once by thread CPU time
(what ``validate --op-times stages`` does with more ranks than cores), simulates 1F1B p = 4, m = 8 on both, then runs
the pipeline once: both predictions meet the same measured iteration, so the machine's drift between runs cancels.
``PIPESCOPE_PROFILE=DIR`` reuses a profile of ``tiny --hidden 512`` with its comms; else one is calibrated first."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROUNDS = 4


def _profile(folder: str) -> str:
    """``DIR`` of ``PIPESCOPE_PROFILE``, or ``tiny --hidden 512`` calibrated into ``folder`` as docs/validation.md
    calibrates it."""
    if os.environ.get("PIPESCOPE_PROFILE"):
        return os.environ["PIPESCOPE_PROFILE"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "pipescope.calibration.commands", "calibrate", "--model", "tiny", "--hidden",
                    "512", "--device", "cpu", "--microbatch-sizes", "1", "--vocab-shards", "1", "--budget-s", "0.3",
                    "--precision", "fp32", "--out", folder], check=True, env=env, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                    "pipescope.calibration.comms", "--out", folder, "--min-bytes", "4KiB", "--max-bytes", "1MiB"],
                   check=True, env=env, capture_output=True, timeout=600)
    return folder


@pytest.mark.benchmark
def test_stages_timed_as_copies_by_cpu_time_against_one_copy_by_wall_clock(tmp_path) -> None:
    from pipescope.executor.stage_timing import stage_op_times
    from pipescope.config import load_config
    from pipescope.experiments import validate_cmd as vc
    from pipescope.experiments.cli import build_parser
    from pipescope.runner import prepare, run_prepared

    profile = _profile(str(tmp_path / "profile"))
    args = build_parser().parse_args(["validate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                                      "--profile", profile, "--op-times", "stages"])
    config, _ = vc._shared_cores(load_config(None, vc._sets(args, profile)))
    built = prepare(config)
    spec = vc._spec(built.schedule, built.config, vc.STAGE_TIMING_ITERATIONS, 5, 300)
    errors: dict[str, list[float]] = {"one rank, wall clock": [], "four ranks, CPU time": []}
    for round_ in range(ROUNDS):
        predicted = {}
        for label, copies, cpu_time in (("one rank, wall clock", 1, False), ("four ranks, CPU time", 4, True)):
            times = stage_op_times(spec, copies, cpu_time)
            costs = dataclasses.replace(built.costs, op_times=tuple(times), _cache={})
            predicted[label] = run_prepared(dataclasses.replace(built, costs=costs)).iteration_time_s
        result = run_prepared(built)
        rows, _, _ = vc._measure(result, result.config, 10, 5, 300, "cpu")
        spans = vc._compute_rows(rows).groupby("iteration").apply(
            functools.partial(vc._iteration_ns, built.schedule), include_groups=False)
        measured = statistics.median(spans.tolist()) / 1e9
        for label, seconds in predicted.items():
            errors[label].append((seconds - measured) / measured)
        print(f"round {round_ + 1}: measured {measured * 1e3:.1f} ms; " + "; ".join(
            f"{label} {seconds * 1e3:.1f} ms ({errors[label][-1]:+.1%})" for label, seconds in predicted.items()))
    for label, values in errors.items():
        print(f"{label}: median |error| {statistics.median(map(abs, values)):.1%}")
        assert all(-1 < e < 10 for e in values)  # finite, and neither way is off by an order of magnitude
