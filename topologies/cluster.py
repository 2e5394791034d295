"""Clusters as networkx graphs: GPUs, NVLink switches, NICs and a fabric; placement of pipeline
devices on GPUs; the path (bandwidth, latency) between two of them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import networkx as nx
from pipescope.simulator.network import FifoLinks, Link
from pipescope.topologies.devices import DEVICES, DeviceSpec
from pipescope.simulator.safe_yaml import YamlError, read_yaml_file
from pipescope.simulator.units import parse_bandwidth, parse_time, short_repr

MACHINES_DIR = os.path.join(os.path.dirname(__file__), "machines")
PLACEMENTS = ("linear", "spread")


@dataclass(frozen=True)
class ClusterConfig:
    """The ``cluster`` section: a machine (built-in name or YAML file), how many nodes, replicas and placement.

    ``memory`` overrides the device memory (bytes; YAML accepts ``40GiB``).
    """

    topology: str = "dgx-h100"
    nodes: int = 1
    data_parallel: int = 1
    placement: str = "linear"
    memory: int | None = field(default=None, metadata={"unit": "size"})

    def device(self) -> DeviceSpec:
        """The datasheet of the machine's GPU (ValueError naming the key if the machine cannot be loaded)."""
        return DEVICES[load_machine(self.topology).device]

    def build(self, devices: int) -> Cluster:
        """The cluster for a pipeline of ``devices`` devices per replica (ValueError naming the key if it cannot)."""
        return Cluster(load_machine(self.topology), self.nodes, self.placement, devices * self.data_parallel)


@dataclass(frozen=True)
class Machine:
    """One server type: its GPU and the two bandwidth tiers."""

    name: str
    device: str
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency_ns: int
    inter_bandwidth: float
    inter_latency_ns: int


def machine_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(MACHINES_DIR) if f.endswith(".yaml"))


MAX_GPUS_PER_NODE = 256  # the largest real nodes hold 8 to 16; beyond this a file is mistyped
MAX_GPUS = 100_000  # GPUs one run places (stages x data_parallel); the graph of 100,000 takes about 1.5 s
BANDWIDTH_RANGE = (1e6, 1e15)  # 1 MB/s to 1 PB/s: below, one transfer outlasts any run; above, no link exists
MAX_LATENCY_S = 1.0


def load_machine(name_or_path: str) -> Machine:
    """A built-in machine by name (see ``machine_names()``) or a YAML file path.

    Raises:
        ValueError: one line naming ``cluster.topology``, the file, the key, the value and what was expected.
    """
    is_file = name_or_path.lower().endswith((".yaml", ".yml"))
    path = name_or_path if is_file else os.path.join(MACHINES_DIR, f"{name_or_path}.yaml")
    if is_file and not os.path.isfile(path):
        raise ValueError(f"cluster.topology: {short_repr(path)} is not a file, expected a readable YAML file")
    if not os.path.isfile(path):
        choices = ", ".join(machine_names())
        raise ValueError(f"cluster.topology(={short_repr(name_or_path)}) is neither a .yaml file nor one of {choices}")
    try:
        raw = read_yaml_file(path)
    except YamlError as err:
        raise ValueError(f"cluster.topology: {err}") from None
    where = f"cluster.topology: {path!r}"
    _require_keys(raw, ("device", "gpus_per_node", "intra_node", "inter_node"), where, "")
    for tier in ("intra_node", "inter_node"):
        _require_keys(raw[tier], ("bandwidth", "latency"), where, f"{tier}.")
    device = raw["device"]
    if not isinstance(device, str) or device not in DEVICES:
        raise ValueError(f"{where}: device: got {short_repr(device)}, expected one of {', '.join(DEVICES)}")
    gpus = raw["gpus_per_node"]
    if type(gpus) is not int or not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise ValueError(f"{where}: gpus_per_node: got {short_repr(gpus)}, expected an integer from 1 to "
                         f"{MAX_GPUS_PER_NODE}")
    intra_bw, intra_lat = _tier(raw["intra_node"], where, "intra_node")
    inter_bw, inter_lat = _tier(raw["inter_node"], where, "inter_node")
    return Machine(os.path.splitext(os.path.basename(path))[0], device, gpus, intra_bw, intra_lat, inter_bw, inter_lat)


def _require_keys(raw: object, keys: tuple[str, ...], where: str, prefix: str) -> None:
    """ValueError unless ``raw`` is a mapping with exactly ``keys``."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {prefix.rstrip('.') or 'file'}: got {short_repr(raw)}, expected a mapping of "
                         f"{', '.join(prefix + k for k in keys)}")
    missing = [k for k in keys if k not in raw]
    unknown = [k for k in raw if k not in keys]
    if missing or unknown:
        problem = f"{prefix}{missing[0]} is missing" if missing else f"{prefix}{unknown[0]} is not a key"
        raise ValueError(f"{where}: {problem}, expected keys {', '.join(prefix + k for k in keys)}")


def _tier(raw: dict, where: str, tier: str) -> tuple[float, int]:
    """(bandwidth in B/s, latency in ns) of one tier, each within its range."""
    try:
        bandwidth = parse_bandwidth(raw["bandwidth"])
    except ValueError as err:
        raise ValueError(f"{where}: {tier}.bandwidth: {err}") from None
    try:
        latency = parse_time(raw["latency"])
    except ValueError as err:
        raise ValueError(f"{where}: {tier}.latency: {err}") from None
    low, high = BANDWIDTH_RANGE
    if not low <= bandwidth <= high:
        raise ValueError(f"{where}: {tier}.bandwidth: got {short_repr(raw['bandwidth'])}, expected 1MB/s to 1PB/s")
    if latency > MAX_LATENCY_S:
        raise ValueError(f"{where}: {tier}.latency: got {short_repr(raw['latency'])}, expected at most 1 s")
    return bandwidth, round(latency * 1e9)


def machine_graph(machine: Machine, nodes: list[int] | range) -> nx.Graph:
    """GPUs ``(node, i)`` of the given nodes joined by their node's NVLink switch, and each through its own
    NIC to the fabric.

    Edge latencies are half a hop so a GPU-switch-GPU path costs one hop's latency.
    """
    graph = nx.Graph()
    for n in nodes:
        switch = ("nvswitch", n)
        for i in range(machine.gpus_per_node):
            gpu, nic = ("gpu", n * machine.gpus_per_node + i), ("nic", n, i)
            graph.add_edge(gpu, switch, bandwidth=machine.intra_bandwidth, latency_ns=machine.intra_latency_ns / 2)
            graph.add_edge(gpu, nic, bandwidth=machine.inter_bandwidth, latency_ns=0)
            graph.add_edge(nic, "fabric", bandwidth=machine.inter_bandwidth, latency_ns=machine.inter_latency_ns / 2)
    return graph


class Cluster:
    """A machine graph plus where each pipeline device runs."""

    def __init__(self, machine: Machine, nodes: int = 1, placement: str = "linear", devices: int | None = None):
        if nodes < 1:
            raise ValueError(f"cluster.nodes(={nodes}) must be >= 1")
        if placement not in PLACEMENTS:
            raise ValueError(f"cluster.placement(={placement!r}) must be one of {', '.join(PLACEMENTS)}")
        self.machine, self.nodes, self.placement = machine, nodes, placement
        self.num_gpus = nodes * machine.gpus_per_node
        if devices is not None and devices > MAX_GPUS:
            raise ValueError(f"cluster.data_parallel: stages x data_parallel = {devices:,} GPUs, expected at most "
                             f"{MAX_GPUS:,}")
        if devices is not None and devices > self.num_gpus:
            raise ValueError(f"pipeline needs {devices} GPUs but cluster.nodes(={nodes}) x "
                             f"{machine.gpus_per_node} GPUs of {machine.name} gives {self.num_gpus}")
        # Only the nodes the pipeline uses: a 100,000-node cluster running 4 stages needs 1 to 4 of them.
        used = range(nodes) if devices is None else sorted({self.gpu_of(d) // machine.gpus_per_node
                                                            for d in range(devices)})
        self.graph = machine_graph(machine, used)
        self.link = lru_cache(maxsize=None)(self._link)

    @property
    def device_spec(self) -> DeviceSpec:
        return DEVICES[self.machine.device]

    def network(self) -> FifoLinks:
        """FIFO links with each device pair's routed path (its slowest edge, its summed latency)."""
        return FifoLinks.over(self.link)

    def gpu_of(self, device: int) -> int:
        """linear: device d on GPU d (fills a node first); spread: round-robin over nodes."""
        if self.placement == "linear":
            return device
        per = self.machine.gpus_per_node
        return (device % self.nodes) * per + device // self.nodes

    def _link(self, src: int, dst: int) -> Link:
        """The lowest-latency path between two pipeline devices: its slowest edge and summed latency."""
        path = nx.shortest_path(self.graph, ("gpu", self.gpu_of(src)), ("gpu", self.gpu_of(dst)), weight="latency_ns")
        edges = [self.graph.edges[a, b] for a, b in zip(path, path[1:])]
        return Link(min(e["bandwidth"] for e in edges), round(sum(e["latency_ns"] for e in edges)))
