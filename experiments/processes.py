"""Commands that start processes of their own (calibrate, torchrun), run so that stopping one stops them all."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

STOP_GRACE_S = 15  # how long a stopped command may take to stop its own children


def run_in_group(command: list[str], timeout_s: float, **popen: Any) -> subprocess.CompletedProcess | None:
    """Run ``command`` in a process group of its own (``popen``: ``subprocess.Popen``'s arguments); None when it
    was still running after ``timeout_s`` and was stopped, with everything it started. Its own group keeps a
    terminal's Ctrl-C from it, so an interrupt here stops it too."""
    with subprocess.Popen(command, start_new_session=True, **popen) as process, _terminate_raises():
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(process)
            return None
        except BaseException:  # Ctrl-C or a stop: the group would run on, and Popen's exit wait for it
            stop_group(process)
            raise
        return subprocess.CompletedProcess(command, process.returncode, out, err)


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM raises SystemExit meanwhile, so that a stop of this process (``stop_group`` of a group it is in)
    reaches the group it started in a session of its own; only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group first, so that torchrun (which starts its workers in sessions of their own)
    stops them, then SIGKILL for whatever is left."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
