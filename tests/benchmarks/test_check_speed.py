"""`pipescope check` speed at many devices (opt-in: pytest -m benchmark tests/benchmarks)."""

import statistics
import time

import pytest

from pipescope.experiments.cli import main
from pipescope.simulator.readers.csvio import write_csv
from pipescope.simulator.schedules import build


def _check_s(path: str, repeat: int = 3) -> float:
    """Median wall time of ``pipescope check FILE`` in this process (exit 0 expected)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        assert main(["check", path]) == 0
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.benchmark
def test_check_is_near_linear_in_devices(tmp_path, capsys) -> None:
    """1F1B, m = 4: p = 2,000 takes <= 3 s (measured 0.3 s on a noisy 2-core machine; 34 s before, quadratic
    in p) and doubling p to 4,000 at most triples the time."""
    paths = {}
    for p in (2000, 4000):
        paths[p] = str(tmp_path / f"1f1b_p{p}.csv")
        write_csv(build("1f1b", p, 4), paths[p])
    small, large = _check_s(paths[2000]), _check_s(paths[4000])
    capsys.readouterr()
    assert small <= 3.0
    assert large / small <= 3.0
