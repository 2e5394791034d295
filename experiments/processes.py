"""Commands that start processes of their own (calibrate, torchrun, a pool's workers), run so that stopping one
stops them all.

A command runs in a session of its own, so that its whole process group can be signalled (torchrun, in turn, starts
each worker in a session of its own and stops them when it gets SIGTERM). Stops nest: gpu_session stops a validate
step, which stops the calibration it started. The inner stop is given less time than the outer one waits, so that
it finishes before the outer one gives up and kills.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

STOP_GRACE_S = 15  # how long a command past its timeout may take to stop its own children
INTERRUPTED_GRACE_S = 5  # the same when this process itself is being stopped: its stopper waits STOP_GRACE_S


def sigterm_as_ctrl_c() -> contextlib.AbstractContextManager:
    """Meanwhile SIGTERM (`kill PID`) stops this process as Ctrl-C does, so a sweep or a plan shuts its pool down
    (the sweep logging its running chunks first). By default the process would die at once and leave the pool's
    workers running, parented to init."""
    return _handling(_raise_keyboard_interrupt, signal.SIGTERM)


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A Ctrl-C or SIGTERM meanwhile acts when the block ends, not inside it: for work that must not be cut in two.
    A process pool that starts a worker is one: a stop between the forkserver's fork and the pool's noting the
    worker's pid leaves a worker no shutdown knows of, waiting for work forever and holding this process's stderr.
    Elsewhere than in the main thread this does nothing (only the main thread may set a handler)."""
    stops: list[int] = []
    try:
        with _handling(lambda signum, _frame: stops.append(signum), signal.SIGINT, signal.SIGTERM):
            yield
    finally:
        for sig in dict.fromkeys(stops):  # each kind once, in the order they came, to the handlers just restored
            signal.raise_signal(sig)


def _raise_keyboard_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_in_group(command: list[str], timeout_s: float, **popen: Any) -> subprocess.CompletedProcess | None:
    """Run ``command`` in a process group of its own (``popen``: ``subprocess.Popen``'s arguments); None when it
    was still running after ``timeout_s`` and was stopped, with everything it started. A Ctrl-C or a SIGTERM here
    (its own group keeps a terminal's Ctrl-C from it) stops it too, then goes on as SystemExit or KeyboardInterrupt."""
    # a stop of this process reaches the group it started in a session of its own
    with _handling(_exit, signal.SIGTERM):
        process = subprocess.Popen(command, start_new_session=True, **popen)
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(process, STOP_GRACE_S)
            return None
        except BaseException:
            stop_group(process, INTERRUPTED_GRACE_S)
            raise
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group first, so that torchrun stops the workers it started, then SIGKILL for whatever
    is left after ``grace_s``. Waits for the process, not for its pipes: a worker in a session of its own may still
    hold them open."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def _handling(handler: Any, *signals: int) -> Iterator[None]:
    """``handler`` takes ``signals`` meanwhile, then the previous handlers again; only the main thread may set a
    handler, so elsewhere (a caller's thread) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
