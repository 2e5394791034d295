"""Clusters as networkx graphs: GPUs, NVLink switches, NICs and a fabric; placement of pipeline
devices on GPUs; the path (bandwidth, latency) between two of them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import networkx as nx
import yaml

from pipescope.simulator.network import FifoLinks, Link
from pipescope.topologies.devices import DEVICES, DeviceSpec
from pipescope.simulator.units import parse_bandwidth, parse_time

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


def load_machine(name_or_path: str) -> Machine:
    """A built-in machine by name (see ``machine_names()``) or a YAML file path."""
    is_file = name_or_path.endswith((".yaml", ".yml"))
    path = name_or_path if is_file else os.path.join(MACHINES_DIR, f"{name_or_path}.yaml")
    if not os.path.exists(path):
        choices = ", ".join(machine_names())
        raise ValueError(f"cluster.topology(={name_or_path!r}) is neither a file nor one of {choices}")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as err:
        reason = str(err).splitlines()[0]
        raise ValueError(f"cluster.topology: {path!r} is not a readable YAML file ({reason})") from None
    try:
        machine = Machine(
            name=os.path.splitext(os.path.basename(path))[0],
            device=str(raw["device"]),
            gpus_per_node=int(raw["gpus_per_node"]),
            intra_bandwidth=parse_bandwidth(raw["intra_node"]["bandwidth"]),
            intra_latency_ns=round(parse_time(raw["intra_node"]["latency"]) * 1e9),
            inter_bandwidth=parse_bandwidth(raw["inter_node"]["bandwidth"]),
            inter_latency_ns=round(parse_time(raw["inter_node"]["latency"]) * 1e9),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"cluster.topology: {path!r}: {err!r}; expected device, gpus_per_node, "
                         f"intra_node.bandwidth/latency, inter_node.bandwidth/latency") from None
    _check_machine(machine, path)
    return machine


def _check_machine(machine: Machine, path: str) -> None:
    if machine.device not in DEVICES:
        raise ValueError(f"cluster.topology: {path!r}: device {machine.device!r}, expected one of {', '.join(DEVICES)}")
    for key, value in (("gpus_per_node", machine.gpus_per_node), ("intra_node.bandwidth", machine.intra_bandwidth),
                       ("inter_node.bandwidth", machine.inter_bandwidth)):
        if value <= 0:
            raise ValueError(f"cluster.topology: {path!r}: {key} is {value}, expected > 0")


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
