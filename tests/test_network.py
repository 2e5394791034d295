"""The network model: routed flows with max-min fair sharing, collectives, data parallelism and faults
(docs/network.md). Every number asserted is computed by hand from the graph, or taken from a published figure."""

from __future__ import annotations

import json
import math
import random

import networkx as nx
import numpy as np
import pytest

from pipescope import load_config, run
from pipescope.config import ConfigError
from pipescope.simulator.collectives import NCCL_STEP_NS
from pipescope.simulator.costs import AnalyticCosts
from pipescope.simulator.engine import Engine
from pipescope.simulator.flows import HOP_WEIGHT, MAX_ECMP_PATHS, _one_level, max_min_rates, routing_weight
from pipescope.simulator.ir import ActionKind, Role
from pipescope.simulator.models import PRESETS
from pipescope.simulator.oracle import Oracle
from pipescope.simulator.replicas import GradSync, data_parallel
from pipescope.simulator.routed import RoutedNetwork, time_alone
from pipescope.simulator.routing import EqualCostRouter
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import prepare, simulate
from pipescope.topologies.cluster import gpu_nodes
from pipescope.topologies.topology_io import load_topology

K = ActionKind
GB = 1e9


def link(graph: nx.DiGraph, a: str, b: str, bandwidth: float, latency_ns: float) -> None:
    graph.add_edge(a, b, bandwidth=bandwidth, latency_ns=latency_ns)
    graph.add_edge(b, a, bandwidth=bandwidth, latency_ns=latency_ns)


def star(n: int, bandwidth: float = 100 * GB, latency_ns: float = 1000) -> RoutedNetwork:
    """n GPUs on one switch: every GPU-GPU path is two edges, 2 x latency_ns."""
    graph = nx.DiGraph()
    for i in range(n):
        link(graph, f"g{i}", "switch", bandwidth, latency_ns)
    return RoutedNetwork(graph, [f"g{i}" for i in range(n)], algorithm="ring")


def leaf_spine(spines: int) -> nx.DiGraph:
    """Host a on leaf0 and host b on leaf1, the leaves joined through ``spines`` spines of 1 GB/s: equal paths."""
    graph = nx.DiGraph()
    for spine in range(spines):
        link(graph, "leaf0", f"spine{spine}", 1 * GB, 100)
        link(graph, "leaf1", f"spine{spine}", 1 * GB, 100)
    link(graph, "a", "leaf0", 100 * GB, 0)
    link(graph, "b", "leaf1", 100 * GB, 0)
    return graph


def servers(nodes: int, per_node: int, nvlink: float, nic: float) -> RoutedNetwork:
    """Servers of GPUs on an NVLink switch, each GPU with its own NIC on one fabric switch."""
    graph = nx.DiGraph()
    for n in range(nodes):
        for i in range(per_node):
            gpu = f"n{n}.gpu{i}"
            graph.add_node(gpu, node=n)
            link(graph, gpu, f"n{n}.nvswitch", nvlink, 500)
            link(graph, gpu, f"n{n}.nic{i}", nic, 0)
            link(graph, f"n{n}.nic{i}", "fabric", nic, 2500)
    return RoutedNetwork(graph, [f"n{d // per_node}.gpu{d % per_node}" for d in range(nodes * per_node)])


# Flows ------------------------------------------------------------------------------------------------------------

def test_one_flow_takes_latency_plus_bytes_over_bandwidth():
    # g0 -> g1 crosses two 1 GB/s edges of 1 us: 2 us + 1e6 B / 1 GB/s = 1 ms.
    assert time_alone(star(2, 1 * GB), [(0, 1, 10**6, 0)]) == {0: 2_000 + 1_000_000}


def test_two_flows_on_one_edge_get_half_each():
    # Both end on switch -> g2: each drains at 0.5 GB/s.
    assert time_alone(star(3, 1 * GB), [(0, 2, 10**6, 0), (1, 2, 10**6, 0)]) == {0: 2_002_000, 1: 2_002_000}


def test_a_flow_over_a_slow_and_a_fast_edge_is_limited_by_the_slow_one():
    graph = nx.DiGraph()
    link(graph, "a", "b", 10 * GB, 100)
    link(graph, "b", "c", 1 * GB, 200)
    network = RoutedNetwork(graph, ["a", "c"])
    assert time_alone(network, [(0, 1, 10**6, 0)]) == {0: 300 + 1_000_000}


def test_a_flow_that_starts_when_another_ends_gets_the_whole_edge():
    ends = time_alone(star(3, 1 * GB), [(0, 2, 10**6, 0), (1, 2, 10**6, 1_000_000)])
    assert ends == {0: 1_002_000, 1: 2_002_000}


def test_three_flows_on_two_edges_get_the_max_min_rates():
    # A on e0 (1 GB/s), B on e0 and e1 (3 GB/s), C on e1: e0 is the bottleneck, A = B = 0.5; C takes what e1 has
    # left, 2.5 GB/s.
    assert max_min_rates([(0,), (0, 1), (1,)], [1.0, 3.0]) == [0.5, 0.5, 2.5]
    graph = nx.DiGraph()
    link(graph, "a", "m", 1 * GB, 0)
    link(graph, "m", "c", 3 * GB, 0)
    network = RoutedNetwork(graph, ["a", "m", "c"])
    ends = time_alone(network, [(0, 1, 10**6, 0), (0, 2, 10**6, 0), (1, 2, 5 * 10**6, 0)])
    # A and B drain at 0.5 GB/s until 2 ms; C at 2.5 GB/s, then alone at 3 GB/s: 5 MB = 2.5 * 2 ms ... all at 2 ms.
    assert ends == {0: 2_000_000, 1: 2_000_000, 2: 2_000_000}


def test_flows_on_separate_links_do_not_slow_each_other_and_all_leave():
    """Two pairs of flows on two links, the second pair starting later: each pair halves its own link only. Every
    flow in flight is counted and uncounted once (the component walk stops once it holds them all)."""
    graph = nx.DiGraph()
    link(graph, "a", "b", 1 * GB, 0)
    link(graph, "c", "d", 1 * GB, 0)
    network = RoutedNetwork(graph, ["a", "b", "c", "d"])
    starts = [(0, 1, 10**6, 0), (0, 1, 10**6, 0), (2, 3, 10**6, 500_000), (2, 3, 10**6, 500_000),
              (1, 0, 10**6, 1_000_000)]
    assert time_alone(network, starts) == {0: 2_000_000, 1: 2_000_000, 2: 2_500_000, 3: 2_500_000, 4: 2_000_000}
    assert not network.fabric._in_flight and not any(network.fabric.on_edge.values())


def test_a_flow_joining_two_on_a_shared_path_gets_its_share_once_the_walk_has_them_all():
    """Two flows a->m->b from 0, a third from 0.5 ms: the third's first shared edge already holds every flow in
    flight, so the walk stops there (its second edge unvisited), and all three share each edge by thirds."""
    graph = nx.DiGraph()
    link(graph, "a", "m", 1 * GB, 0)
    link(graph, "m", "b", 1 * GB, 0)
    network = RoutedNetwork(graph, ["a", "b"])
    ends = time_alone(network, [(0, 1, 10**6, 0), (0, 1, 10**6, 0), (0, 1, 10**6, 500_000)])
    # 0.25 MB each by 0.5 ms at half the link; then 0.75 MB at a third: 2.25 ms; the third's last 0.25 MB alone
    assert ends == {0: 2_750_000, 1: 2_750_000, 2: 3_000_000}


def progressive_filling(paths: list[list[int]], capacity: list[float]) -> list[float]:
    """Max-min rates the textbook way, one (flow, edge) pair at a time, in plain Python."""
    residual, rate = list(capacity), [math.inf if not p else None for p in paths]
    while any(r is None for r in rate):
        weight = [0] * len(capacity)
        for f, path in enumerate(paths):
            for e in path if rate[f] is None else ():
                weight[e] += 1
        share = [residual[e] / weight[e] if weight[e] else math.inf for e in range(len(capacity))]
        level = max(min(share), 1e-12)
        frozen = [f for f, path in enumerate(paths) if rate[f] is None
                  and any(share[e] <= level * (1 + 1e-12) for e in path)]
        for f in frozen:
            rate[f] = level
            for e in paths[f]:
                residual[e] -= level
    return rate


@pytest.mark.parametrize("seed", range(20))
def test_max_min_rates_are_progressive_filling_to_the_bit(seed):
    # Repeated edges (lockstep links), shared and private edges, an empty path; capacities with ties.
    rng = random.Random(seed)
    capacity = [rng.choice([1.0, 2.5, 3.0, 10.0]) for _ in range(12)]
    paths = [[rng.randrange(12) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 9))]
    assert max_min_rates(paths, capacity) == progressive_filling(paths, capacity)
    assert max_min_rates(paths, np.asarray(capacity)) == progressive_filling(paths, capacity)


@pytest.mark.parametrize("seed", range(40))
def test_max_min_rates_without_empty_paths_are_progressive_filling_to_the_bit(seed):
    """Every flow has edges, so a solve that one level settles takes the count over the graph's edges
    (``_one_level``); one with more levels, or on a graph of many more edges than pairs, runs every round. Both
    give the textbook's floats."""
    rng = random.Random(seed)
    edges = rng.choice([6, 12, 400])  # 400: more than DENSE_EDGES_PER_PAIR per pair, counted sparsely
    capacity = [rng.choice([1.0, 2.5, 3.0, 10.0]) for _ in range(edges)]
    paths = [[rng.randrange(min(edges, 12)) for _ in range(rng.randrange(1, 6))] for _ in range(rng.randrange(1, 9))]
    assert max_min_rates(paths, capacity) == progressive_filling(paths, capacity)


def test_one_level_is_taken_only_when_it_freezes_every_flow():
    """Two flows on one edge of 1.0 settle at 0.5 in one round; a third on a private edge of 3.0 needs a second."""
    lengths = np.array([1, 1])
    assert _one_level(np.array([0, 0]), lengths, np.array([1.0, 3.0])) == 0.5
    assert _one_level(np.array([0, 0, 1]), np.array([1, 1, 1]), np.array([1.0, 3.0])) is None
    assert max_min_rates([(0,), (0,), (1,)], [1.0, 3.0]) == [0.5, 0.5, 3.0]


def test_drains_due_together_leave_in_the_order_they_were_planned_across_solves():
    """Two links, each a component of its own: flow 1 is planned at 0 to drain at 1 ms, flow 0 at 0.5 ms to drain at
    1 ms too, flow 2 is planned at 0 to drain at 2 ms and re-planned when flow 3 joins its link. The fabric keeps one
    heap entry per solve (``FlowFabric._plan_drains``); the drains still leave in (time, order planned) order, and
    a superseded plan drains nothing."""
    graph = nx.DiGraph()
    link(graph, "a", "b", 1 * GB, 0)
    link(graph, "c", "d", 1 * GB, 0)
    link(graph, "e", "f", 1 * GB, 0)
    network = RoutedNetwork(graph, ["a", "b", "c", "d", "e", "f"])
    ends = time_alone(network, [(2, 3, 500_000, 500_000), (0, 1, 10**6, 0), (4, 5, 2 * 10**6, 0),
                                (4, 5, 250_000, 1_500_000)])
    # flow 2: 1.5 MB by 1.5 ms, then halves with flow 3 (0.25 MB, done at 2 ms) and ends its last 0.25 MB alone
    assert ends == {1: 1_000_000, 0: 1_000_000, 3: 2_000_000, 2: 2_250_000}
    assert list(ends) == [1, 0, 3, 2]  # the order they arrived in
    assert not network.fabric._drains and not network.fabric._in_flight


def test_equal_cost_paths_are_spread_by_the_seed():
    graph = leaf_spine(4)
    network = RoutedNetwork(graph, ["a", "b"], seed=7)
    assert len(network.fabric.routes(0, 1)) == 4
    chosen = {network.fabric.route(0, 1, flow) for flow in range(64)}
    assert len(chosen) == 4  # ECMP: the flows use every spine
    again = RoutedNetwork(graph, ["a", "b"], seed=7)
    assert [again.fabric.route(0, 1, f) for f in range(64)] == [network.fabric.route(0, 1, f) for f in range(64)]


def brute_force_paths(graph: nx.DiGraph, names: list, weights: list, a: str, b: str) -> list[tuple[int, ...]]:
    """Every shortest path by networkx (a full Dijkstra), as edge-id tuples in lexicographic order."""
    ids = {edge: i for i, edge in enumerate(names)}
    weighted = nx.DiGraph()
    weighted.add_nodes_from(graph)
    weighted.add_weighted_edges_from((u, v, w) for (u, v), w in zip(names, weights))
    try:
        found = nx.all_shortest_paths(weighted, a, b, weight="weight")
        return sorted(tuple(ids[u, v] for u, v in zip(p, p[1:])) for p in found)
    except nx.NetworkXNoPath:
        return []


@pytest.mark.parametrize("seed", range(12))
def test_the_router_lists_every_equal_cost_path_as_a_full_dijkstra_does(seed):
    # Latencies from a few values (0 ns included) make many ties; sparse graphs leave some pairs without a path.
    rng = random.Random(seed)
    graph = nx.relabel_nodes(nx.gnm_random_graph(30, rng.choice([45, 90]), seed=seed, directed=True), str)
    names = list(graph.edges)
    weights = [rng.choice([0, 100, 300]) * HOP_WEIGHT + 1 for _ in names]
    router = EqualCostRouter(graph, names, weights)
    for a in graph:
        for b in graph:
            assert router.paths(a, b, 10**6) == brute_force_paths(graph, names, weights, a, b), (a, b)
            assert router.paths(a, b, 3) == brute_force_paths(graph, names, weights, a, b)[:3]


@pytest.mark.parametrize("name, nodes, fabric", [("dgx-h100", 40, "fat-tree"), ("dgx-h100", 12, "rail"),
                                                 ("p3.16xlarge", 3, None), ("pcie-box", 2, None)])
def test_the_router_on_built_in_clusters_matches_a_full_dijkstra(name, nodes, fabric):
    graph = load_topology(name, nodes, fabric)
    fabric_ = RoutedNetwork(graph, gpu_nodes(graph)).fabric
    weights = [routing_weight(latency) for latency in fabric_.latency]
    gpus = gpu_nodes(graph)
    for a, b in random.Random(0).sample([(a, b) for a in range(len(gpus)) for b in range(len(gpus))], 60):
        expected = brute_force_paths(graph, fabric_.names, weights, gpus[a], gpus[b])[:MAX_ECMP_PATHS]
        assert [path for path, _ in fabric_.routes(a, b)] == expected


@pytest.mark.parametrize("name, nodes, fabric, symmetric", [
    ("dgx-h100", 4, "rail", True), ("dgx-a100", 3, "rail", True), ("dgx-h100", 3, "fat-tree", True),
    ("p3.16xlarge", 3, None, True), ("pcie-box", 3, None, True), ("dgx-h100", 5, "fat-tree", False)])
def test_routes_between_identical_servers_are_their_class_renamed_to_the_edge(name, nodes, fabric, symmetric):
    """Every GPU pair's paths, found from its class's (servers 0 and 1, or 0 alone), are the list a search of
    that pair gives: the same edges in the same order. Five DGX H100s on a fat-tree fill two leaves (32 NICs
    each), so their servers meet the fabric differently and every pair is searched."""
    graph = load_topology(name, nodes, fabric)
    gpus = gpu_nodes(graph)
    fabric_ = RoutedNetwork(graph, gpus).fabric
    assert (fabric_._servers is not None) is symmetric
    for a in range(len(gpus)):
        for b in range(len(gpus)):
            assert fabric_.routes(a, b) == fabric_._search(gpus[a], gpus[b]), (a, b)
            assert fabric_.route(a, b, a * 7 + b) in fabric_.routes(a, b)
    if symmetric:  # one search per class: (GPU, GPU) on one server and on two, both orders of the two
        per_node = graph.graph["gpus_per_node"]
        assert len(fabric_._servers._canonical) <= 3 * per_node ** 2


def _servers_graph(servers: int, wire) -> nx.DiGraph:
    """Servers ``n{k}.*`` (kind and node set) and switches, linked by ``wire(link)`` at 100 ns unless it says."""
    graph = nx.DiGraph()

    def link(a: str, b: str, ns: float = 100.0) -> None:
        for u, v in ((a, b), (b, a)):
            for w in (u, v):
                if w not in graph:
                    server = int(w[1:w.index(".")]) if w.startswith("n") and "." in w else -1
                    graph.add_node(w, kind="gpu" if w.split(".")[-1].startswith("g") else "nic", node=server)
            graph.add_edge(u, v, bandwidth=1e9, latency_ns=ns)
    wire(link)
    return graph


def test_hand_made_graphs_that_look_symmetric_still_route_as_a_search_does():
    """Two full graphs of a file's kind that build_cluster cannot make. Server 1's own parts named as the fabric's
    leaves are not the leaves: its servers differ. Four servers with 8 equal paths through each: a class's list is
    cut at 16, where another server's paths sort differently, so the pair is searched."""
    def named_as_leaves(link) -> None:
        for k in (0, 1):
            link(f"n{k}.g", f"n{k}.h", 10_000.0)
            link(f"n{k}.g", f"n{k}.nic0")
            link(f"n{k}.h", f"n{k}.nic1")
        link("n0.nic0", "L"), link("n0.nic1", "L2"), link("n1.nic0", "n1.L"), link("n1.nic1", "n1.L2")
        link("L", "S"), link("L2", "S")

    def many_paths(link) -> None:
        for k in range(4):
            link(f"n{k}.ga", f"n{k}.na"), link(f"n{k}.gb", f"n{k}.nb")
            for j in range(8):
                link(f"n{k}.nc", f"n{k}.s{j}"), link(f"n{k}.s{j}", f"n{k}.nd")
        for k in range(4):
            link(f"n{k}.na", "leaf0"), link(f"n{k}.nc", "leaf0"), link(f"n{k}.nb", "leaf1"), link(f"n{k}.nd", "leaf1")

    graph = _servers_graph(2, named_as_leaves)
    fabric_ = RoutedNetwork(graph, ["n0.g", "n0.h", "n1.g", "n1.h"]).fabric
    assert fabric_._servers is None and fabric_.routes(2, 3) == fabric_._search("n1.g", "n1.h")
    ends = [f"n{k}.{g}" for k in range(4) for g in ("ga", "gb")]
    fabric_ = RoutedNetwork(_servers_graph(4, many_paths), ends).fabric
    assert fabric_._servers is not None
    assert len(fabric_.routes(4, 7)) == MAX_ECMP_PATHS and fabric_.routes(4, 7) == fabric_._search("n2.ga", "n3.gb")


def test_a_failed_link_breaks_the_symmetry_and_every_pair_is_searched():
    graph = load_topology("dgx-h100", 3, "rail")
    graph.remove_edges_from([("n1.nic7", "leaf7"), ("leaf7", "n1.nic7")])
    gpus = gpu_nodes(graph)
    fabric_ = RoutedNetwork(graph, gpus).fabric
    assert fabric_._servers is None
    assert fabric_.routes(15, 23) == fabric_._search(gpus[15], gpus[23])


# Collectives -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_takes_the_textbook_time_and_busbw_is_the_link_bandwidth(n):
    size, bandwidth, hop = 1 << 30, 100 * GB, 2 * 1000
    end = time_alone(star(n, bandwidth), collective=(K.ALL_REDUCE, list(range(n)), size))[0]
    expected = 2 * (n - 1) / n * size / bandwidth * 1e9 + 2 * (n - 1) * (hop + NCCL_STEP_NS)
    assert end == pytest.approx(expected, abs=2)
    busbw = size / (end / 1e9) * 2 * (n - 1) / n
    assert 0.98 * bandwidth < busbw < bandwidth  # the latency steps cost the last 1%


def test_hierarchical_beats_a_flat_ring_across_nodes_with_slow_nics():
    group, size = list(range(16)), 1 << 28
    flat = servers(2, 8, 300 * GB, 12.5 * GB)
    flat.collectives.algorithm = "ring"
    layered = servers(2, 8, 300 * GB, 12.5 * GB)
    layered.collectives.algorithm = "hierarchical"
    t_flat = time_alone(flat, collective=(K.ALL_REDUCE, group, size))[0]
    t_layered = time_alone(layered, collective=(K.ALL_REDUCE, group, size))[0]
    assert t_layered < t_flat / 3
    auto = servers(2, 8, 300 * GB, 12.5 * GB)
    assert auto.collectives.choose(K.ALL_REDUCE, group, size)[0] == "hierarchical"
    assert auto.collectives.choose(K.ALL_REDUCE, group, 1024)[0] != "ring"  # latency-bound: fewer steps win


def test_dgx_h100_all_reduce_busbw_is_in_the_published_range():
    """nccl-tests all_reduce_perf on 8 H100 SXM: ~370 GB/s busbw with NCCL_ALGO=RING (NVLink 450 GB/s line rate
    less ~20% protocol overhead) and ~480 GB/s with NVLink SHARP, the default (NCCL's maintainer in
    NVIDIA/nccl-tests#212; NVIDIA/nccl#1455 measures 365-370 GB/s ring on 8 H100). Our ring runs at the NVLink
    edges' NCCL efficiency (367.2 of 450 GB/s, measured on 8 H200 without SHARP; docs/topologies.md), less its
    latency steps; line rate it ran at before, 448 GB/s, was above every ring measurement."""
    graph = load_topology("dgx-h100")
    network = RoutedNetwork(graph, gpu_nodes(graph))
    size = 8 << 30  # the plateau, where nccl-tests' busbw is quoted
    end = time_alone(network, collective=(K.ALL_REDUCE, list(range(8)), size))[0]
    busbw = size / (end / 1e9) * 2 * 7 / 8
    assert 360 * GB <= busbw <= 367.2 * GB


@pytest.mark.parametrize("size, measured_us", [(16 << 20, 276.6), (64 << 20, 684.6), (1 << 30, 8203.9)])
def test_dgx_a100_all_reduce_follows_nccl_tests_from_16_mib_up(size: int, measured_us: float) -> None:
    """nccl-tests all_reduce_perf on 8 A100s (stas00/ml-engineering network/README.md): 276.6 us at 16 MiB, 684.6 us
    at 64 MiB, 8,203.9 us at 1 GiB. Under NCCL's Simple protocol each step pays NCCL_STEP_NS, under LL the bytes
    double; the faster is taken, as NCCL's tuner does (LL below about 22 MiB here). Within 3%."""
    graph = load_topology("dgx-a100")
    network = RoutedNetwork(graph, gpu_nodes(graph))
    end = time_alone(network, collective=(K.ALL_REDUCE, list(range(8)), size))[0]
    assert end / 1e3 == pytest.approx(measured_us, rel=0.03)
    name = network.collectives.choose(K.ALL_REDUCE, list(range(8)), size)[0]
    assert name == ("ring/LL" if size < 20 << 20 else "ring")


# Data parallelism ------------------------------------------------------------------------------------------------

def _dp_run(width: int, nic: float, efficiency: float = 0.5, overlap: bool = True):
    costs = AnalyticCosts(PRESETS["gpt-1.3b"], 989e12, 4, "bf16", efficiency)
    network = servers(2, 4, 450 * GB, nic)  # replica r on server r
    return simulate(build("1f1b", 4, 8), costs, network, data_parallel=width, grad_sync=GradSync(overlap=overlap))


def test_iteration_grows_by_the_exposed_all_reduce_and_no_more():
    alone = _dp_run(1, 1 * GB)
    replicated = _dp_run(2, 1 * GB)
    assert alone.exposed_allreduce_s == 0
    assert replicated.exposed_allreduce_s > 0.1  # 325 MB of gradients per stage over 1 GB/s NICs
    assert replicated.iteration_ns - alone.iteration_ns == round(replicated.exposed_allreduce_s * 1e9)
    assert replicated.data_parallel == 2 and len(replicated.devices) == 8


def test_overlapped_all_reduce_is_exposed_less_as_the_backward_lengthens():
    exposed = [_dp_run(2, 25 * GB, efficiency).exposed_allreduce_s for efficiency in (0.6, 0.2, 0.05)]
    assert exposed[0] > exposed[1] > exposed[2]
    at_end = _dp_run(2, 25 * GB, 0.05, overlap=False).exposed_allreduce_s
    assert at_end > exposed[2]


def test_engine_and_oracle_agree_on_a_replicated_run():
    costs = AnalyticCosts(PRESETS["gpt-1.3b"], 989e12, 4, "bf16", 0.5)
    schedule = build("zb-h1", 4, 8)
    program, stage_costs = prepare(schedule, costs)
    grads = [c.params * 2 for c in stage_costs]
    program = data_parallel(program, schedule, 2, grads, GradSync(bucket_bytes=64 << 20))
    engine = Engine(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    oracle = Oracle(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    assert engine == oracle
    assert max(engine.flow_end) > max(engine.entry_end)  # the all-reduce outlasts the compute


def test_two_pipelines_sharing_a_nic_take_longer_than_one_but_not_on_a_non_blocking_fabric():
    def forward_sends(topology: str, width: int) -> float:
        placement = ",".join(str(r) for r in (0, 8, 1, 9)[:2 * width])  # each pipeline: node 0 -> node 1
        result = run(load_config(None, [f"cluster.topology={topology}", "cluster.nodes=2", "schedule.stages=2",
                                        f"cluster.data_parallel={width}", f"cluster.placement={placement}",
                                        "model.preset=gpt-355m"]))
        frame = result.timeline
        sends = frame[(frame["kind"] == "SEND_F") & (frame["device"] == 0)]
        return float((sends["end_ns"] - sends["start_ns"]).mean())

    assert forward_sends("pcie-box", 2) > 1.5 * forward_sends("pcie-box", 1)  # one NIC per server
    assert forward_sends("dgx-h100", 2) == forward_sends("dgx-h100", 1)  # a NIC per GPU, rail fabric


def test_lanes_through_one_nic_share_it_and_count_one_busy_span():
    """Device d's two GPUs (lanes) each send 1 MB to the same GPU of device 1 through their server's one 1 GB/s
    NIC: 2 ms for both slices, the NIC busy once for those 2 ms (an edge a lockstep flow crosses twice is one span)."""
    graph = nx.DiGraph()
    for server in (0, 1):
        for gpu in (0, 1):
            link(graph, f"s{server}.g{gpu}", f"s{server}.nic", 100 * GB, 0)
        link(graph, f"s{server}.nic", "fabric", 1 * GB, 0)
    network = RoutedNetwork(graph, ["s0.g0", "s1.g0"], lanes=[["s0.g1"], ["s1.g1"]])
    assert time_alone(network, [(0, 1, 10**6, 0)]) == {0: 2_000_000}
    assert network.busy_spans()["s0.nic>fabric"] == [(0, 2_000_000)]
    network = RoutedNetwork(graph, ["s0.g0", "s1.g0"])  # the first GPU alone: half the bytes through the NIC
    assert time_alone(network, [(0, 1, 10**6, 0)]) == {0: 1_000_000}


def test_each_lane_of_a_transfer_picks_its_own_equal_cost_path():
    """Two servers of 2 GPUs, their leaves joined by two 1 GB/s spines: a device's two slices of 1 MB hash to their
    own spine, so for some seeds they take both (1 ms) where one shared spine takes 2 ms. With one key for both
    slices every seed gave 2 ms."""
    graph = nx.DiGraph()
    for server in (0, 1):
        for gpu in (0, 1):
            link(graph, f"s{server}.g{gpu}", f"leaf{server}", 100 * GB, 0)
        for spine in (0, 1):
            link(graph, f"leaf{server}", f"spine{spine}", 1 * GB, 0)
    times = {time_alone(RoutedNetwork(graph, ["s0.g0", "s1.g0"], seed=seed, lanes=[["s0.g1"], ["s1.g1"]]),
                        [(0, 1, 10**6, 0)])[0] for seed in range(8)}
    assert times == {1_000_000, 2_000_000}


def test_tensor_parallel_gpus_each_move_their_own_slice_through_the_nics_they_share():
    """With t GPUs per device, each GPU sends its 1/t slice of an activation and all-reduces its own gradient shard:
    through the one NIC of a pcie-box server the t slices take as long as t = 1's whole activation, and the NIC
    carries all t shards; on dgx-h100 each GPU has its own NIC. (The first GPU alone once stood for the device.)"""
    def result(topology: str, tensor: int, width: int, stages: int):
        return run(load_config(None, [f"cluster.topology={topology}", "cluster.nodes=2", f"schedule.stages={stages}",
                                      f"cluster.data_parallel={width}", f"parallel.tensor={tensor}",
                                      "cluster.placement=spread", "model.preset=gpt-355m", "schedule.microbatches=2"]))

    def send_ns(topology: str, tensor: int) -> float:
        frame = result(topology, tensor, 1, 2).timeline  # stage 0 on node 0, stage 1 on node 1
        sends = frame[(frame["kind"] == "SEND_F") & (frame["device"] == 0)]
        return float((sends["end_ns"] - sends["start_ns"]).mean())

    assert send_ns("pcie-box", 2) == pytest.approx(send_ns("pcie-box", 1), rel=1e-3)
    assert send_ns("dgx-h100", 2) < 0.6 * send_ns("dgx-h100", 1)
    for topology, sharing in (("pcie-box", 2), ("dgx-h100", 1)):
        run2 = result(topology, 2, 2, 1)  # two replicas of one stage, one per server: a 2-member ring per GPU
        shard = run2.stage_costs[0].params * 4  # Megatron's fp32 gradients of one GPU; the ring moves each once
        assert max(link["bytes"] for link in run2.links if link["kind"] == "nic") == sharing * shard


# Faults ------------------------------------------------------------------------------------------------------------

BASE = ["cluster.nodes=2", "schedule.stages=16", "model.preset=gpt-355m"]


def test_a_straggler_slows_the_pipeline_and_jitter_is_reproducible():
    healthy = run(load_config(None, BASE))
    slow = run(load_config(None, BASE + ["faults.stragglers=3:2"]))
    assert slow.iteration_ns > healthy.iteration_ns
    assert slow.devices[3].busy_s == pytest.approx(2 * healthy.devices[3].busy_s, rel=1e-6)
    first, second = (run(load_config(None, BASE + ["faults.jitter=0.1", "seed=5"])) for _ in range(2))
    other = run(load_config(None, BASE + ["faults.jitter=0.1", "seed=6"]))
    assert json.dumps(first.summary()) .replace(str(first.sim_wall_s), "") == \
        json.dumps(second.summary()).replace(str(second.sim_wall_s), "")
    assert first.timeline["end_ns"].equals(second.timeline["end_ns"])
    assert not first.timeline["end_ns"].equals(other.timeline["end_ns"])


def test_a_degraded_link_slows_the_transfers_that_cross_it():
    healthy = run(load_config(None, BASE))
    degraded = run(load_config(None, BASE + ["faults.degraded_links=n0.nic7-leaf7:0.01"]))
    assert degraded.iteration_ns > healthy.iteration_ns


@pytest.mark.parametrize("faults", [
    ["faults.degraded_links=n0.nic7-leaf7:0.5, n0.nic7-leaf7:0.001"],  # factors multiplied past 0.001
    ["faults.degraded_links=n0.nic7-leaf7:0.5, leaf7>n0.nic7:0.5"],  # the other spelling of one direction
    ["faults.failed_links=n0.nic7-leaf7, n0.nic7-leaf7"],  # blamed as "not a link" once the first removed it
    ["faults.degraded_links=n0.nic7-leaf7:0.5", "faults.failed_links=n0.nic7>leaf7"],
])
def test_a_link_named_by_two_faults_is_refused(faults: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"names the link (n0.nic7>leaf7|leaf7>n0.nic7) a second time, expected "
                                          r"each link in one fault"):
        run(load_config(None, BASE + faults))


def test_a_failed_link_without_another_route_names_the_transfer():
    cut_off = "faults.failed_links=n0.gpu7-n0.nvswitch0, n0.gpu7>n0.pcie3, n0.gpu7>n0.nic7"  # it can still receive
    with pytest.raises(ConfigError, match=r"faults.failed_links: no route from device 7 \(n0.gpu7\) to device 8 "
                                          r"\(n1.gpu0\) for 7SEND_F0; expected"):
        run(load_config(None, BASE + [cut_off]))
    alone = ["model.preset=gpt-355m", "schedule.stages=1", "schedule.microbatches=2", "cluster.data_parallel=16",
             "cluster.nodes=2", "faults.failed_links=n1.gpu3-n1.nvswitch0, n1.gpu3-n1.pcie1, n1.gpu3-n1.nic3"]
    with pytest.raises(ConfigError, match=r"no route from device 10 \(n1.gpu2\) to device 11 \(n1.gpu3\) for stage "
                                          r"0's all-reduce over devices 0, 1, .*, 15; expected"):  # not a SEND's
        run(load_config(None, alone))
    with pytest.raises(ConfigError, match="faults.failed_links: 'nowhere-leaf7' is not a link"):
        run(load_config(None, BASE + ["faults.failed_links=nowhere-leaf7"]))
    with pytest.raises(ConfigError, match="faults.stragglers: GPU 99 runs no device"):
        run(load_config(None, BASE + ["faults.stragglers=99:2"]))


def test_a_failed_link_with_another_route_is_routed_around():
    graph = leaf_spine(2)
    both = time_alone(RoutedNetwork(graph, ["a", "b"]), [(0, 1, 10**6, 0), (0, 1, 10**6, 0), (0, 1, 10**6, 0)])
    graph.remove_edges_from([("leaf0", "spine0"), ("spine0", "leaf0")])
    one = time_alone(RoutedNetwork(graph, ["a", "b"]), [(0, 1, 10**6, 0), (0, 1, 10**6, 0), (0, 1, 10**6, 0)])
    assert max(one.values()) == 200 + 3_000_000  # all three over the one spine left
    assert max(both.values()) < max(one.values())


def test_results_carry_links_and_exposed_time():
    result = run(load_config(None, ["cluster.nodes=2", "cluster.data_parallel=2", "schedule.stages=8",
                                    "model.preset=gpt-355m"]))
    summary = result.summary()
    assert summary["data_parallel"] == 2 and summary["exposed_allreduce_s"] == result.exposed_allreduce_s
    assert summary["network"]["collective_algorithms"]
    nic = [row for row in summary["links"] if row["kind"] == "nic"]
    assert nic and all(0 < row["utilization"] <= 1 for row in nic)
    collective = result.records.mask(Role.COLLECTIVE)
    assert collective.sum() > 0 and len(summary["per_device"]) == 16
    assert math.isclose(sum(d["exposed_allreduce_s"] for d in summary["per_device"]) / 16,
                        sum(d.exposed_allreduce_s for d in result.devices) / 16)


# Commands ---------------------------------------------------------------------------------------------------------

def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from pipescope.experiments.cli import main
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_collective_command_reports_nccl_tests_numbers(capsys, tmp_path):
    code, out, _ = _cli(capsys, "collective", "--topology", "dgx-h100", "--op", "all_reduce", "--bytes", "1GiB",
                        "--ranks", "0-7", "--json")
    report = json.loads(out)
    assert code == 0 and report["algorithm"] == "ring" and report["ranks"] == list(range(8))
    assert report["algbw_GBps"] == pytest.approx(report["bytes"] / report["time_s"] / 1e9)
    assert report["busbw_GBps"] == pytest.approx(report["algbw_GBps"] * 2 * 7 / 8)
    code, out, _ = _cli(capsys, "collective", "--topology", "dgx-h100", "--nodes", "2", "--bytes", "1GiB", "--json")
    assert code == 0 and json.loads(out)["algorithm"] == "hierarchical"
    for bad, message in ((["--ranks", "0-99"], "--ranks: '0-99' is not within 0-7"),
                         (["--ranks", "7-0"], "--ranks: '7-0' runs backwards, expected low-high with low <= high"),
                         (["--ranks", "0-3,2"], "--ranks: got '0-3,2', which names rank 2 twice; expected each rank "
                                                "once"),
                         (["--ranks", "3"], "--ranks: got '3', expected at least 2 distinct ranks"),
                         (["--profile", "tests"], "--profile: 'tests' has no comms.json; expected a pipescope "
                                                   "calibrate-comms output"),
                         (["--op", "gather"], "--op: got 'gather', expected one of all_reduce"),
                         (["--nodes", "2", "--oversubscription", "0.5"], "--oversubscription: got 0.5, expected"),
                         (["--topology", "nope"], "--topology: got 'nope', expected"),
                         (["--bytes", "lots"], "--bytes:"), (["--algorithm", "magic"], "--algorithm: got 'magic'")):
        code, _, err = _cli(capsys, "collective", *bad)
        assert code == 2 and message in err and err.count("\n") == 1
    for size in ("-5", "0"):  # neither is a size to move: said alike (-5 read "expected a non-negative size")
        code, _, err = _cli(capsys, "collective", "--bytes", size)
        assert code == 2 and err == (f"pipescope: error: --bytes: got '{size}', expected a size from 1 B to 1 PiB, "
                                     f"such as 64MB or 1GiB\n")
    one = tmp_path / "one.yaml"  # one GPU has no one to exchange with: it printed an infinite bandwidth and NaN
    one.write_text("device: a100\ngpus: 1\nedges: []\n")
    code, _, err = _cli(capsys, "collective", "--topology", str(one), "--json")
    assert code == 2 and err == ("pipescope: error: --topology: got a cluster of 1 GPU, expected at least 2 (more "
                                 "--nodes, or a machine with more GPUs)\n")


def test_collective_command_uses_a_comms_profile(tmp_path, capsys):
    from pipescope.simulator.readers.profile_schema import SCHEMA_VERSION
    (tmp_path / "comms_fit.csv").write_text(
        "collective,world_size,lo_bytes,hi_bytes,latency_ns,bandwidth,points\n"
        "all_reduce,8,0,1099511627776,20000,2e11,5\n"
        "p2p,2,0,1099511627776,8000,1e11,5\n")
    (tmp_path / "comms.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "kind": "comms",
                                                     "tables": {"comms_fit": "comms_fit.csv"}}))
    code, out, _ = _cli(capsys, "collective", "--profile", str(tmp_path), "--bytes", "1GiB", "--json")
    assert code == 0 and json.loads(out)["time_s"] == pytest.approx((20_000 + (1 << 30) * 1e9 / 2e11) / 1e9)
    code, out, _ = _cli(capsys, "collective", "--profile", str(tmp_path), "--bytes", "1GiB", "--ranks", "0-3",
                        "--json")
    # no 4-rank all-reduce fit: a ring of the fitted p2p link, 2(n-1)/n * S/B + 2(n-1) latencies
    expected = (2 * 3 / 4 * (1 << 30) * 1e9 / 1e11 + 6 * 8_000) / 1e9
    assert code == 0 and json.loads(out)["time_s"] == pytest.approx(expected, rel=1e-6)


def test_topology_command_is_wired(capsys, tmp_path):
    code, out, _ = _cli(capsys, "topology", "dgx-h100", "--nodes", "2", "--json")
    assert code == 0 and json.loads(out)["gpus"] == 16
    code, _, err = _cli(capsys, "topology", "moon")
    assert code == 2 and err.startswith("pipescope: error:") and err.count("\n") == 1


def test_a_bucket_size_that_makes_millions_of_buckets_is_refused_at_once():
    with pytest.raises(ConfigError, match=r"cluster.bucket_size: got 1 bytes, .* expected at most 4,096 buckets"):
        run(load_config(None, ["cluster.data_parallel=2", "cluster.bucket_size=1"]))
