"""Folding identical replicas (simulator/fold.py, docs/network.md "Folding identical replicas"): a folded run's result
is the unfolded run's, to the nanosecond and the byte, and a run that cannot be folded says why."""

from __future__ import annotations

import pytest

import pipescope

GPT = ["model.preset=gpt-1.3b", "cluster.topology=dgx-h100"]

# (what the case exercises, its sets): 64 to 512 GPUs, schedules, degrees, algorithms, ZeRO, oversubscription
CASES = [
    ("1f1b, ring, 64 GPUs", ["parallel.tensor=8", "schedule.name=1f1b", "schedule.stages=2",
                            "schedule.microbatches=4", "cluster.nodes=8", "cluster.data_parallel=4"]),
    ("interleaved, 512 GPUs", ["parallel.tensor=8", "schedule.name=interleaved", "schedule.stages=4",
                               "schedule.microbatches=8", "cluster.nodes=64", "cluster.data_parallel=16"]),
    ("1f1b, a tree over 16 replicas", ["parallel.tensor=8", "schedule.name=1f1b", "schedule.stages=4",
                                       "schedule.microbatches=8", "cluster.nodes=64", "cluster.data_parallel=16",
                                       "cluster.collective=tree"]),
    ("interleaved, a tree over 13", ["parallel.tensor=8", "schedule.name=interleaved", "schedule.stages=2",
                                     "schedule.microbatches=8", "cluster.nodes=26", "cluster.data_parallel=13",
                                     "cluster.collective=tree"]),
    ("zb-h1, all-reduce after the backward", ["parallel.tensor=8", "schedule.name=zb-h1", "schedule.stages=4",
                                               "schedule.microbatches=8", "cluster.nodes=32",
                                               "cluster.data_parallel=8", "cluster.overlap_grad_sync=false"]),
    ("1f1b, ZeRO-1", ["parallel.tensor=8", "schedule.name=1f1b", "schedule.stages=4", "schedule.microbatches=8",
                      "cluster.nodes=32", "cluster.data_parallel=8", "parallel.zero=1"]),
    ("1f1b, ZeRO-3", ["parallel.tensor=8", "schedule.name=1f1b", "schedule.stages=4", "schedule.microbatches=8",
                      "cluster.nodes=32", "cluster.data_parallel=8", "parallel.zero=3"]),
    ("2bw, hierarchical", ["parallel.tensor=8", "schedule.name=2bw", "schedule.stages=2", "schedule.microbatches=4",
                           "cluster.nodes=16", "cluster.data_parallel=8", "cluster.collective=hierarchical"]),
    ("1f1b, oversubscribed 4:1", ["parallel.tensor=8", "schedule.name=1f1b", "schedule.stages=2",
                                  "schedule.microbatches=4", "cluster.nodes=16", "cluster.data_parallel=8",
                                  "cluster.oversubscription=4"]),
    ("gpipe, no tensor parallelism", ["schedule.name=gpipe", "schedule.stages=8", "schedule.microbatches=8",
                                      "model.layers=8", "cluster.nodes=8", "cluster.data_parallel=8"]),
]


def _both(sets: list[str]) -> tuple[pipescope.SimResult, pipescope.SimResult]:
    return tuple(pipescope.run(pipescope.load_config(None, GPT + sets + [f"cluster.fold={fold}"]))
                 for fold in ("true", "false"))


def _comparable(result: pipescope.SimResult) -> dict:
    """Everything a run reports but what the replay itself counted (its wall time, flows, rate updates)."""
    summary = result.summary()
    summary.pop("sim_wall_s")
    network = {key: value for key, value in summary.pop("network").items()
               if key not in ("flows", "rate_updates", "folding")}
    records = result.records
    return {**summary, "network": network, "links": result.links, "link_spans": result.link_spans,
            "records": (records.device.tolist(), records.start.tolist(), records.end.tolist(),
                        records.peer.tolist(), records.nbytes.tolist(), [str(a) for a in records.actions],
                        sorted(map(tuple, records.stalls.tolist())))}


@pytest.mark.parametrize(("name", "sets"), CASES, ids=[name for name, _ in CASES])
def test_a_folded_run_is_the_whole_run(name: str, sets: list[str]) -> None:
    """Every number, every link's bytes and busy spans and every timeline row are the unfolded run's; the result
    says how many replicas ran."""
    folded, whole = _both(sets)
    replicas = folded.config.cluster.data_parallel
    assert folded.network["folding"]["replicas"] == replicas
    assert folded.network["folding"]["simulated"] < replicas, folded.network["folding"]
    assert whole.network["folding"] == {"replicas": replicas, "simulated": replicas,
                                        "why_not": "cluster.fold is false"}
    assert _comparable(folded) == _comparable(whole)
    assert folded.network["flows"] < whole.network["flows"]


def test_a_tree_runs_one_replica_of_each_kind() -> None:
    """A double binary tree crosses an interior rank's servers more often than a leaf's: its replicas fall into a
    few classes, one of each replayed; a ring makes them all alike."""
    tree, _ = _both(CASES[2][1])
    ring, _ = _both(CASES[2][1][:-1] + ["cluster.collective=ring"])
    assert 1 < tree.network["folding"]["simulated"] < 16
    assert ring.network["folding"] == {"replicas": 16, "simulated": 1}


@pytest.mark.parametrize(("sets", "why"), [
    (["cluster.fabric=fat-tree", "parallel.tensor=8", "schedule.stages=2", "schedule.microbatches=4",
      "cluster.nodes=8", "cluster.data_parallel=4"], "or the fabric are not the same"),
    (["parallel.tensor=4", "schedule.stages=4", "schedule.microbatches=8", "cluster.nodes=16",
      "cluster.data_parallel=8"], "equal-cost paths between n0.gpu4 and n1.gpu0"),
    (["parallel.tensor=8", "schedule.stages=2", "schedule.microbatches=4", "cluster.nodes=8",
      "cluster.data_parallel=4", "faults.stragglers=0:1.5"], "stragglers or jitter"),
    (["parallel.tensor=8", "schedule.stages=2", "schedule.microbatches=4", "cluster.nodes=8",
      "cluster.data_parallel=4", "faults.degraded_links=n5.nic0-leaf0:0.1"], "links' bandwidths"),
])
def test_what_breaks_the_symmetry_runs_every_replica_and_says_why(sets: list[str], why: str) -> None:
    """A fat-tree's leaves, ECMP between rails (each replica's flow hashed onto a path of its own), a straggler and
    a degraded link (folded, it was ignored: 43.0 ms where every replica gives 93.4) each make replicas differ:
    every one is replayed, the result naming why, and it equals cluster.fold=false's."""
    folded, whole = _both(sets)
    replicas = folded.config.cluster.data_parallel
    folding = folded.network["folding"]
    assert folding["simulated"] == replicas and why in folding["why_not"], folding
    assert _comparable(folded) == _comparable(whole)


def test_the_text_report_says_how_many_replicas_ran(cli) -> None:
    code, out, _ = cli(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                        "--set", "parallel.tensor=8", "--set", "cluster.nodes=64", "--set", "cluster.data_parallel=16",
                        "--set", "cluster.collective=tree"])
    assert code == 0
    assert '(4 of 16 replicas replayed, the others alike: docs/network.md, "Folding identical replicas")' in out
    code, out, _ = cli(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                        "--set", "parallel.tensor=8", "--set", "cluster.nodes=64", "--set", "cluster.data_parallel=16",
                        "--set", "cluster.fold=false"])
    assert code == 0 and "(all 16 replicas replayed: cluster.fold is false)" in out
