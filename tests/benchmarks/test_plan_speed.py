"""`pipescope plan` on 64 GPUs (opt-in: pytest -m benchmark tests/benchmarks)."""

import time

import pytest

from pipescope.experiments.plan import plan
from pipescope.experiments.plan_space import PlanRequest, base_config


@pytest.mark.benchmark
def test_plan_64_gpus_2bw_space_under_a_minute() -> None:
    """GPT 2.2B on 8 p3.16xlarge (64 V100-16GB), global batch 512, the 2BW planner's space (2BW, PipeDream-Flush,
    GPipe; every width x depth; microbatch 1-32; recompute or not; no tensor parallelism): at most 60 s on 2
    workers (docs/planner.md, "Speed", has the measured times of this and of the default space)."""
    started = time.perf_counter()
    request = PlanRequest(base_config("gpt-2.2b", "p3.16xlarge", 8, None), 512, schedules=("2bw", "1f1b", "gpipe"),
                          recompute=("none", "full"), tensor=(1,), vocab=("naive",))
    report = plan(request, workers=2, progress=False)
    wall = time.perf_counter() - started
    assert report.gpus == 64 and report.best is not None
    assert wall <= 60.0, f"{wall:.1f} s"
