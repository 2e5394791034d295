"""The device mesh: the one home of "which rank is this device of this replica" and "which ranks form this axis's
group" (docs/parallelism.md).

A simulated device is one pipeline device of one data-parallel replica; it stands for ``tensor x context`` GPUs of
one node, or of whole nodes (``context.span_problem``). Device ``d`` of replica ``r`` is device
``r * pipeline + d``; its GPUs are the network's GPUs from ``device * tensor * context`` on
(``Cluster.tensor_network``'s numbering), tensor ranks innermost.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceMesh:
    """Degrees of the parallel axes: ``pipeline`` devices per replica, ``data`` replicas, ``tensor`` GPUs per device;
    ``shard``: the replicas ZeRO shards over (HSDP: groups of ``shard`` consecutive replicas, each holding one set of
    shards, replicated across the groups)."""

    pipeline: int
    data: int = 1
    tensor: int = 1
    shard: int = 0  # replicas a ZeRO shard group spans (HSDP: a divisor of data); 0: all of them
    context: int = 1  # GPUs of a device that split the sequence, per tensor rank

    @property
    def gpus_per_device(self) -> int:
        return self.tensor * self.context

    @property
    def shard_size(self) -> int:
        return self.shard or self.data

    @property
    def hybrid(self) -> bool:
        """HSDP: shard groups smaller than the data axis, replicated across."""
        return self.shard_size < self.data

    def shard_replicas(self) -> list[tuple[int, ...]]:
        """The replicas of each shard group: ``shard`` consecutive ones."""
        size = self.shard_size
        return [tuple(range(k, k + size)) for k in range(0, self.data, size)]

    def replicate_replicas(self) -> list[tuple[int, ...]]:
        """The replicas of each replicate group: the same position in every shard group."""
        size = self.shard_size
        return [tuple(range(i, self.data, size)) for i in range(size)]

    def ranks(self, replicas: tuple[int, ...], d: int) -> tuple[int, ...]:
        """Pipeline device ``d`` of each of ``replicas``."""
        return tuple(self.device(r, d) for r in replicas)

    @property
    def devices(self) -> int:
        """Simulated devices: every replica's pipeline."""
        return self.pipeline * self.data

    @property
    def gpus(self) -> int:
        return self.devices * self.gpus_per_device

    def device(self, replica: int, d: int) -> int:
        """Replica ``replica``'s pipeline device ``d``."""
        return replica * self.pipeline + d

    def data_group(self, d: int) -> list[int]:
        """Pipeline device ``d`` of every replica: the ranks that reduce its gradients."""
        return list(self.ranks(tuple(range(self.data)), d))

    def tensor_gpus(self, device: int) -> list[int]:
        """The tensor-parallel group of ``device``'s first context rank (numbered as ``Cluster.tensor_network``
        numbers a device's GPUs: tensor innermost, then context, as Megatron-LM orders them)."""
        first = device * self.gpus_per_device
        return list(range(first, first + self.tensor))

    def context_gpus(self, device: int) -> list[int]:
        """The context-parallel group of ``device``'s first tensor rank."""
        first = device * self.gpus_per_device
        return [first + c * self.tensor for c in range(self.context)]


ZERO_STAGES = (0, 1, 2, 3)  # parallel.zero
# The ZeRO stage from which each model state is sharded (Rajbhandari et al. 2020, "ZeRO", section 5)
SHARDED_FROM = {"optimizer": 1, "gradients": 2, "weights": 3}


@dataclass(frozen=True)
class Sharding:
    """ZeRO over the data axis: the stage (0: none) and the ``shards`` the sharded states are cut into
    (docs/parallelism.md, "ZeRO"); ``reshard_after_forward``: stage 3 frees a stage's gathered weights after each op
    (FSDP's default), or runs torch.distributed.pipelining's FSDP actions (``lowering.add_fsdp_actions``).
    ``unit_params``: FSDP gathers and reduces one unit at a time (a transformer block; the embedding and the output
    layer each one, as torchtitan wraps them) and prefetches the next ``prefetch``, so at most ``prefetch + 1`` units
    are whole at once during an op (their gradients: two, the one being reduced and the one being made)."""

    zero: int = 0
    shards: int = 1
    reshard_after_forward: bool = True
    unit_params: int = 0  # one GPU's parameters of a block, the unit stages 2 and 3 work in (0: a stage's op)
    edge_unit_params: int = 0  # of the larger of the embedding and the output layer: the first and last stage's
    prefetch: int = 1  # stage 3: units gathered ahead of the one in use
    offload: bool = False  # the optimizer state lives on the host (ZeRO-Offload: simulator/offload.py)
    offload_params: bool = False  # ZeRO-3's weight shards live on the host too (ZeRO-Infinity)
    host_rate: float = 0.0  # bytes/s of a GPU's copies from its host (its PCIe share), for offloaded weights

    def part(self, nbytes: int, state: str) -> int:
        """What one GPU holds of ``nbytes`` of ``state`` (a key of ``SHARDED_FROM``): its shard, rounded up, once
        the stage shards it, else all of it."""
        return -(-nbytes // self.shards) if self.zero >= SHARDED_FROM[state] else nbytes

    def gathered(self, nbytes: int, state: str) -> int:
        """The bytes of ``state`` a GPU holds beside its shard while the whole is gathered (0 when unsharded): all
        of them, as a whole buffer is made beside the shard, which stays (FSDP's unsharded parameters and
        gradients, DeepSpeed's reduction buckets beside its gradient partition; the executor's ZeRO measures it:
        docs/validation.md, "ZeRO in the pipeline")."""
        return nbytes if self.zero >= SHARDED_FROM[state] and self.shards > 1 else 0

    def in_flight(self, nbytes: int, state: str, per_param: int, edge: bool = False) -> int:
        """What an op holds whole of ``nbytes`` of ``state`` (``per_param`` bytes a parameter) beside its shard: the
        units in flight (``prefetch + 1`` of weights, 2 of gradients), or all of it (``gathered``) when the stage is
        smaller or there are no units. The units are blocks; on an ``edge`` stage (the first or the last) one of them
        may be the embedding or the output layer, where larger: it and the blocks beside it, not two of it (a stage
        holds one)."""
        whole = self.gathered(nbytes, state)
        units = self.prefetch + 1 if state == "weights" else 2
        largest = max(self.unit_params, self.edge_unit_params) if edge else self.unit_params
        held = largest + (units - 1) * self.unit_params
        return min(whole, held * per_param) if self.unit_params else whole


NO_SHARDING = Sharding()
