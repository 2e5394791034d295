"""``pipescope bench --scale`` (experiments/bench_scale.py): the smallest rung runs for real in a child process and
reports what it measured; the fit and the flags are checked here. The ladder's timings are a benchmark
(tests/benchmarks/test_scale_speed.py), not a test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipescope.experiments.bench_scale import exponent, run_case
from pipescope.experiments.cli import main


def test_the_smallest_rung_runs_in_its_own_process_and_reports_its_memory_and_events(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "scale.png"
    assert main(["bench", "--scale", "--max-gpus", "255", "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    [rung] = report["cases"]  # 255 GPUs hold one pipeline of 128, not two
    assert rung["gpus"] == 128 and rung["data_parallel"] == 1 and rung["replayed"] == 1
    # a child's own peak: more than an interpreter with numpy, less than this test process could hide
    assert 50 * 2**20 < rung["peak_rss_bytes"] < 4 * 2**30
    assert rung["ops"] == 16 * 2 * (16 * 2 + 1) and rung["flows"] > 0  # per chunk-stage: F, B per microbatch, OPT
    events = rung["ops"] + rung["flows"] + rung["rate_updates"]
    assert rung["events_per_s"] == pytest.approx(events / rung["wall_s"])
    assert report["exponent"] is None and report["target"]["gpus"] == 16_384
    assert report["collectives"] == []  # its smallest rung is 512 GPUs
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_collective_rung_times_one_all_reduce_in_its_own_process() -> None:
    from pipescope.experiments.bench_scale import run_collective
    rung = run_collective(64)  # 512 GPUs: about a second
    assert rung["gpus"] == 512 and rung["algorithm"].startswith(("hierarchical", "ring", "tree"))
    assert 0 < rung["time_s"] < rung["wall_s"] and rung["busbw_GBps"] > 0
    assert 50 * 2**20 < rung["peak_rss_bytes"] < 4 * 2**30


def test_the_exponent_is_the_slope_of_log_wall_time_over_log_gpus() -> None:
    rows = [{"gpus": g, "wall_s": 0.5 * g ** 1.5} for g in (128, 256, 1024)]
    assert exponent(rows) == pytest.approx(1.5)
    assert exponent(rows[:1]) is None


def test_a_rung_that_fails_says_how(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from pipescope.experiments import bench_scale
    monkeypatch.setattr(bench_scale, "MODEL", {**bench_scale.MODEL, "heads": 3})  # 3 does not divide 16384
    with pytest.raises(RuntimeError, match="1 replicas exited 2: .*model.heads"):
        run_case(1)
    assert main(["bench", "--scale", "--max-gpus", "128"]) == 1  # the command says so in one line, no traceback
    assert capsys.readouterr().err.strip().startswith("pipescope bench --scale: 1 replicas exited 2")


@pytest.mark.parametrize("args, message", [
    (["--scale", "--max-gpus", "100"], "--max-gpus: got '100', expected an integer from 128"),
    (["--scale", "--max-gpus", "65536"], "--max-gpus: got '65536', expected an integer from 128 to 32,768"),
    (["--plot", "x.png"], "--plot: got 'x.png' without --scale"),
    (["--scale", "--plot", "x.txt"], "--plot: got 'x.txt', expected a file name ending in .png, .svg or .pdf"),
])
def test_bad_scale_flags_are_one_line_usage_errors(args: list[str], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
