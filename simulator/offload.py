"""ZeRO-Offload: each GPU's optimizer state and its step on the host (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", arXiv:2101.06840; docs/parallelism.md, "Offload"), and ZeRO-Infinity's parameters
there too (Rajbhandari et al. 2021, arXiv:2104.07857: under ZeRO-3, each gather first copies the GPU's shard up).

The GPU keeps its weights and gradients (as its ZeRO stage shards them); the host keeps, for the GPU's shard, the
fp32 master weights, Adam's moments and an fp32 gradient buffer, and steps them. An iteration's step then is: the
gradients down over PCIe, the optimizer's passes over the host's memory, the updated weights back up. The copies
and the host's memory are shared: every GPU of a node steps at once in a flush schedule, so each gets its share of
the PCIe links on its path to the CPU and of the host's memory rate.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import networkx as nx

from pipescope.simulator.gpu_rates import Roofline
from pipescope.simulator.kernels import Kernel, optimizer_kernels
from pipescope.simulator.models import PRECISIONS

OFFLOADS = ("none", "optimizer", "parameters")  # ``parallel.offload``; parameters: the optimizer's too
HOST_GRAD_BYTES = 4  # the host steps fp32 gradients: ZeRO-Offload keeps its partition's gradients in fp32 on the CPU


@dataclass(frozen=True)
class HostOffload:
    """What one GPU gets of its host: ``pcie_rate`` bytes/s each way on its path to the CPU, ``memory_rate``
    bytes/s of the host's memory, while every GPU of the node does the same."""

    pcie_rate: float
    memory_rate: float
    parameters: bool = False  # ZeRO-Infinity: the weight shards on the host too

    def step_parts(self, params: int, precision: str, grad_bytes: int) -> list[tuple[str, list[Kernel], Roofline]]:
        """(component, kernels, the rate that times them) of one offloaded step over ``params`` parameters whose
        gradients the GPU holds in ``grad_bytes`` each. With the ``parameters`` on the host too (ZeRO-Infinity) the
        updated weights stay there, and each gather copies them up (``copy_ns``)."""
        pcie = Roofline(1.0, 1.0, self.pcie_rate)
        weights = PRECISIONS[precision].weight_bytes
        parts = [("offload", [Kernel("gradients to host", "optimizer", 0, params * grad_bytes)], pcie),
                 ("optimizer (host)", optimizer_kernels(params, precision, HOST_GRAD_BYTES),
                  Roofline(1.0, 1.0, self.memory_rate))]
        return parts if self.parameters else parts + [("offload", [Kernel("weights to GPU", "optimizer", 0,
                                                                     params * weights)], pcie)]


def host_bytes(params: int, precision: str, parameters: bool = False) -> int:
    """What the host holds for ``params`` parameters of one GPU: the optimizer state and the fp32 gradients, and
    with the ``parameters`` offloaded their weights in the compute precision."""
    per_param = PRECISIONS[precision].optimizer_bytes + HOST_GRAD_BYTES
    return params * (per_param + (PRECISIONS[precision].weight_bytes if parameters else 0))


def copy_ns(nbytes: int, rate: float) -> int:
    """ns to copy ``nbytes`` between the host and a GPU at ``rate`` bytes/s (its PCIe share, ``pcie_share``)."""
    return math.ceil(nbytes * 1e9 / rate) if nbytes > 0 else 0


def pcie_share(graph: nx.DiGraph) -> float | None:
    """The bytes/s each GPU of a node moves to its CPU while all of them do: along each GPU's shortest PCIe path to
    a CPU, every link's bandwidth over the GPUs whose paths cross it; the least of these over the node's GPUs.
    None when the machine has no CPU on its PCIe links."""
    node = nx.subgraph_view(graph, filter_node=lambda n: graph.nodes[n].get("node") == 0,
                            filter_edge=lambda a, b: graph.edges[a, b].get("kind") == "pcie")
    cpus = [n for n, part in node.nodes(data="kind") if part == "cpu"]
    gpus = [n for n, part in node.nodes(data="kind") if part == "gpu"]
    if not cpus or not gpus:
        return None
    paths = []
    for gpu in gpus:
        routes = nx.single_source_shortest_path(node, gpu)  # one search: every CPU's path, the nearest is taken
        reachable = [routes[cpu] for cpu in cpus if cpu in routes]
        if not reachable:
            return None
        path = min(reachable, key=lambda route: (len(route), route[-1]))
        paths.append(list(zip(path, path[1:])))
    users = Counter(edge for path in paths for edge in path)
    return min(node.edges[edge]["bandwidth"] / users[edge] for edge in users)
