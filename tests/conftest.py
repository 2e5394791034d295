"""Fixtures shared by the test files: the CLI run in-process, and torch's schedules module."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from pipescope.experiments.cli import main


@pytest.fixture
def cli(capsys: pytest.CaptureFixture) -> Callable[[list[str]], tuple[int, str, str]]:
    """Run ``pipescope ARGS`` in this process: (exit code, stdout, stderr)."""
    def run(args: list[str]) -> tuple[int, str, str]:
        code = main(args)
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.fixture(scope="session")
def torch_sched() -> ModuleType:
    """torch's schedules module; tests that use it skip when torch is not installed."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")
