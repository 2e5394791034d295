"""Calibration on a noisy machine: threads pinned by default, noisy rows re-measured, the rest reported.

The decision (which measurement to make again, which to keep, which rows stay noisy) is pure and tested with
scripted measurements; one end-to-end run calibrates the `tiny` model while another process spins on a core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pd = pytest.importorskip("pandas")

from pipescope.calibration import commands, ops  # noqa: E402 (after the torch skip)
from pipescope.calibration.args import UsageError, timing_config  # noqa: E402
from pipescope.calibration.calibrate import CalibrationConfig, measuring_threads, pinned_threads  # noqa: E402
from pipescope.calibration.timing import (  # noqa: E402
    Bench,
    Stats,
    Timer,
    TimingConfig,
    best,
    is_noisy,
    needs_retry,
    spread,
)


def result(median: int, p90: int) -> Stats:
    return Stats(median_ns=median, p10_ns=median, p90_ns=p90, min_ns=median, reps=7)


STEADY, NOISY, NOISY_BUT_FASTER = result(100, 110), result(120, 600), result(90, 400)


class ScriptedAttempts(Timer):
    """A timer whose successive measurements are the scripted results."""

    def __init__(self, config: TimingConfig, script: list[Stats]) -> None:
        super().__init__(config)
        self.script = list(script)

    def measure_once(self, bench: Bench, started: float) -> Stats:
        return self.script.pop(0)


def test_only_a_noisy_best_attempt_is_measured_again_up_to_the_retries() -> None:
    """Retry while the best attempt so far is above max_spread and retries remain; keep the lowest median."""
    assert not is_noisy(STEADY, 1.5) and is_noisy(NOISY, 1.5) and not is_noisy(NOISY, 5.0)
    assert not needs_retry([STEADY], 1.5, 2)
    assert needs_retry([NOISY], 1.5, 2) and needs_retry([NOISY, NOISY], 1.5, 2)
    assert not needs_retry([NOISY, NOISY, NOISY], 1.5, 2)  # 2 retries made
    assert not needs_retry([NOISY], 1.5, 0)
    assert not needs_retry([NOISY, STEADY], 1.5, 2)  # the steady one has the lower median: done
    assert best([NOISY, STEADY]) == Stats(100, 100, 110, 100, 7, attempts=2)
    assert best([STEADY, NOISY_BUT_FASTER]).median_ns == 90  # noise only adds time: the lowest median is kept


def test_timer_remeasures_a_noisy_row_and_keeps_the_best() -> None:
    """A noisy first attempt is made again; a steady second one ends it; one that stays noisy stops at retries."""
    config = TimingConfig(max_spread=1.5, retries=2)
    settled = ScriptedAttempts(config, [NOISY, STEADY, NOISY]).measure(Bench(lambda _: None))
    assert settled == Stats(100, 100, 110, 100, 7, attempts=2)
    stuck = ScriptedAttempts(config, [NOISY, NOISY_BUT_FASTER, NOISY, STEADY]).measure(Bench(lambda _: None))
    assert stuck.median_ns == 90 and stuck.attempts == 3 and is_noisy(stuck, 1.5)
    quiet = ScriptedAttempts(config, [STEADY, NOISY]).measure(Bench(lambda _: None))
    assert quiet.attempts == 1


def row(component: str, op: str, median: int, p90: int, attempts: int = 1) -> ops.Row:
    return ops.timing_row(component, op, 2, 128, Stats(median, median, p90, median, 7, attempts), 10, 1)


def test_noisy_rows_lists_the_rows_above_max_spread_with_their_spread() -> None:
    rows = [row("layer", "F", 1000, 1400), row("layer", "I", 1000, 2500, 3), row("embedding", "W", 0, 0)]
    assert ops.noisy_rows(rows, 1.5) == [{"component": "layer", "op": "I", "microbatch_size": 2, "seq": 128,
                                           "shards": 1, "median_ns": 1000, "p90_ns": 2500, "attempts": 3,
                                           "spread": 2.5}]
    assert [r["op"] for r in ops.noisy_rows(rows, 1.2)] == ["F", "I"]
    assert ops.noisy_rows(rows, 3.0) == []


def test_threads_pin_to_one_on_cpu_by_default_and_are_left_alone_on_cuda() -> None:
    """None: 1 on CPU, torch's choice on CUDA; 0: torch's choice; N: N. The previous count comes back after."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert measuring_threads(None, cpu) == 1 and measuring_threads(None, cuda) is None
    assert measuring_threads(0, cpu) is None and measuring_threads(2, cuda) == 2
    before = torch.get_num_threads()
    with pinned_threads(1):
        assert torch.get_num_threads() == 1
    with pinned_threads(None):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def config_of(argv: list[str], out: Path) -> CalibrationConfig:
    args = commands.build_parser().parse_args(["calibrate", "--model", "tiny", "--device", "cpu", "--out", str(out),
                                               *argv])
    return commands.calibration_config(args, argv)


def test_spread_and_thread_flags_are_checked(tmp_path: Path) -> None:
    """--max-spread above 1, --retries from 0, --threads auto or 1..cpus; calibrate-comms never re-measures."""
    config = config_of(["--max-spread", "1.25", "--retries", "0", "--threads", "auto"], tmp_path)
    assert (config.timing.max_spread, config.timing.retries, config.threads) == (1.25, 0, 0)
    defaults = config_of([], tmp_path)
    assert (defaults.timing.max_spread, defaults.timing.retries, defaults.threads) == (2.0, 2, None)
    for flags, message in ((["--max-spread", "1"], "--max-spread: got 1.0, expected a number above 1"),
                           (["--max-spread", "nan"], "--max-spread: got 'nan'"),
                           (["--retries", "-1"], "--retries: got -1, expected an integer from 0"),
                           (["--threads", "0"], "--threads: got 0, expected an integer from 1 to .*, or auto")):
        with pytest.raises(UsageError, match=message):
            config_of(flags, tmp_path)
    comms = argparse.Namespace(warmup="1", min_reps="3", max_reps="5", rel_tol="0.02", budget_s="1")
    assert timing_config(comms, command="calibrate-comms").retries == 0


def test_calibration_under_load_pins_threads_and_reports_the_noisy_rows(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """`tiny` calibrated while another process spins on one of the cores, threads left at the default.

    With --max-spread 1.0001 any spread at all counts as noise, so (whatever the load does) practically every
    row is measured again, and the profile's noisy_rows are exactly the table's rows still above it, each with
    2 attempts (--retries 1); the warning counts them on stderr. These hold for any timings, so the test cannot
    flake on a busy machine. Threads are pinned to 1, recorded, and restored after.
    """
    argv = ["calibrate", "--model", "tiny", "--microbatch-sizes", "1", "--device", "cpu", "--vocab-shards", "1",
            "--warmup", "1", "--min-reps", "3", "--budget-s", "0.02", "--max-spread", "1.0001", "--retries", "1",
            "--out", str(tmp_path)]
    before = torch.get_num_threads()
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a process, not a fork of this one
    try:
        assert commands.main(argv) == 0
    finally:
        burner.kill()
        burner.wait()
    assert torch.get_num_threads() == before
    meta = json.loads((tmp_path / "profile.json").read_text())
    assert meta["timing"]["threads"] == 1 and meta["timing"]["threads_pinned"] is True
    assert (meta["timing"]["max_spread"], meta["timing"]["retries"]) == (1.0001, 1)
    path = tmp_path / meta["tables"]["timings"]
    rows = (pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)).to_dict("records")
    still_noisy = [r for r in rows if spread(r["median_ns"], r["p90_ns"]) > 1.0001]
    key = ("component", "op", "microbatch_size", "seq", "shards")
    assert [tuple(r[k] for k in key) for r in meta["noisy_rows"]] == [tuple(r[k] for k in key) for r in still_noisy]
    assert still_noisy and all(r["attempts"] == 2 for r in still_noisy)
    assert meta["timing"]["remeasured_rows"] == sum(r["attempts"] == 2 for r in rows)
    warning = [line for line in capsys.readouterr().err.splitlines() if "stayed noisy" in line]
    assert len(warning) == 1 and f"{len(still_noisy)} of {len(rows)} timing rows" in warning[0]


def test_a_profile_with_noisy_rows_warns_in_the_result(tmp_path):
    """ProfiledCosts turns profile.json's noisy_rows into one note (their count only; a hostile list is ignored)."""
    import json

    from pipescope.simulator.profiled import _noisy_note
    assert _noisy_note({"noisy_rows": [{"op": "F"}, {"op": "I"}], "timing": {"max_spread": 2.0}}) == [
        "costs.profile: 2 timing rows stayed noisy when calibrated (p90/median above 2.0, listed under noisy_rows in "
        "profile.json); their times may be too high: re-calibrate on a quiet machine"]
    assert _noisy_note({"noisy_rows": "lots"}) == [] and _noisy_note({}) == []
    assert json.dumps(_noisy_note({"noisy_rows": [1], "timing": "x"}))
