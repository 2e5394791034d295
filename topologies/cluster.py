"""A cluster for one run: the topology graph (``topology_io``), where each simulated device runs on it (placement),
and the routed network over it (docs/network.md, docs/topologies.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import networkx as nx

from pipescope.simulator.context import span_problem
from pipescope.simulator.faults import FaultsConfig, apply_link_faults, parse_stragglers
from pipescope.simulator.mesh import NO_SHARDING, Sharding
from pipescope.simulator.replicas import DDP_BUCKET_BYTES, GradSync
from pipescope.simulator.routed import RoutedNetwork
from pipescope.simulator.readers.units import short_repr
from pipescope.topologies.devices import DEVICES, DeviceSpec
from pipescope.topologies.graphs import MAX_NODES, MAX_OVERSUBSCRIPTION
from pipescope.topologies.topology_io import machine_device, shared_topology

PLACEMENTS = ("linear", "spread")
COLLECTIVE_ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
MAX_GPUS = 100_000  # GPUs one run places (stages x parallel.tensor x data_parallel)
# Inclusive (low, high) of the cluster section's numbers (docs/cli.md, "Limits"), beside the section they bound: the
# config's RANGES and FLOAT_RANGES take them from here.
CLUSTER_RANGES: dict[str, tuple[int, int]] = {
    "nodes": (1, MAX_NODES), "data_parallel": (1, 100_000), "memory": (1 << 20, 1 << 50),
    "host_memory": (1 << 20, 1 << 54), "bucket_size": (1, 1 << 50), "host_cores": (1, 1 << 16)}
CLUSTER_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "oversubscription": (1.0, MAX_OVERSUBSCRIPTION), "peak_flops": (1e9, 1e18), "memory_bandwidth": (1e6, 1e15),
    "host_memory_bandwidth": (1e6, 1e15)}


def gpu_memory_bytes(graph: nx.DiGraph) -> int:
    """The GPU memory of a machine's graph (a topology may override the datasheet's: p3.16xlarge has 16 GB V100s)."""
    return int(graph.graph.get("memory_bytes") or DEVICES[graph.graph["device"]].memory_bytes)


@dataclass(frozen=True)
class ClusterConfig:
    """The ``cluster`` section: the machine, how many of them on which fabric, data parallelism and placement.

    ``topology`` is a built-in name or a YAML/GraphML file; ``placement`` is ``linear`` (device d on GPU d),
    ``spread`` (round-robin over the nodes) or an explicit comma-separated list of GPU ranks, one per device
    (replica r's device d is r * stages + d). ``memory`` overrides the device memory (YAML accepts ``40GiB``),
    ``peak_flops`` its dense peak at the run's precision (``2250TFLOP/s``) and ``memory_bandwidth`` its HBM bandwidth
    (``8TB/s``): with them a topology of a known GPU stands for one pipescope has no datasheet of.
    ``collective`` forces an all-reduce algorithm (``auto``: the fastest, as NCCL's tuner picks);
    ``bucket_size`` and ``overlap_grad_sync`` shape the data-parallel gradient all-reduce. ``host_cores``: the
    devices are CPU ranks on one host sharing this many cores (``simulator.host_cores``; unset: each computes on
    its own). ``host_memory`` and ``host_memory_bandwidth`` override a node's host memory and the rate a streaming
    pass reaches in it (``topologies/hosts.py``), which an offloaded optimizer uses. ``fold``: simulate one of
    replicas that are alike and copy its times (``simulator.fold``; the same result); false simulates every one.
    """

    topology: str = "dgx-h100"
    nodes: int = 1
    fabric: str | None = None
    oversubscription: float | None = None
    data_parallel: int = 1
    placement: str = field(default="linear", metadata={"unit": "ranks"})  # a list of ranks reads as "0,8,1,9"
    memory: int | None = field(default=None, metadata={"unit": "size"})
    peak_flops: float | None = field(default=None, metadata={"unit": "flops"})
    memory_bandwidth: float | None = field(default=None, metadata={"unit": "bandwidth"})
    collective: str = "auto"
    bucket_size: int = field(default=DDP_BUCKET_BYTES, metadata={"unit": "size"})
    overlap_grad_sync: bool = True
    host_cores: int | None = None
    fold: bool = True
    host_memory: int | None = field(default=None, metadata={"unit": "size"})
    host_memory_bandwidth: float | None = field(default=None, metadata={"unit": "bandwidth"})

    def device(self) -> DeviceSpec:
        """The datasheet of the machine's GPU (ValueError naming the key if the machine cannot be loaded)."""
        return DEVICES[machine_device(self.topology)]

    def grad_sync(self, sharding: Sharding = NO_SHARDING) -> GradSync:
        """The gradient sync these keys ask for, under ZeRO's ``sharding`` (``parallel``; ``GradSync``)."""
        return GradSync(self.bucket_size, self.overlap_grad_sync, sharding)

    def build(self, devices: int, tensor: int = 1, context: int = 1) -> Cluster:
        """The cluster for ``devices`` devices per replica, each ``tensor`` x ``context`` GPUs of one node or of
        whole nodes (ValueError naming the key if it cannot)."""
        total, per_device = devices * self.data_parallel, tensor * context
        if total * per_device > MAX_GPUS:
            raise ValueError(f"cluster.data_parallel: {_product(tensor, context)} = {total * per_device:,} GPUs, "
                             f"expected at most {MAX_GPUS:,}")
        graph = shared_topology(self.topology, self.nodes, self.fabric, self.oversubscription)  # read, not changed
        return Cluster(graph, self.placement, total, tensor, context)


def _product(tensor: int, context: int = 1) -> str:
    """How a run's GPU count is made, for messages (t = 1 keeps the words it always had)."""
    return "stages x " + "".join(f"{key} x " for key, degree in (("parallel.tensor", tensor),
                                                                 ("parallel.context", context)) if degree > 1) \
        + "data_parallel"


def gpu_nodes(graph: nx.DiGraph) -> list[str]:
    """The graph's GPU nodes in rank order."""
    gpus = [(data["rank"], node) for node, data in graph.nodes(data=True) if data.get("kind") == "gpu"]
    return [node for _, node in sorted(gpus)]


class Cluster:
    """A topology graph plus the GPU rank each simulated device runs on: with ``tensor`` t, the first of the t
    consecutive GPUs the device stands for, in one node or filling whole nodes (its p2p transfers and gradient
    all-reduces start there)."""

    def __init__(self, graph: nx.DiGraph, placement: str, devices: int, tensor: int = 1, context: int = 1):
        self.graph = graph
        self.gpus = gpu_nodes(graph)
        self.name = graph.graph.get("name", "cluster")
        self.tensor = tensor = tensor * context  # the GPUs a device stands for (its lanes)
        per_node, nodes = graph.graph["gpus_per_node"], graph.graph["nodes"]
        problem = span_problem(tensor // context, context, per_node, self.name)
        if problem:
            raise ValueError(problem)
        if devices * tensor > len(self.gpus):
            raise ValueError(f"cluster.nodes: the run needs {devices * tensor:,} GPUs "
                             f"({_product(tensor // context, context)}) but {nodes} x {per_node} GPUs of {self.name} "
                             f"give {len(self.gpus):,}; expected cluster.nodes >= {-(-devices * tensor // per_node)}")
        self.rank_of = placement_ranks(placement, devices, nodes, per_node, tensor)

    @property
    def device_spec(self) -> DeviceSpec:
        return DEVICES[self.graph.graph["device"]]

    @property
    def memory_bytes(self) -> int:
        return gpu_memory_bytes(self.graph)

    def network(self, seed: int = 0, algorithm: str = "auto", faults: FaultsConfig | None = None) -> RoutedNetwork:
        """Routed, fair-shared flows between the placed devices, with the link faults applied; under tensor
        parallelism every GPU of a device moves its own share (``RoutedNetwork``'s lanes)."""
        faults = faults or FaultsConfig()
        graph = apply_link_faults(self.graph, faults.degraded_links, faults.failed_links)
        lanes = [[self.gpus[rank + i] for i in range(1, self.tensor)] for rank in self.rank_of] if self.tensor > 1 \
            else []
        return RoutedNetwork(graph, [self.gpus[rank] for rank in self.rank_of], seed, algorithm, lanes)

    def tensor_network(self, devices: int, seed: int = 0, algorithm: str = "auto",
                       faults: FaultsConfig | None = None) -> RoutedNetwork:
        """The routed network over the t GPUs of each of the first ``devices`` devices, link faults applied: its
        device d * t + i is device d's i-th GPU. Their tensor-parallel collectives run there (simulator/parallel.py).
        """
        faults = faults or FaultsConfig()
        graph = apply_link_faults(self.graph, faults.degraded_links, faults.failed_links)
        return RoutedNetwork(graph, self.tensor_gpus(devices), seed, algorithm)

    def tensor_gpus(self, devices: int) -> list[str]:
        """The graph nodes of ``tensor_network``'s devices: each of the first ``devices`` devices' t GPUs."""
        return [self.gpus[rank + i] for rank in self.rank_of[:devices] for i in range(self.tensor)]

    def slowdown(self, faults: FaultsConfig) -> dict[int, float]:
        """Per device, the slowdown of the straggler GPU it runs on (ValueError naming a GPU no device uses)."""
        device_of = {rank + i: d for d, rank in enumerate(self.rank_of) for i in range(self.tensor)}
        slow = {}
        for rank, factor in parse_stragglers(faults.stragglers).items():
            if rank not in device_of:
                raise ValueError(f"faults.stragglers: GPU {rank} runs no device of this run (it uses GPUs "
                                 f"{rank_ranges(sorted(device_of))})")
            slow[device_of[rank]] = factor
        return slow


def placement_ranks(placement: str, devices: int, nodes: int, per_node: int, tensor: int = 1) -> list[int]:
    """The GPU rank of each device (the first of its ``tensor`` GPUs): ``linear``, ``spread`` or an explicit list
    (ValueError naming the key)."""
    if placement == "linear":
        return [d * tensor for d in range(devices)]
    if placement == "spread":  # device d on node d % nodes, filling each node's GPUs in order
        if tensor > per_node:
            raise ValueError(f"cluster.placement: got spread with devices of {tensor} GPUs, which fill whole nodes; "
                             f"expected linear or a list of GPU ranks (spread places devices within nodes)")
        return [(d % nodes) * per_node + d // nodes * tensor for d in range(devices)]
    if not re.fullmatch(r"[0-9]{1,9}(\s*,\s*[0-9]{1,9})*", placement.strip()):
        raise ValueError(f"cluster.placement: got {short_repr(placement)}, expected linear, spread or a "
                         f"comma-separated list of GPU ranks, one per device")
    ranks = [int(x) for x in placement.split(",")]
    if len(ranks) != devices:
        raise ValueError(f"cluster.placement: got {len(ranks)} GPU ranks, expected {devices} (one per device: "
                         f"stages x data_parallel)")
    bad = next((r for r in ranks if r >= nodes * per_node), None)
    if bad is not None:
        raise ValueError(f"cluster.placement: GPU {bad} does not exist, expected ranks 0 to {nodes * per_node - 1}")
    if len(set(ranks)) != len(ranks):
        twice = next(r for r in ranks if ranks.count(r) > 1)
        raise ValueError(f"cluster.placement: GPU {twice} is given twice, expected one device per GPU")
    return _check_groups(ranks, per_node, tensor, nodes * per_node) if tensor > 1 else ranks


def _check_groups(ranks: list[int], per_node: int, tensor: int, nodes_gpus: int) -> list[int]:
    """Explicit ranks under tensor parallelism: each device's GPUs rank..rank+t-1 in one node (or, past a node's
    GPUs, from the start of a node over whole nodes), no GPU twice."""
    used: dict[int, int] = {}
    for rank in ranks:
        if tensor > per_node and rank % per_node:
            raise ValueError(f"cluster.placement: GPU {rank} starts a device of {tensor} GPUs inside a node, expected "
                             f"ranks at the start of a node (a device fills {tensor // per_node} whole nodes)")
        if tensor > per_node and rank + tensor > nodes_gpus:
            raise ValueError(f"cluster.placement: GPU {rank} starts a device of {tensor} GPUs past the last node, "
                             f"expected ranks whose GPUs rank..rank+{tensor - 1} exist")
        if tensor <= per_node and rank % per_node + tensor > per_node:
            raise ValueError(f"cluster.placement: GPU {rank} starts a device's {tensor} GPUs past its "
                             f"node's last GPU, expected ranks whose GPUs rank..rank+{tensor - 1} share one node")
        for gpu in range(rank, rank + tensor):
            if gpu in used:
                raise ValueError(f"cluster.placement: GPU {gpu} is in the GPUs of devices starting "
                                 f"at {used[gpu]} and {rank}, expected one device per GPU")
            used[gpu] = rank
    return ranks


def rank_ranges(ranks: list[int]) -> str:
    """``0-7, 16`` for [0..7, 16]."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(f"{start}-{rank}" if rank > start else f"{rank}")
            start = None
    return ", ".join(parts)
