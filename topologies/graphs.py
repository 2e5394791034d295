"""Real servers and fabrics as networkx graphs (docs/topologies.md).

A ``Server`` describes one machine: its GPUs, the other parts inside it (NVSwitch, PCIe switches, CPUs, NICs)
and the physical links between them. ``build_cluster`` replicates a server ``nodes`` times and joins the NICs
with a rail-optimised or a two-level fat-tree fabric. The graph contract (node ids, attributes, units) is in
docs/topologies.md; every number of the built-in machines is sourced there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from pipescope.simulator.readers.units import parse_bandwidth, parse_size

NODE_KINDS = ("gpu", "nvswitch", "pcie", "cpu", "nic", "leaf", "spine")
EDGE_KINDS = ("nvlink", "nvswitch", "pcie", "nic", "fabric")
SWITCH_KINDS = ("nvswitch", "pcie", "leaf", "spine")
SERVER_PART_KINDS = ("nvswitch", "pcie", "cpu", "nic")  # what a server may declare besides its GPUs
SERVER_LINK_KINDS = ("nvlink", "nvswitch", "pcie")  # "nic" and "fabric" links are built by the fabric
_PCIE_DEVICES = ("cpu", "gpu", "nic", "pcie")
# The node kinds each edge kind joins (docs/topologies.md), as sorted pairs: a mislabelled link is refused
EDGE_ENDS: dict[str, frozenset[tuple[str, str]]] = {
    "nvlink": frozenset({("gpu", "gpu")}),
    "nvswitch": frozenset({("gpu", "nvswitch"), ("nvswitch", "nvswitch")}),
    "pcie": frozenset((a, b) for a in _PCIE_DEVICES for b in _PCIE_DEVICES if a <= b)
    - {("gpu", "gpu"), ("nic", "nic")},
    "nic": frozenset({("leaf", "nic")}),
    "fabric": frozenset({("leaf", "spine")}),
}
FABRICS = ("rail", "fat-tree")

MAX_NODES = 4096  # servers in one graph
MAX_GPUS_PER_NODE = 256  # the largest real servers hold 8 to 16 GPUs; beyond this a file is mistyped
MAX_GRAPH_VERTICES = 250_000  # 4096 DGX servers are about 95,000; this bounds memory and build time
MAX_GRAPH_EDGES = 1_000_000  # directed edges; 4096 DGX servers on a fat-tree are about 370,000
MAX_OVERSUBSCRIPTION = 64.0  # real fabrics are 1:1 to 1:4
BANDWIDTH_RANGE = (1e6, 1e15)  # 1 MB/s to 1 PB/s: below, one transfer outlasts any run; above, no link exists
MAX_LATENCY_NS = 1e9  # one second per hop

# Per-hop latencies (ns). They are chosen so that shortest-latency routing takes the paths NCCL takes:
# a direct NVLink (1.5 us) beats PCIe through a shared switch (2 us); two NVLink hops (3 us) beat PCIe across
# the CPUs (5 us); across nodes, NVLink to the GPU on the destination's rail then the network (6.5 us) beats
# crossing rails through a spine (7 us), as NCCL's PXN does. docs/topologies.md has the table.
NVLINK_NS = 1500.0  # GPU to GPU over a direct NVLink
NVSWITCH_NS = 750.0  # GPU to NVSwitch; two of them make one GPU-to-GPU hop, as fast as a direct NVLink
PCIE_NS = 1000.0  # one PCIe hop (device to switch, switch to CPU, CPU to CPU, NIC to switch)
NIC_NS = 500.0  # NIC to its leaf switch: a same-rail GPU-to-GPU path totals 5 us
SWITCH_NS = 1000.0  # leaf to spine
LEAF_PORTS = 32  # NICs per fat-tree leaf: a 64-port switch with 32 ports down and 32 up


@dataclass(frozen=True)
class Link:
    """One physical link, both directions: ``a -> b`` at ``bandwidth`` (bytes/s, the line rate) and ``latency_ns``;
    ``b -> a`` the same unless ``reverse_bandwidth`` / ``reverse_latency_ns`` say otherwise. ``efficiency`` is the
    fraction of the line rate NCCL's transfers reach on it (nccl-tests' bus bandwidth over the line rate;
    docs/topologies.md), 1 where none was measured."""

    a: str
    b: str
    kind: str
    bandwidth: float
    latency_ns: float
    reverse_bandwidth: float | None = None
    reverse_latency_ns: float | None = None
    efficiency: float = 1.0

    def directed(self, prefix: str = "") -> tuple[tuple[str, str, dict], tuple[str, str, dict]]:
        """The two directed edges, with ``prefix`` before both node ids."""
        back_bw = self.bandwidth if self.reverse_bandwidth is None else self.reverse_bandwidth
        back_ns = self.latency_ns if self.reverse_latency_ns is None else self.reverse_latency_ns
        forward = {"bandwidth": self.bandwidth, "latency_ns": self.latency_ns, "kind": self.kind}
        backward = {"bandwidth": back_bw, "latency_ns": back_ns, "kind": self.kind}
        if self.efficiency != 1.0:
            forward["efficiency"] = backward["efficiency"] = self.efficiency
        return (prefix + self.a, prefix + self.b, forward), (prefix + self.b, prefix + self.a, backward)


@dataclass(frozen=True)
class Server:
    """One machine type: ``gpus`` GPUs (ids ``gpu0``...), its other parts (id, kind) with the NICs in rail order,
    its links, and how its NICs join a fabric."""

    name: str
    device: str
    gpus: int
    parts: tuple[tuple[str, str], ...]
    links: tuple[Link, ...]
    nic_bandwidth: float = 0.0
    default_fabric: str = "fat-tree"
    memory_bytes: int | None = None
    nic_latency_ns: float = NIC_NS
    switch_latency_ns: float = SWITCH_NS
    leaf_ports: int = LEAF_PORTS
    nic_efficiency: float = 1.0  # the fraction of the NIC's line rate NCCL reaches (``Link.efficiency``)

    @property
    def nics(self) -> list[str]:
        return [part for part, role in self.parts if role == "nic"]


def build_cluster(server: Server, nodes: int = 1, fabric: str | None = None,
                  oversubscription: float = 1.0) -> nx.DiGraph:
    """``nodes`` copies of ``server`` (ids ``n0.gpu0``...; GPU ranks node-major) on a ``fabric``.

    The caller checks the arguments (``topology_io.load_topology`` does); a server without NICs builds one node only.
    """
    fabric = fabric or server.default_fabric
    graph = nx.DiGraph(name=server.name, device=server.device, gpus_per_node=server.gpus, nodes=nodes,
                       fabric=fabric, oversubscription=float(oversubscription))
    if server.memory_bytes is not None:
        graph.graph["memory_bytes"] = server.memory_bytes
    edges = [e for link in server.links for e in link.directed()]
    for k in range(nodes):
        prefix = f"n{k}."
        graph.add_nodes_from((f"{prefix}gpu{i}", {"kind": "gpu", "node": k, "rank": k * server.gpus + i})
                             for i in range(server.gpus))
        graph.add_nodes_from((prefix + part, {"kind": role, "node": k}) for part, role in server.parts)
        graph.add_edges_from((prefix + a, prefix + b, attrs) for a, b, attrs in edges)
    if server.nics:
        _add_fabric(graph, server, nodes, fabric, oversubscription)
    return graph


def fabric_size(server: Server, nodes: int, fabric: str) -> tuple[int, int]:
    """(leaves, spines) of ``nodes`` servers on ``fabric``: one leaf per rail, or one per ``leaf_ports`` NICs;
    half as many spines as leaves (a full two-level fat tree of radix-R switches has R leaves and R/2 spines), but
    no more than a leaf has uplinks (``leaf_ports``), so the leaf-spine edges grow linearly past R leaves."""
    per_node = len(server.nics)
    if per_node == 0:
        return 0, 0
    leaves = per_node if fabric == "rail" else math.ceil(per_node * nodes / server.leaf_ports)
    return leaves, (min(math.ceil(leaves / 2), server.leaf_ports) if leaves > 1 else 0)


def _add_fabric(graph: nx.DiGraph, server: Server, nodes: int, fabric: str, ratio: float) -> None:
    """Leaves (rail i, or each run of ``leaf_ports`` NICs), each joined to every spine; a leaf's uplinks carry the
    bandwidth of its NICs divided by ``ratio``, split evenly over the spines."""
    leaves, spines = fabric_size(server, nodes, fabric)
    nics = server.nics
    graph.add_nodes_from((f"leaf{j}", {"kind": "leaf", "node": -1}) for j in range(leaves))
    graph.add_nodes_from((f"spine{s}", {"kind": "spine", "node": -1}) for s in range(spines))
    down = [0.0] * leaves  # NIC bandwidth under each leaf
    nic_edges = []
    for k in range(nodes):
        for i, nic in enumerate(nics):
            leaf = i if fabric == "rail" else (k * len(nics) + i) // server.leaf_ports
            down[leaf] += server.nic_bandwidth
            link = Link(f"n{k}.{nic}", f"leaf{leaf}", "nic", server.nic_bandwidth, server.nic_latency_ns,
                        efficiency=server.nic_efficiency)
            nic_edges.extend(link.directed())
    graph.add_edges_from(nic_edges)
    graph.add_edges_from(e for j in range(leaves) for s in range(spines)
                         for e in Link(f"leaf{j}", f"spine{s}", "fabric", down[j] / ratio / spines,
                                       server.switch_latency_ns).directed())


# --- the built-in machines (docs/topologies.md cites every number) ---

GB = parse_bandwidth("1GB/s")
GBIT = parse_bandwidth("1Gbit/s")
PCIE = {3: 16 * GB, 4: 32 * GB, 5: 64 * GB}  # x16 per direction, as the GPU datasheets quote it (V100, A100, H100)

# DGX-1V / p3.16xlarge NVLink hybrid cube-mesh, from `nvidia-smi topo -m` (NV1 / NV2): GPU pair -> NVLink2 links.
# Each GPU has 6 links; GPUs 0-3 and 4-7 are fully connected quads, plus i <-> i+4; 12 pairs have no NVLink.
CUBE_MESH = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2, (2, 6): 1,
             (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}
NVLINK2 = 25 * GB  # per link per direction


def _host(gpus: int, per_switch: int, pcie: float, cpu_link: float) -> tuple[list[tuple[str, str]], list[Link]]:
    """GPUs ``per_switch`` to a PCIe switch, the switches split over two CPUs, the CPUs joined (kind "pcie": the
    contract has no CPU-link kind)."""
    switches = gpus // per_switch
    parts = [(f"pcie{j}", "pcie") for j in range(switches)] + [("cpu0", "cpu"), ("cpu1", "cpu")]
    links = [Link(f"gpu{i}", f"pcie{i // per_switch}", "pcie", pcie, PCIE_NS) for i in range(gpus)]
    links += [Link(f"pcie{j}", f"cpu{j * 2 // switches}", "pcie", pcie, PCIE_NS) for j in range(switches)]
    links.append(Link("cpu0", "cpu1", "pcie", cpu_link, PCIE_NS))
    return parts, links


def _nvswitch_box(name: str, device: str, nvswitch: float, pcie: float, cpu_link: float, nic: float,
                  nvswitch_efficiency: float, nic_efficiency: float) -> Server:
    """DGX/HGX: 8 GPUs on NVSwitch (one node with each GPU's aggregate), two GPUs per PCIe switch, one NIC per GPU,
    rail-optimised. NIC i hangs off GPU i's PCIe port (GPUDirect RDMA under their shared switch): NCCL pins each
    GPU to its own NIC, and a graph where both NICs of a switch were equally near would let ECMP put two GPUs'
    traffic on one NIC, which NCCL never does. Other GPUs reach NIC i through GPU i (NVSwitch first, as PXN)."""
    parts, host = _host(8, 2, pcie, cpu_link)
    parts = [("nvswitch0", "nvswitch"), *parts, *((f"nic{i}", "nic") for i in range(8))]
    links = [Link(f"gpu{i}", "nvswitch0", "nvswitch", nvswitch, NVSWITCH_NS, efficiency=nvswitch_efficiency)
             for i in range(8)] + host
    links += [Link(f"gpu{i}", f"nic{i}", "pcie", pcie, PCIE_NS) for i in range(8)]
    return Server(name, device, 8, tuple(parts), tuple(links), nic, "rail", nic_efficiency=nic_efficiency)


def _cube_mesh_box(name: str, memory: int | None, cpu_link: float, nic: float) -> Server:
    """p3.16xlarge / p3dn.24xlarge: the DGX-1V NVLink mesh, two GPUs per PCIe switch, one NIC on CPU 0."""
    parts, host = _host(8, 2, PCIE[3], cpu_link)
    links = [Link(f"gpu{a}", f"gpu{b}", "nvlink", n * NVLINK2, NVLINK_NS) for (a, b), n in CUBE_MESH.items()] + host
    links.append(Link("cpu0", "nic0", "pcie", PCIE[3], PCIE_NS))
    return Server(name, "v100", 8, (*parts, ("nic0", "nic")), tuple(links), nic, "fat-tree", memory)


def _pcie_box() -> Server:
    """8 PCIe A100s, four per PCIe switch, one switch per CPU, one 100 Gbit/s NIC on CPU 0; no NVLink."""
    parts, links = _host(8, 4, PCIE[4], 67.2 * GB)
    links.append(Link("cpu0", "nic0", "pcie", PCIE[4], PCIE_NS))
    return Server("pcie-box", "a100", 8, (*parts, ("nic0", "nic")), tuple(links), 100 * GBIT, "fat-tree")


# What NCCL reaches of the line rates (docs/topologies.md, "NCCL's share of a link"): an 8-GPU all-reduce's bus
# bandwidth over the GPU's NVLink rate, 234.89 of 300 GB/s on DGX A100 and 367.2 of 450 on 8 H200 without NVLink
# SHARP (stas00/ml-engineering network/README.md); per NIC, 24 of 25 GB/s for HDR (NVIDIA/nccl-tests#160) and 47 of
# 50 for NDR (NVIDIA/nccl-tests#290: "46-48GB/s per NIC").
NVLINK3_NCCL, NVLINK4_NCCL, HDR_NCCL, NDR_NCCL = 0.783, 0.816, 0.96, 0.94

BUILTINS: dict[str, Server] = {s.name: s for s in (
    _nvswitch_box("dgx-a100", "a100", 300 * GB, PCIE[4], 144 * GB, 200 * GBIT, NVLINK3_NCCL, HDR_NCCL),
    _nvswitch_box("dgx-h100", "h100", 450 * GB, PCIE[5], 128 * GB, 400 * GBIT, NVLINK4_NCCL, NDR_NCCL),
    _nvswitch_box("hgx-h200", "h200", 450 * GB, PCIE[5], 128 * GB, 400 * GBIT, NVLINK4_NCCL, NDR_NCCL),
    _cube_mesh_box("p3.16xlarge", parse_size("16GiB"), 38.4 * GB, 25 * GBIT),
    _cube_mesh_box("p3dn.24xlarge", None, 62.4 * GB, 100 * GBIT),
    _pcie_box(),
)}
ALIASES = {"p3-16xlarge": "p3.16xlarge", "p3dn-v100": "p3dn.24xlarge"}


def topology_names() -> list[str]:
    """Every built-in name ``load_topology`` accepts, aliases included."""
    return sorted([*BUILTINS, *ALIASES])


def builtin(name: str) -> Server | None:
    """The built-in server called ``name`` (or an alias of one), else None."""
    return BUILTINS.get(ALIASES.get(name, name))
