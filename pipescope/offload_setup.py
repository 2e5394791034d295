"""``parallel.offload`` applied to a run: the host's rates from the machine (``topologies/hosts.py``, overridable in
``cluster``), the checks, and whether the node's host memory holds what its GPUs offload (docs/parallelism.md,
"Offload"). ``pipescope.runner`` calls ``host_offload`` when it builds the analytic costs and
``check_host_memory`` once the stages are known."""

from __future__ import annotations

from pipescope.config import Config, ConfigError
from pipescope.simulator.ir import WeightUpdate
from pipescope.simulator.offload import HostOffload, host_bytes, pcie_share
from pipescope.simulator.readers.units import format_bytes
from pipescope.topologies.cluster import Cluster
from pipescope.topologies.hosts import HOSTS


def check_offload(config: Config, analytic: bool, weight_update: WeightUpdate) -> None:
    """Offload needs the analytic costs (the others time a GPU's step) and a flush schedule (one step an
    iteration, which the host takes); ConfigError naming the key otherwise (offloaded weights' need of ZeRO-3 and
    replicas is the config's own check, ``config._check_sharding``)."""
    if not config.parallel.offloads_optimizer:
        return
    if not analytic:
        raise ConfigError(f"parallel.offload: got {config.parallel.offload} under costs.kind {config.costs.kind}, "
                          f"expected none (only analytic costs time the host's step)")
    if weight_update is not WeightUpdate.FLUSH:
        raise ConfigError(f"parallel.offload: got {config.parallel.offload} with schedule.name {config.schedule.name}, "
                          f"expected a flush schedule (one step an iteration, which the host takes)")


def host_offload(config: Config, cluster: Cluster) -> HostOffload | None:
    """What each GPU gets of its host's PCIe links and memory while all of the node's GPUs step (None: no offload).

    Raises:
        ConfigError: the machine has no CPU on its PCIe links, or no host facts and no ``cluster`` override.
    """
    if not config.parallel.offloads_optimizer:
        return None
    share = pcie_share(cluster.graph)
    if share is None:
        raise ConfigError(f"parallel.offload: got {config.parallel.offload} on cluster.topology "
                          f"{config.cluster.topology}, expected a machine whose GPUs reach a CPU over PCIe links (kind "
                          f"pcie to a node of kind cpu)")
    rate = config.cluster.host_memory_bandwidth or _host_fact(config, cluster, "memory_rate", "host_memory_bandwidth")
    return HostOffload(share, rate / cluster.graph.graph["gpus_per_node"], config.parallel.offloads_parameters)


def check_host_memory(config: Config, cluster: Cluster, device_params: list[int]) -> None:
    """ConfigError unless a node's host memory holds what its GPUs offload, counting every GPU of the node as one
    holding the shard of the device with the most parameters (a bound: a node's GPUs may hold fewer)."""
    shards = config.parallel.optimizer_shards(config.cluster.data_parallel)
    per_gpu = host_bytes(-(-max(device_params) // shards), config.model.precision, config.parallel.offloads_parameters)
    gpus = min(cluster.graph.graph["gpus_per_node"], len(cluster.rank_of) * cluster.tensor)
    capacity = config.cluster.host_memory or _host_fact(config, cluster, "memory_bytes", "host_memory")
    if per_gpu * gpus > capacity:
        raise ConfigError(f"parallel.offload: got {config.parallel.offload}, which needs up to "
                          f"{format_bytes(per_gpu * gpus)} of host memory a node ({format_bytes(per_gpu)} for each of "
                          f"its {gpus} GPUs), expected at most cluster.host_memory = {format_bytes(capacity)}; shard "
                          f"it over more replicas (parallel.zero, cluster.data_parallel) or give the host more memory")


def _host_fact(config: Config, cluster: Cluster, fact: str, key: str) -> float:
    """A fact of the machine's host (``topologies/hosts.py``), or a ConfigError naming the key that supplies it."""
    host = HOSTS.get(cluster.graph.graph.get("name", ""))
    if host is None:
        raise ConfigError(f"cluster.{key}: missing, expected a value for cluster.topology {config.cluster.topology} "
                          f"(its host is not one pipescope has a datasheet of; parallel.offload needs it)")
    return getattr(host, fact)
