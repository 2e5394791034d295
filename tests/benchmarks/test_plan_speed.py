"""`pipescope plan` on 64 GPUs (opt-in: pytest -m benchmark tests/benchmarks)."""

import time

import pytest

from pipescope.experiments.plan import plan
from pipescope.experiments.plan_space import PlanRequest, base_config

BASE = base_config("gpt-2.2b", "p3.16xlarge", 8, None)
SPACES = {
    # The 2BW planner's space: 2BW, PipeDream-Flush, GPipe; recompute or not; no tensor parallelism.
    "2bw-space": PlanRequest(BASE, 512, schedules=("2bw", "1f1b", "gpipe"), recompute=("none", "full"), tensor=(1,),
                             vocab=("naive",), top=5),
    # Every axis at its default (9,306 candidates).
    "default-space": PlanRequest(BASE, 512, top=5),
}


# Seconds on 2 workers. The default space simulated 58 candidates in 69.5 s before issue 27's cost model; its bounds
# sit further above that model's simulations, so it simulates 286 in 392.3 s (docs/planner.md, "Speed": the budget
# was 90 s, and a tighter all-reduce bound is what would win it back).
BUDGET_S = {"2bw-space": 60.0, "default-space": 480.0}


@pytest.mark.benchmark
@pytest.mark.parametrize("space", SPACES)
def test_plan_64_gpus_in_its_budget(space: str) -> None:
    """GPT 2.2B on 8 p3.16xlarge (64 V100-16GB), global batch 512: the whole search on 2 workers within its budget
    (docs/planner.md, "Speed", has the measured times)."""
    started = time.perf_counter()
    report = plan(SPACES[space], workers=2, progress=False)
    wall = time.perf_counter() - started
    assert report.gpus == 64 and report.best is not None
    assert wall <= BUDGET_S[space], f"{wall:.1f} s"
