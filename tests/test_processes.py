"""Commands that start processes of their own (experiments/processes.py): a timeout, or a stop of the caller, stops
them with everything they started, and validate says so in one line."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipescope.experiments.processes import run_in_group

# A command that starts a child of its own, writes the child's pid, and waits
PARENT = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(60)']); open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(60)")


def _gone(pid_file: Path) -> bool:
    for _ in range(50):  # a killed process is reaped by its parent or by init shortly after
        pid = int(pid_file.read_text())
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_a_command_past_its_timeout_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    started = time.monotonic()
    assert run_in_group([sys.executable, "-c", PARENT, str(pid_file)], 2) is None
    assert time.monotonic() - started < 10 and _gone(pid_file)
    done = run_in_group([sys.executable, "-c", "print('ok')"], 30, stdout=subprocess.PIPE, text=True)
    assert (done.returncode, done.stdout) == (0, "ok\n")


def test_a_stopped_caller_stops_the_command_it_runs(tmp_path: Path) -> None:
    """SIGTERM to the caller (as gpu_session stops a validate step) reaches the command in its own session: it is
    stopped, and the caller exits 143."""
    pid_file = tmp_path / "child"
    caller = ("import sys; from pipescope.experiments.processes import run_in_group; "
              f"run_in_group([sys.executable, '-c', {PARENT!r}, {str(pid_file)!r}], 60)")
    process = subprocess.Popen([sys.executable, "-c", caller], cwd=Path(__file__).parent.parent)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM and _gone(pid_file)


def test_validate_names_a_calibration_that_ran_past_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipescope.experiments import validate_cmd
    monkeypatch.setattr(validate_cmd, "CALIBRATION_TIMEOUT_S", 1)
    with pytest.raises(RuntimeError, match=r"^calibrate failed: still running after 1 s, stopped$"):
        validate_cmd._run_step("calibrate", [sys.executable, "-c", "import time; time.sleep(30)"])


def test_a_stop_inside_a_deferred_block_acts_when_the_block_ends() -> None:
    """A pool's start is not cut in two by a stop (a worker left unknown to the pool's shutdown held the caller's
    stderr open forever): SIGTERM and Ctrl-C inside the block raise only once it has ended, each kind once."""
    import os

    from pipescope.experiments.processes import sigterm_as_ctrl_c, stops_deferred
    finished = False
    with pytest.raises(KeyboardInterrupt), sigterm_as_ctrl_c():
        with stops_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # a signal's handler runs at the next bytecode: here it must only note it
            finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back
