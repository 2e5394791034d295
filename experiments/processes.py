"""Commands that start processes of their own (calibrate, torchrun), run so that stopping one stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

STOP_GRACE_S = 15  # how long a stopped command may take to stop its own children


def run_in_group(command: list[str], timeout_s: float, **popen: Any) -> subprocess.CompletedProcess | None:
    """Run ``command`` in a process group of its own (``popen``: ``subprocess.Popen``'s arguments); None when it
    was still running after ``timeout_s`` and was stopped, with everything it started. Its own group keeps a
    terminal's Ctrl-C from it, so an interrupt here stops it too."""
    with subprocess.Popen(command, start_new_session=True, **popen) as process:
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(process)
            return None
        except BaseException:  # KeyboardInterrupt: the group would run on, and Popen's exit wait for it
            stop_group(process)
            raise
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group first, so that torchrun (which starts its workers in sessions of their own)
    stops them, then SIGKILL for whatever is left."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
