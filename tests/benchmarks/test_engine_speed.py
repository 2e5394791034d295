"""Engine speed against the heapq floor (opt-in: pytest -m benchmark tests/benchmarks)."""

import pytest

from pipescope.experiments.bench import bench_case


@pytest.mark.benchmark
def test_p64_m512_within_targets() -> None:
    """1F1B p=64, m=512 (65,536 ops plus transfers): the whole simulate() call <= 1.2 s (measured 0.79-1.07 s on a
    noisy 2-core machine) and the engine run <= 4x the heapq floor (medians)."""
    row = bench_case(64, 512, repeat=3)
    assert row["simulate_s"] <= 1.2
    assert row["ratio_engine_to_floor"] <= 4.0
