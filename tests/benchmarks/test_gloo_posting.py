"""How long posting a gloo ``irecv`` takes while both ranks compute, against while they sleep (opt-in: pytest -m
benchmark -s tests/benchmarks/test_gloo_posting.py; docs/validation.md, "What `stages` still misses").

GPipe's exchange on two ranks: rank 0 computes and sends 64 KiB four times, rank 1 receives and computes; then the
other way. With busy loops as compute on a 2-core machine, a post sometimes waits milliseconds for gloo's I/O thread
to get a core; with sleeps, the cores are free and it does not."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipescope.executor.run import launch  # noqa: E402

ITERATIONS = 15


def _exchange(rank: int, busy: bool, out: str, progress) -> None:
    import torch.distributed as dist
    a, x = torch.randn(512, 512), torch.randn(1, 32, 512)

    def compute(ms: float) -> None:
        if not busy:
            time.sleep(ms / 1e3)
            return
        start = time.perf_counter()
        while time.perf_counter() - start < ms / 1e3:
            a @ a

    posts = []
    for it in range(ITERATIONS):
        progress[2 * rank + 1] = it
        sends = []
        for phase, (sender, ms) in enumerate(((0, 7.0), (1, 14.0))):
            for mb in range(4):
                tag = 100 * it + 10 * phase + mb
                if rank == sender:
                    compute(ms)
                    sends.append(dist.isend(x.clone(), 1 - rank, tag=tag))
                else:
                    start = time.perf_counter_ns()
                    work = dist.irecv(torch.empty(1, 32, 512), 1 - rank, tag=tag)
                    posts.append(time.perf_counter_ns() - start)
                    work.wait()
                    compute(ms)
        for work in sends:
            work.wait()
        dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps(posts))


def _posts_us(busy: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        launch(2, "gloo", _exchange, busy, Path(out), lambda r, part, step: f"iteration {step}", lambda _: 60.0)
        return [ns / 1e3 for r in range(2) for ns in json.loads(Path(out, f"{r}.json").read_text())]


@pytest.mark.benchmark
def test_posting_a_receive_is_fast_when_the_cores_are_free() -> None:
    for busy in (True, False):
        posts = sorted(_posts_us(busy))
        assert len(posts) == 2 * 4 * ITERATIONS
        p90 = posts[int(0.9 * len(posts))]
        print(f"{'busy' if busy else 'sleeping'} ranks: irecv post mean {statistics.mean(posts):.0f} us, "
              f"median {statistics.median(posts):.0f} us, p90 {p90:.0f} us, max {posts[-1]:.0f} us")
    assert p90 < 1000  # sleeping ranks: the I/O thread has a core
