"""Topology graphs (docs/topologies.md): the built-in machines against their published wiring, fabrics, summary
numbers worked by hand, YAML and GraphML round trips, hostile files, and the ``pipescope topology`` command."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import networkx as nx
import pytest

from pipescope.experiments.topology_cmd import register
from pipescope.topologies.devices import DEVICES
from pipescope.topologies.graphs import builtin, topology_names
from pipescope.topologies.summary import draw, summarize
from pipescope.topologies.topology_io import (
    MACHINES_DIR, MAX_GRAPHML_BYTES, load_topology, machine_device, save_topology, validate,
)

GB = 1e9
# `nvidia-smi topo -m` of a DGX-1V / p3.16xlarge (NV# = # bonded NVLink2 links, SYS = PCIe across the CPUs).
P3_TOPO = """
      GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7
GPU0   X   NV1  NV1  NV2  NV2  SYS  SYS  SYS
GPU1  NV1   X   NV2  NV1  SYS  NV2  SYS  SYS
GPU2  NV1  NV2   X   NV2  SYS  SYS  NV1  SYS
GPU3  NV2  NV1  NV2   X   SYS  SYS  SYS  NV1
GPU4  NV2  SYS  SYS  SYS   X   NV1  NV1  NV2
GPU5  SYS  NV2  SYS  SYS  NV1   X   NV2  NV1
GPU6  SYS  SYS  NV1  SYS  NV1  NV2   X   NV2
GPU7  SYS  SYS  SYS  NV1  NV2  NV1  NV2   X
"""
OLD_MACHINE = """device: h100
gpus_per_node: 8
intra_node: {bandwidth: 450GB/s, latency: 2us}
inter_node: {bandwidth: 50GB/s, latency: 5us}
"""
SERVER = """name: two-gpus
device: a100
gpus: 2
parts: {nvswitch0: nvswitch, pcie0: pcie, nic0: nic}
edges:
- {a: gpu0, b: nvswitch0, kind: nvswitch, bandwidth: 300GB/s, latency: 750ns}
- {a: gpu1, b: nvswitch0, kind: nvswitch, bandwidth: 300GB/s, latency: 750ns}
- {a: gpu0, b: pcie0, kind: pcie, bandwidth: 32GB/s, latency: 1us}
- {a: pcie0, b: nic0, kind: pcie, bandwidth: 32GB/s, latency: 1us}
fabric: {nic_bandwidth: 200Gbit/s}
"""


def nvlink_table() -> dict[tuple[int, int], int]:
    rows = [line.split() for line in P3_TOPO.strip().splitlines()[1:]]
    return {(a, b): int(cell[2:]) for a, row in enumerate(rows) for b, cell in enumerate(row[1:])
            if cell.startswith("NV")}


def same_graph(g: nx.DiGraph, h: nx.DiGraph) -> bool:
    return (g.graph == h.graph and dict(g.nodes(data=True)) == dict(h.nodes(data=True))
            and {(a, b): d for a, b, d in g.edges(data=True)} == {(a, b): d for a, b, d in h.edges(data=True)})


def gpu_path(graph: nx.DiGraph, a: str, b: str) -> list[list[str]]:
    return list(nx.all_shortest_paths(graph, a, b, weight="latency_ns"))


def test_every_builtin_loads_valid_with_its_device() -> None:
    for name in topology_names():
        graph = load_topology(name)
        validate(graph, name)
        assert graph.graph["device"] in DEVICES and graph.graph["device"] == machine_device(name)
        assert sorted(d["rank"] for _, d in graph.nodes(data=True) if d["kind"] == "gpu") == list(range(8))
    assert load_topology("p3dn-v100").graph["name"] == "p3dn.24xlarge"
    assert load_topology("p3-16xlarge").graph["name"] == "p3.16xlarge"


@pytest.mark.parametrize("nodes, fabric, oversubscription", [(3, "rail", 1.0), (40, "fat-tree", 4.0), (5, None, 1.0),
                                                           (512, "rail", 2.0)])
def test_every_builtin_cluster_is_valid(nodes: int, fabric: str | None, oversubscription: float) -> None:
    """A built-in machine's cluster is not validated when it loads (it is ours, and at 32,768 GPUs validating took
    over a second), so every one is validated here, on both fabrics and oversubscribed."""
    for name in topology_names():
        if builtin(name).nics:  # a server without NICs is one node
            validate(load_topology(name, nodes, fabric, oversubscription), name)


def test_shipped_machine_files_are_the_builtins_in_the_server_format() -> None:
    for path in sorted(Path(MACHINES_DIR).glob("*.yaml")):
        from_file = load_topology(str(path))
        assert same_graph(from_file, load_topology(from_file.graph["name"])), path.name


def test_p3_16xlarge_is_the_dgx1_hybrid_cube_mesh() -> None:
    graph = load_topology("p3.16xlarge")
    table = nvlink_table()
    nvlinks = {(int(a[-1]), int(b[-1])): d["bandwidth"] for a, b, d in graph.edges(data=True) if d["kind"] == "nvlink"}
    assert nvlinks == {pair: links * 25 * GB for pair, links in table.items()}
    for gpu in range(8):
        assert sum(bw for (a, _), bw in nvlinks.items() if a == gpu) == 150 * GB  # 6 links of 25 GB/s
    assert sum(1 for bw in nvlinks.values() if bw == 50 * GB) == 16  # 8 doubled pairs, both directions
    without = [(a, b) for a, b in itertools.combinations(range(8), 2) if (a, b) not in nvlinks]
    assert len(without) == 12 and (0, 5) in without
    assert graph.graph["memory_bytes"] == 16 * 2**30 and graph.graph["device"] == "v100"


def test_p3_routes_over_two_nvlink_hops_not_pcie_and_direct_nvlink_over_a_shared_pcie_switch() -> None:
    graph = load_topology("p3.16xlarge")
    paths = gpu_path(graph, "n0.gpu0", "n0.gpu5")
    assert sorted(p[1] for p in paths) == ["n0.gpu1", "n0.gpu4"] and all(len(p) == 3 for p in paths)
    assert gpu_path(graph, "n0.gpu0", "n0.gpu1") == [["n0.gpu0", "n0.gpu1"]]


def test_dgx_cross_rail_traffic_takes_nvswitch_to_the_right_rail_not_the_spines() -> None:
    graph = load_topology("dgx-h100", nodes=2)
    for path in gpu_path(graph, "n0.gpu7", "n1.gpu0"):
        assert not any(v.startswith("spine") for v in path) and any("nvswitch" in v for v in path)
    rails = []  # GPU i uses its own NIC i, as NCCL pins it (graphs._nvswitch_box)
    for path in gpu_path(graph, "n0.gpu3", "n1.gpu3"):
        assert nx.path_weight(graph, path, "latency_ns") == 3000.0
        rails.append([v for v in path if "nic" in v or "leaf" in v])
    assert rails == [["n0.nic3", "leaf3", "n1.nic3"]]


def test_multi_node_rail_and_fat_tree_counts() -> None:
    rail = load_topology("dgx-h100", nodes=2)  # per server 23 vertices, 29 links; 8 rails, 4 spines
    assert (rail.number_of_nodes(), rail.number_of_edges()) == (2 * 23 + 8 + 4, 2 * (2 * 29 + 16 + 8 * 4))
    fat = load_topology("dgx-h100", nodes=8, fabric="fat-tree")  # 64 NICs: 2 leaves of 32, 1 spine
    assert (fat.number_of_nodes(), fat.number_of_edges()) == (8 * 23 + 2 + 1, 2 * (8 * 29 + 64 + 2))
    assert {v for v, d in fat.nodes(data=True) if d["node"] == -1} == {"leaf0", "leaf1", "spine0"}
    one = load_topology("dgx-h100")
    assert sum(1 for _, d in one.nodes(data=True) if d["kind"] == "nic") == 8 and one.has_node("leaf0")


def test_oversubscription_two_halves_the_bisection_of_a_fat_tree() -> None:
    full = summarize(load_topology("dgx-h100", nodes=8, fabric="fat-tree"))
    half = summarize(load_topology("dgx-h100", nodes=8, fabric="fat-tree", oversubscription=2))
    assert full["bisection_bandwidth"] == 32 * 50 * GB  # leaf 0 holds ranks 0-31: its 32 NICs or uplinks
    assert half["bisection_bandwidth"] == full["bisection_bandwidth"] / 2


def test_summary_of_two_dgx_h100_worked_by_hand() -> None:
    s = summarize(load_topology("dgx-h100", nodes=2))
    assert {k: s[k] for k in ("gpus", "nics", "switches", "links")} == {
        "gpus": 16, "nics": 16, "switches": 2 * 5 + 8 + 4, "links": 2 * 29 + 16 + 32}
    assert s["gpu_injection_bandwidth"] == 450 * GB + 64 * GB  # NVSwitch port + its one PCIe Gen5 x16 port, once
    assert s["network_injection_bandwidth"] == 50 * GB  # 400 Gbit/s per GPU
    assert s["bisection_bandwidth"] == 8 * 50 * GB  # node 0's eight NICs
    # one server: GPUs 0-3's NVSwitch ports, plus some of what their PCIe links and NICs carry to GPUs 4-7
    one = summarize(load_topology("dgx-h100"))["bisection_bandwidth"]
    assert 4 * 450 * GB < one < 4 * (450 + 2 * 64) * GB


def test_building_128_nodes_on_a_fat_tree_is_quick() -> None:
    start = time.perf_counter()
    graph = load_topology("dgx-h100", nodes=128, fabric="fat-tree")
    assert time.perf_counter() - start < 1.0 and graph.graph["nodes"] == 128


@pytest.mark.parametrize("suffix", [".yaml", ".graphml"])
@pytest.mark.parametrize("name, nodes", [("dgx-h100", 2), ("p3.16xlarge", 3)])
def test_round_trips_are_equal(tmp_path: Path, suffix: str, name: str, nodes: int) -> None:
    graph = load_topology(name, nodes=nodes)
    graph.edges["n0.gpu0", "n0.pcie0"]["bandwidth"] = 12.345e9  # one direction differs from its reverse
    path = tmp_path / f"g{suffix}"
    save_topology(graph, path)
    assert same_graph(load_topology(str(path)), graph)
    assert same_graph(load_topology(str(path), nodes=nodes), graph)
    with pytest.raises(ValueError, match="full graph"):
        load_topology(str(path), nodes=nodes + 1)


def test_a_picture_or_graph_that_cannot_be_written_names_its_flag(tmp_path: Path, capsys) -> None:
    """--png and --save into a folder: one line naming the flag (--png's named only the file)."""
    from pipescope.experiments.cli import main

    for flag in ("--png", "--save"):
        folder = tmp_path / f"x{flag[2:]}.{'png' if flag == '--png' else 'yaml'}"
        folder.mkdir()
        assert main(["topology", "dgx-a100", flag, str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pipescope: error: {flag}: ") and err.count("\n") == 1, err


def test_a_link_whose_directions_differ_in_efficiency_is_not_saved_as_yaml(tmp_path: Path) -> None:
    """The YAML format holds one efficiency a link: saving one that differs by direction is refused, naming the
    link (it was dropped, and the file read back ran the other direction at the first's rate); GraphML keeps both."""
    graph = load_topology("dgx-a100")
    graph.edges["n0.nvswitch0", "n0.gpu0"]["efficiency"] = 0.3
    with pytest.raises(ValueError, match=r"^the link 'n0\.gpu0'-'n0\.nvswitch0' has efficiency 0\.783 one way and "
                                         r"0\.3 the other, expected one"):
        save_topology(graph, tmp_path / "g.yaml")
    save_topology(graph, tmp_path / "g.graphml")
    assert load_topology(str(tmp_path / "g.graphml")).edges["n0.nvswitch0", "n0.gpu0"]["efficiency"] == 0.3


def test_old_machine_files_load_as_an_nvswitch_star_on_a_non_blocking_fabric(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_MACHINE)
    graph = load_topology(str(path), nodes=2)
    assert graph.graph["name"] == "old" and graph.graph["fabric"] == "fat-tree"
    assert graph.edges["n0.gpu3", "n0.nvswitch0"] == {"bandwidth": 450 * GB, "latency_ns": 1000.0, "kind": "nvswitch"}
    path_ns = nx.shortest_path_length(graph, "n0.gpu1", "n1.gpu1", weight="latency_ns")
    assert path_ns == 5000.0 and nx.shortest_path_length(graph, "n0.gpu1", "n0.gpu2", weight="latency_ns") == 2000.0
    assert summarize(graph)["bisection_bandwidth"] == 8 * 50 * GB


def test_a_server_file_replicates_over_the_fabric(tmp_path: Path) -> None:
    path = tmp_path / "box.yaml"
    path.write_text(SERVER)
    graph = load_topology(str(path), nodes=3, fabric="rail")
    assert graph.graph["name"] == "two-gpus" and machine_device(str(path)) == "a100"
    assert graph.nodes["n2.gpu1"] == {"kind": "gpu", "node": 2, "rank": 5}
    assert graph.edges["n1.nic0", "leaf0"]["bandwidth"] == 25 * GB


def _bad_server(tmp_path: Path, old: str, new: str) -> str:
    assert old in SERVER
    path = tmp_path / "bad.yaml"
    path.write_text(SERVER.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old, new, expected", [
    ("b: pcie0, kind: pcie", "b: pcie9, kind: pcie", "edges[2]: b: 'pcie9' is not a declared node"),
    ("bandwidth: 300GB/s", "bandwidth: 0", "edges[0]: bandwidth: got 0, expected 1MB/s to 1PB/s"),
    ("bandwidth: 300GB/s", "bandwidth: -1", "edges[0]: bandwidth: got -1, expected 1MB/s to 1PB/s"),
    ("latency: 750ns", "latency: 2s", "edges[0]: latency: got '2s', expected 0 to 1 s"),
    ("kind: nvswitch, bandwidth", "kind: infiniband, bandwidth", "edges[0]: kind: got 'infiniband'"),
    ("kind: nvswitch, bandwidth", "kind: pcie, bandwidth", "edges[0]: kind 'pcie' joins a gpu and a nvswitch, "
                                                           "expected a pcie link between cpu-cpu, cpu-gpu"),
    ("- {a: gpu1, b: nvswitch0, kind: nvswitch", "- {a: pcie0, b: gpu0, kind: pcie",
     "edges[2]: the link 'gpu0'-'pcie0' is also edges[1]"),
    ("device: a100", "device: tpu", "device: got 'tpu', expected one of v100"),
    ("- {a: gpu1, b: nvswitch0, kind: nvswitch, bandwidth: 300GB/s, latency: 750ns}\n", "",
     "GPUs 'n0.gpu0' (rank 0) and 'n0.gpu1' (rank 1) are not connected"),
])
def test_bad_server_files_name_the_entry(tmp_path: Path, old: str, new: str, expected: str) -> None:
    path = _bad_server(tmp_path, old, new)
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert expected in str(err.value) and path in str(err.value) and "\n" not in str(err.value)


def test_bad_full_graphs_name_the_node_or_edge(tmp_path: Path) -> None:
    graph = load_topology("dgx-h100")
    graph.nodes["n0.gpu5"]["rank"] = 2
    with pytest.raises(ValueError, match=r"node 'n0\.gpu5': rank 2 is also the rank of GPU 'n0\.gpu2'"):
        validate(graph, "t")
    graph = load_topology("dgx-h100")
    graph.remove_edge("leaf3", "n0.nic3")
    with pytest.raises(ValueError, match=r"edge 'n0\.nic3' -> 'leaf3': no reverse edge"):
        validate(graph, "t")
    graph = load_topology("dgx-h100")
    graph.edges["n0.gpu1", "n0.nvswitch0"]["bandwidth"] = float("nan")
    with pytest.raises(ValueError, match=r"edge 'n0\.gpu1' -> 'n0\.nvswitch0': bandwidth: got nan"):
        validate(graph, "t")
    graph = load_topology("dgx-h100")
    for a, b in (("n0.gpu1", "n0.nvswitch0"), ("n0.nvswitch0", "n0.gpu1")):
        graph.edges[a, b]["kind"] = "nvlink"  # an NVLink is between two GPUs
    with pytest.raises(ValueError, match=r"edge 'n0\.gpu1' -> 'n0\.nvswitch0': kind 'nvlink' joins a gpu and a "
                                         r"nvswitch, expected a nvlink link between gpu-gpu"):
        validate(graph, "t")
    graph = load_topology("dgx-h100")
    graph.nodes["n0.cpu1"]["kind"] = "dpu"
    with pytest.raises(ValueError, match=r"node 'n0\.cpu1': kind: got 'dpu'"):
        validate(graph, "t")


def test_duplicate_ranks_in_a_yaml_graph_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    save_topology(load_topology("pcie-box"), path)
    path.write_text(path.read_text().replace("n0.gpu3: {kind: gpu, node: 0, rank: 3}",
                                             "n0.gpu3: {kind: gpu, node: 0, rank: 1}"))
    with pytest.raises(ValueError, match=r"g\.yaml': node 'n0\.gpu3': rank 1 is also the rank of GPU 'n0\.gpu1'"):
        load_topology(str(path))


def test_hostile_graphml_is_refused_before_parsing(tmp_path: Path) -> None:
    good = tmp_path / "g.graphml"
    save_topology(load_topology("pcie-box"), good)
    text = good.read_text()
    bomb = tmp_path / "bomb.graphml"
    bomb.write_text('<?xml version="1.0"?>\n<!DOCTYPE g [<!ENTITY a "aaaaaaaaaa">]>\n' + text.split("\n", 1)[1])
    with pytest.raises(ValueError, match="bomb.graphml'.*<!DOCTYPE or <!ENTITY"):
        load_topology(str(bomb))
    big = tmp_path / "big.graphml"
    big.write_text(text + " " * MAX_GRAPHML_BYTES)
    with pytest.raises(ValueError, match=f"big.graphml'.*larger than {MAX_GRAPHML_BYTES:,} bytes"):
        load_topology(str(big))
    broken = tmp_path / "broken.graphml"
    broken.write_text(text.replace('attr.type="double"', 'attr.type="string"', 1))
    with pytest.raises(ValueError, match="broken.graphml'.*expected"):
        load_topology(str(broken))


def test_too_big_yaml_and_bad_arguments(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(SERVER + "#" * (2 << 20))
    with pytest.raises(ValueError, match="big.yaml'.*larger than"):
        load_topology(str(big))
    for kwargs, expected in [({"nodes": 0}, "cluster.nodes: got 0"), ({"nodes": 4097}, "cluster.nodes: got 4097"),
                             ({"fabric": "torus"}, "cluster.fabric: got 'torus'"),
                             ({"oversubscription": 0.5}, "cluster.oversubscription: got 0.5")]:
        with pytest.raises(ValueError, match=expected):
            load_topology("dgx-h100", **kwargs)
    with pytest.raises(ValueError, match="'nope', expected a .yaml"):
        load_topology("nope")
    with pytest.raises(ValueError, match="is not a file, expected a readable YAML file"):
        load_topology(str(tmp_path / "none.yaml"))


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The subcommand through a parser of its own (experiments/cli.py wires the same ``register``)."""
    parser = argparse.ArgumentParser(prog="pipescope")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_table_png_and_save(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_cli(["topology", "dgx-h100", "--nodes", "2", "--json"], capsys)
    assert code == 0 and json.loads(out)["bisection_bandwidth"] == 400 * GB and json.loads(out)["gpus"] == 16
    png, saved = tmp_path / "t.png", tmp_path / "t.graphml"
    code, out, _ = run_cli(["topology", "p3.16xlarge", "--nodes", "2", "--png", str(png), "--save", str(saved)], capsys)
    assert code == 0 and "bisection" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert same_graph(load_topology(str(saved)), load_topology("p3.16xlarge", nodes=2))


@pytest.mark.parametrize("argv, expected", [
    (["nope"], "NAME|FILE: got 'nope', expected a .yaml"), (["dgx-h100", "--nodes", "1_6"], "--nodes: got '1_6'"),
    (["dgx-h100", "--oversubscription", "nan"], "--oversubscription: got 'nan'"),
    (["dgx-h100", "--png", "x.gif"], "--png: got 'x.gif'"),
    (["dgx-h100", "--fabric", "torus"], "--fabric: got 'torus'"),  # the flag typed, not the config key it sets
    (["dgx-h100", "--nodes", "99999"], "--nodes: got 99999, expected an integer from 1 to 4,096"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["topology", *argv], capsys)
    assert code == 2 and out == "" and err.startswith("pipescope: error: ") and expected in err
    assert err.count("\n") == 1


def test_drawing_a_large_cluster_says_it_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "big.svg"
    draw(load_topology("dgx-a100", nodes=20, fabric="fat-tree"), path)
    assert "servers 0-7 of 20" in path.read_text()


def test_a_server_of_gpus_alone_needs_no_parts_and_a_reverse_takes_the_links_latency(tmp_path: Path) -> None:
    """`parts: {}` was required with nothing to name, and `reverse: {bandwidth: ...}` without a latency refused."""
    from pipescope.topologies.topology_io import load_topology

    path = tmp_path / "pair.yaml"
    path.write_text("device: a100\ngpus: 2\nedges:\n- {a: gpu0, b: gpu1, kind: nvlink, bandwidth: 100GB/s, "
                    "latency: 1us, reverse: {bandwidth: 50GB/s}}\n")
    graph = load_topology(str(path), 1)
    forward, back = graph.edges["n0.gpu0", "n0.gpu1"], graph.edges["n0.gpu1", "n0.gpu0"]
    assert (forward["bandwidth"], back["bandwidth"]) == (100e9, 50e9)
    assert forward["latency_ns"] == back["latency_ns"] == 1000.0
