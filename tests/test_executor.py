"""The real executor: the lowered program run over torch.distributed (gloo, 2 ranks, one thread each). Launches
cost 3-5 s, so each test runs several schedules in one launch (``execute_all``)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from pipescope.calibration.executor import RunError, RunSpec, execute_all, reference_step  # noqa: E402
from pipescope.calibration.presets import Shape  # noqa: E402
from pipescope.simulator.ir import ActionKind  # noqa: E402
from pipescope.simulator.schedules import build  # noqa: E402

SHAPE = Shape("test", layers=4, hidden=32, heads=2, seq=16, vocab=64)
FLUSH = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("v-half", 2))


def test_flush_schedules_give_the_loss_and_gradients_of_one_process():
    specs = [RunSpec(build(name, 2, 4, chunks=chunks), SHAPE, microbatch_size=2, seed=3) for name, chunks in FLUSH]
    specs.append(RunSpec(build("1f1b", 2, 4), SHAPE, microbatch_size=2, layers_per_stage=(1, 3), seed=3))
    results = execute_all(specs)
    for spec, result in zip(specs, results):
        loss, grads = reference_step(spec)
        assert result.loss == pytest.approx(loss, rel=1e-6), spec.schedule.name
        assert set(result.grads) == set(grads), spec.schedule.name
        for name, grad in grads.items():
            torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-6, msg=spec.schedule.name)
        rows = result.rows[0]
        assert len(rows) == 2
        for device, device_rows in enumerate(rows):
            program = [a for a in spec.schedule.device_actions[device] if a is not None]
            ran = [r for r in device_rows if r[1] in {k.value for k in (ActionKind.F, ActionKind.I, ActionKind.W,
                                                                          ActionKind.B)}]
            assert [r[0] for r in ran] == [str(a) for a in program]  # the compute order is the schedule's
            assert all(r[4] <= r[5] for r in device_rows)


@pytest.mark.parametrize("fault, expected", [
    (("exit", 1, 3), r"^rank 1 died \(exit code 7\) at step 3, "),
    (("hang", 0, 2), r"^hung: no rank made progress for 3 s: rank 0 at step 2, .*; rank 1 at step "),
])
def test_a_dead_or_hung_rank_ends_the_run_with_one_line_and_no_process_left(fault, expected):
    before = set(_children())
    spec = RunSpec(build("1f1b", 2, 4), SHAPE, microbatch_size=2, timeout_s=3, inject=fault)
    with pytest.raises(RunError, match=expected) as caught:
        execute_all([spec])
    assert "\n" not in str(caught.value)
    assert set(_children()) <= before  # every rank was killed and reaped


def _children() -> list[int]:
    """PIDs whose parent is this process (from /proc: the ranks it spawned), but multiprocessing's resource
    tracker, which the first spawn starts and which lives as long as this process."""
    mine, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if (int(stat.read().rsplit(")", 1)[1].split()[1]) == mine
                            and b"resource_tracker" not in cmdline.read()):
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_validate_end_to_end_reports_finite_errors_and_an_overlay_gantt(tmp_path, capsys):
    """Calibrate tiny on this CPU, simulate 1F1B p=2 m=4 on the profile, run it for real, compare (a generous
    threshold: the point is the harness; docs/validation.md has the measured errors)."""
    import json
    import math

    from pipescope.experiments.cli import main
    gantt = tmp_path / "overlay.png"
    code = main(["validate", "--schedule", "1f1b", "--iterations", "2", "--json", "--gantt", str(gantt),
                 "--max-error", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    for key in ("predicted_iteration_time_s", "measured_iteration_time_s", "iteration_time_error",
                "op_duration_error_median", "op_start_error_median", "memory_error", "per_device"):
        assert key in report
    assert report["measured_iteration_time_s"] > 0 and math.isfinite(report["iteration_time_error"])
    assert abs(report["iteration_time_error"]) < 100 and len(report["per_device"]) == 2
    phases = [line.split(":")[1].strip().split()[0] for line in err.splitlines()]
    assert phases == ["calibrate", "calibrate-comms", "simulate", "run"]
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code = main(["validate", "--device", "cuda"])
    assert code == 2 and "--device: got 'cuda'" in capsys.readouterr().err
