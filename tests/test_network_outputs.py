"""Chrome trace and Gantt chart of runs with a routed network and data parallelism: link lanes, all-reduce spans,
and the replica-0 view of big runs."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import matplotlib.pyplot as plt
import pytest

from pipescope import load_config, run
from pipescope.experiments.plots import gantt_figure, write_gantt
from pipescope.simulator.result import SimResult
from pipescope.simulator.trace import chrome_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dp_result() -> SimResult:
    """Two 8-stage 1F1B replicas on two nodes: gradient all-reduce buckets and cross-node links."""
    return run(load_config(None, ["cluster.nodes=2", "cluster.data_parallel=2", "schedule.stages=8"]))


@pytest.fixture(scope="module")
def dp_trace(dp_result: SimResult) -> list[dict]:
    return chrome_trace(dp_result)["traceEvents"]


def test_trace_network_process(dp_result: SimResult, dp_trace: list[dict]) -> None:
    """A process per device of every replica, then `network` with a lane per busiest link, named `a>b`, whose busy
    events add up to the spans in `link_spans`."""
    assert dp_result.records.num_devices == 16 and dp_result.link_spans
    processes = {e["pid"]: e["args"]["name"] for e in dp_trace if e["name"] == "process_name"}
    assert processes == {**{d: f"device {d}" for d in range(16)}, 16: "network"}
    threads = {e["tid"]: e["args"]["name"] for e in dp_trace if e["name"] == "thread_name" and e["pid"] == 16}
    assert list(threads.values()) == list(dp_result.link_spans)
    busy = [e for e in dp_trace if e["pid"] == 16 and e["ph"] == "X"]
    assert {e["name"] for e in busy} == {"busy"}
    for tid, link in threads.items():
        spans = dp_result.link_spans[link]
        mine = [e for e in busy if e["tid"] == tid]
        assert len(mine) == len(spans)
        assert sum(e["dur"] for e in mine) == pytest.approx(sum(end - start for start, end in spans) / 1e3)


def test_trace_collectives_per_device(dp_result: SimResult, dp_trace: list[dict]) -> None:
    """Every collective row is an `all-reduce stage S bucket B` event (or, for clipping's 8-byte norm over a replica's
    pipeline, `all-reduce gradient norm`) with its bytes, on its device's collective
    lanes; overlapping buckets take separate lanes, so no two events on one thread partly overlap."""
    frame = dp_result.timeline
    rows = frame[frame["stream"] == "collective"]
    events = [e for e in dp_trace if e["ph"] == "X" and e.get("cat") == "all-reduce"]
    assert Counter(e["pid"] for e in events) == Counter(rows["device"].tolist())
    assert set(rows["device"]) == set(range(16))
    assert all(re.fullmatch(r"all-reduce (stage \d+ bucket \d+|gradient norm)", e["name"]) for e in events)
    assert {e["args"]["bytes"] for e in events if e["name"] == "all-reduce gradient norm"} == {8}
    assert sorted(e["args"]["bytes"] for e in events) == sorted(rows["bytes"].tolist())
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in dp_trace if e["name"] == "thread_name"}
    assert all(lanes[(e["pid"], e["tid"])].startswith("collective") for e in events)
    assert (0, "collective") in {(pid, name) for (pid, _), name in lanes.items()}
    spans = defaultdict(list)
    for e in events:
        spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane in spans.values():
        lane.sort()
        assert all(later[0] >= earlier[1] for earlier, later in zip(lane, lane[1:]))


def test_trace_without_links_has_no_network() -> None:
    """The plain timing model has no link spans: devices only, no `network` process, no collectives."""
    result = run(load_config(None, ["costs.kind=uniform"]))
    events = chrome_trace(result)["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == [f"device {d}" for d in range(result.records.num_devices)]
    assert not any(e.get("cat") in ("link", "all-reduce") for e in events)


def test_gantt_links_and_allreduce(dp_result: SimResult, tmp_path) -> None:
    """With links: a second axes, a row per busiest link, and a legend entry for the all-reduce bars; the PNG
    writes."""
    fig = gantt_figure(dp_result)
    try:
        devices, links = fig.axes
        assert [t.get_text() for t in devices.get_yticklabels()] == [f"device {d}" for d in range(16)]
        assert [t.get_text() for t in links.get_yticklabels()] == list(dp_result.link_spans)
        assert "gradient all-reduce" in [t.get_text() for t in devices.get_legend().get_texts()]
    finally:
        plt.close(fig)
    path = tmp_path / "g.png"
    write_gantt(dp_result, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_gantt_without_links_one_axes() -> None:
    """The plain timing model keeps the single-axes chart with no all-reduce legend entry."""
    fig = gantt_figure(run(load_config(None, ["costs.kind=uniform"])))
    try:
        assert len(fig.axes) == 1
        assert "gradient all-reduce" not in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_gantt_64_devices_draws_replica0() -> None:
    """Eight replicas of eight stages (64 devices): only replica 0's rows, and the title says so."""
    result = run(load_config(None, ["cluster.nodes=8", "cluster.data_parallel=8", "schedule.stages=8",
                                    "schedule.microbatches=4"]))
    assert result.records.num_devices == 64
    fig = gantt_figure(result)
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"device {d}" for d in range(8)]
        assert "replica 0 of 8" in ax.get_title()
    finally:
        plt.close(fig)
