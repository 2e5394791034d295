"""`pipescope plan` on 64 GPUs (opt-in: pytest -m benchmark tests/benchmarks)."""

import time

import pytest

from pipescope.experiments.plan import PlanRequest, base_config, plan


@pytest.mark.benchmark
def test_plan_64_gpus_under_a_minute() -> None:
    """GPT 2.2B on 8 p3.16xlarge (64 V100-16GB), global batch 512, every default schedule, microbatch 1-32,
    recompute or not: the whole search on 2 workers in at most 60 s (measured 38 s on this 2-core machine)."""
    started = time.perf_counter()
    report = plan(PlanRequest(base_config("gpt-2.2b", "p3.16xlarge", 8, None), 512), workers=2, progress=False)
    wall = time.perf_counter() - started
    assert report.gpus == 64 and report.best is not None
    assert wall <= 60.0, f"{wall:.1f} s"
