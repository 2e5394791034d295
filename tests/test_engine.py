"""The engine over FIFO links: transfer times from the path, queueing on a busy link, overlapping latency, pure
delays under uniform costs (deadlocks: tests/test_check.py)."""

from pipescope.simulator.costs import AnalyticCosts, UniformCosts
from pipescope.simulator.models import preset
from pipescope.simulator.network import FifoLinks, Link
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate
from pipescope.topologies.devices import DEVICES


def test_link_bandwidth_and_latency_set_transfer_time() -> None:
    """Analytic transfers take latency + bytes / bandwidth of the path the cluster gives."""
    costs = AnalyticCosts(preset("gpt-355m"), DEVICES["a100"].peak_flops["bf16"])
    slow = simulate(build("1f1b", 2, 2), costs, FifoLinks.over(lambda a, b: Link(1e9, 10_000)))
    fast = simulate(build("1f1b", 2, 2), costs, FifoLinks.over(lambda a, b: Link(1e12, 10_000)))
    nbytes = costs.stage_cost(0, 2, 1).boundary_bytes
    frame = slow.timeline[slow.timeline["stream"].str.startswith("send")]
    assert set(frame["end_ns"] - frame["start_ns"]) == {10_000 + nbytes}  # 1 GB/s: one ns per byte
    assert slow.iteration_ns > fast.iteration_ns


def test_transfers_queue_on_a_busy_link() -> None:
    """Two activations produced 1 s apart on a link that needs 3 s each: the second waits for the first."""
    costs = UniformCosts(forward=1.0, backward_input=0.5, backward_weight=0.5)
    serial = FifoLinks(lambda src, dst, nbytes: (3 * 10**9, 3 * 10**9))  # each transfer holds its link throughout
    result = simulate(build("gpipe", 2, 2), costs, serial)
    sends = result.timeline[(result.timeline["stream"] == "send->1")].sort_values("start_ns")
    assert list(sends["start_ns"]) == [1 * 10**9, 4 * 10**9]  # not 2 s: the link was still busy
    assert list(sends["end_ns"]) == [4 * 10**9, 7 * 10**9]


def test_latency_overlaps_on_a_link() -> None:
    """Analytic transfers hold the link for bytes/bandwidth only; latency of one overlaps the next."""
    costs = AnalyticCosts(preset("gpt-355m"), DEVICES["a100"].peak_flops["bf16"])
    link = Link(1e15, 10**9)  # a huge latency, negligible serialisation
    result = simulate(build("gpipe", 2, 3), costs, FifoLinks.over(lambda a, b: link))
    sends = result.timeline[(result.timeline["stream"] == "send->1")].sort_values("start_ns")
    produced = result.timeline[(result.timeline["action"].isin(["0F0", "0F1", "0F2"]))].sort_values("end_ns")
    assert list(sends["start_ns"]) == list(produced["end_ns"])  # no transfer waited for the one before


def test_uniform_p2p_longer_than_ops_is_a_pure_delay() -> None:
    """A fixed p2p delay (2 s, twice an op) adds to each hop without queueing: GPipe's closed form holds."""
    schedule = build("gpipe", 4, 8)
    result = simulate(schedule, UniformCosts(forward=1.0, backward_input=0.5, backward_weight=0.5),
                      FifoLinks.fixed_delay(2 * 10**9))
    assert result.iteration_ns == (11 * 2 + 2 * 3 * 2) * 10**9


def test_progress_is_reported_as_the_replay_goes_and_changes_nothing(monkeypatch) -> None:
    """Every PROGRESS_EVERY events the callback hears (entries ended, entries), last with all of them; the result
    is the same as without it."""
    from pipescope.simulator import engine

    monkeypatch.setattr(engine, "PROGRESS_EVERY", 25)
    costs = UniformCosts(forward=1.0, backward_input=1.0, backward_weight=1.0)
    calls: list[tuple[int, int]] = []
    watched = simulate(build("zb-h1", 4, 8), costs, progress=lambda done, total: calls.append((done, total)))
    plain = simulate(build("zb-h1", 4, 8), costs)
    assert calls[-1] == (4 * 8 * 3, 4 * 8 * 3)  # F, B and W of 8 microbatches on 4 devices
    assert len(calls) > 3 and [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert 0 < calls[0][0] < calls[-1][0]
    assert watched.timeline.equals(plain.timeline)


def test_the_cli_progress_bar_draws_on_its_file_and_stays_away_from_a_pipe(capsys) -> None:
    import io

    from pipescope.experiments.cli import progress_bar

    out = io.StringIO()
    with progress_bar("simulate", "op", delay_s=0, min_interval_s=0, file=out) as report:
        report(30, 120)
        report(120, 120)
    assert "simulate" in out.getvalue() and "120/120" in out.getvalue()
    with progress_bar("simulate", "op") as report:  # stderr is captured here, not a terminal
        assert report is None
