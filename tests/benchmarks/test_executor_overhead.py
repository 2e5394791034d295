"""The real executor's own time per action, and the clipping norm's (opt-in: pytest -m benchmark -s
tests/benchmarks/test_executor_overhead.py; docs/validation.md "The host's share, measured before").

One rank (p = 1) has no transfers, so the gap between one op's end and the next op's start is the executor's Python
work per action. The gap before the optimizer step holds the clipping norm (and, in the last run, the copy of the
gradients the tests compare)."""

from __future__ import annotations

import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from pipescope.executor.run import RunSpec, execute  # noqa: E402
from pipescope.executor.state import build_modules  # noqa: E402
from pipescope.executor.weights import squared_norm  # noqa: E402
from pipescope.calibration.presets import resolve  # noqa: E402
from pipescope.simulator.schedules import build  # noqa: E402


def _median_ms(fn, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@pytest.mark.benchmark
@pytest.mark.parametrize("hidden", [64, 512])
def test_per_action_gap_is_tens_of_microseconds(hidden: int) -> None:
    torch.set_num_threads(1)
    shape = resolve("tiny", hidden=hidden)
    run = execute(RunSpec(build("1f1b", 1, 8), shape, microbatch_size=1, iterations=5, warmup=1))
    gaps, to_step = [], []
    for ranks in run.rows:
        rows = sorted(ranks[0], key=lambda r: r[4])
        pairs = list(zip(rows, rows[1:]))
        gaps += [b[4] - a[5] for a, b in pairs if b[1] != "OPT"]
        to_step += [b[4] - a[5] for a, b in pairs if b[1] == "OPT"]
    gap_us, step_ms = statistics.median(gaps) / 1e3, statistics.median(to_step) / 1e6
    print(f"\nhidden {hidden}: gap between ops median {gap_us:.1f} us over {len(gaps)}; last backward to the step "
          f"median {step_ms:.3f} ms")
    assert gap_us < 1000  # far below one op


@pytest.mark.benchmark
@pytest.mark.parametrize("hidden", [64, 512])
def test_the_clipping_norm_in_float32_is_far_cheaper_than_a_float64_copy_and_than_the_step(hidden: int) -> None:
    torch.set_num_threads(1)
    modules = build_modules(resolve("tiny", hidden=hidden), 0)
    params = [p for m in modules.values() for p in m.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    wide = _median_ms(lambda: float(torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2))
    used = _median_ms(lambda: squared_norm([grad]))
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    step = _median_ms(optimizer.step, repeat=7)
    print(f"\n{grad.numel():,} parameters: float64 squared norm {wide:.2f} ms, squared_norm (float32) {used:.2f} ms, "
          f"AdamW step {step:.2f} ms")
    assert used < wide and used < step
