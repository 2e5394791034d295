"""ZeRO stages 1-3 inside the executor's pipeline program (docs/validation.md, "ZeRO in the pipeline").

A stage's weights move into one flat buffer, padded to a multiple of the stage's data-parallel replicas (each
parameter becomes a view of it, as Megatron's distributed optimizer and DeepSpeed lay them out); replica r owns the
r-th of the equal shards and its optimizer steps only that shard.

- ZeRO-1: the gradients stay whole, one padded flat buffer as without ZeRO; after the stage's last backward it is
  reduce-scattered, and the replica's averaged shard lands in its own slice of that buffer. The shard is a view of
  the weights, so the step updates them in place, and the shards are all-gathered back after it.
- ZeRO-2: as 1, but only the replica's shard of the gradients is kept. Each backward op (B) accumulates into a
  whole buffer made for it, which is reduce-scattered into the shard and freed when the op ends (DeepSpeed's
  reduction at every micro-step). A backward split into I and W would keep the whole gradients from I to W, so it
  is refused.
- ZeRO-3: the weights are kept as the shard alone, and gathered whole (``unshard``) only while needed: for each op
  that reads them, as ZeRO-2 reduces its gradients (FSDP's ``reshard_after_forward``), or from each of torch's
  UNSHARD actions to its RESHARD, the gradients accumulating whole until the stage's REDUCE_GRAD (torch's
  pipelining runtime over ``fully_shard``ed stages). A gathered buffer sits beside the shard, as FSDP's unsharded
  parameters do.

The collectives run over the stage's replica group (``executor.run._groups``): every replica runs the same program,
so they are called in the same order everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipescope.executor.weights import StageWeights, make_optimizer

ZERO_STAGES = (0, 1, 2, 3)
# torch 2.13 names them *_single and deprecates the older names; a GPU machine's older torch has only those
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def flat_views(params: list[torch.Tensor], world: int) -> torch.Tensor:
    """One buffer holding ``params`` in order, padded to a multiple of ``world`` shards, each parameter made a view
    of it (its values copied in)."""
    total = sum(p.numel() for p in params)
    flat = torch.zeros(-(-total // world) * world, dtype=params[0].dtype, device=params[0].device)
    for p, view in zip(params, views_of(flat, [p.shape for p in params])):
        view.copy_(p.detach())
        p.data = view
    return flat


def views_of(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` in ``shapes``, from its start (its padding left out)."""
    out, offset = [], 0
    for shape in shapes:
        out.append(flat[offset:offset + shape.numel()].view(shape))
        offset += shape.numel()
    return out


class ShardedStageWeights(StageWeights):
    """A stage's weights, gradients and optimizer under ZeRO ``zero`` (1 to 3) over ``world`` replicas, this one
    ``replica`` of them, in the process ``group`` of the stage's replicas. Flush schedules only: one version."""

    def __init__(self, modules: dict[int, nn.Module], optimizer: str, lr: float, zero: int, group: object,
                 replica: int, world: int, reshard_after_forward: bool = True) -> None:
        self.zero, self.group, self.replica, self.world = zero, group, replica, world
        # the whole gradients of one backward op, reduce-scattered when it ends (else: at REDUCE_GRAD, or ZeRO-1's end)
        self.per_op = zero == 2 or (zero == 3 and reshard_after_forward)
        super().__init__(modules, optimizer, lr)

    def _make_state(self, optimizer: str, lr: float) -> None:
        """The flat weights, this replica's shard, the gradients it keeps and the optimizer over the shard (never the
        whole stage's state, even for a moment)."""
        self.flat = flat_views(self.own, self.world)
        self.size = len(self.flat) // self.world  # one shard, in elements
        self.shapes = [p.shape for p in self.own]
        self.shard = nn.Parameter(self.flat.narrow(0, self.replica * self.size, self.size))
        if self.zero == 3:  # the shard alone, a tensor of its own; the whole weights only while gathered
            self.shard = nn.Parameter(self.shard.detach().clone())
        if self.zero == 1:  # whole and padded, as the reduce-scatter reads it; the shard's gradient is its own slice
            self.grad = torch.zeros_like(self.flat)
            self._attach_grads(self.own)
            self.shard.grad = self.grad.narrow(0, self.replica * self.size, self.size)
        else:  # the shard the reductions accumulate into; the whole gradients exist only during a backward op
            self.grad = None
            self.shard.grad = torch.zeros_like(self.shard)
        self.reshard()
        self.optimizer = make_optimizer(optimizer, lr, [self.shard])

    @property
    def held_grad(self) -> torch.Tensor:
        """What the stage keeps of its gradients between ops: the whole buffer (ZeRO-1) or its shard (ZeRO-2, 3)."""
        return self.grad if self.zero == 1 else self.shard.grad

    @property
    def held_weights(self) -> list[torch.Tensor]:
        """What the stage keeps of its weights between ops: the whole buffer's views, or under ZeRO-3 its shard."""
        return [self.shard] if self.zero == 3 else self.own

    def unshard(self) -> torch.Tensor | None:
        """ZeRO-3: the whole weights gathered from every replica's shard into the buffer the parameters are views of
        (None: already gathered, or not ZeRO-3). As FSDP does, the buffer's storage is grown back in place and its
        version counter kept, so what autograd saved of the weights in a forward reads them again in the backward."""
        storage = self.flat.untyped_storage()
        if self.zero != 3 or storage.nbytes():
            return None
        storage.resize_(self.flat.numel() * self.flat.element_size())
        with torch.autograd._unsafe_preserve_version_counter(self.flat):
            ALL_GATHER(self.flat, self.shard.detach(), group=self.group)
        return self.flat

    def reshard(self) -> None:
        """ZeRO-3: the whole weights freed (their storage shrunk to nothing) until the next ``unshard``."""
        if self.zero == 3:
            self.flat.untyped_storage().resize_(0)

    def open_grads(self) -> torch.Tensor | None:
        """ZeRO-2 and 3, before a backward op: a whole zeroed gradient buffer, every parameter's gradient a view of
        it (None: ZeRO-1, or still open from an earlier op until REDUCE_GRAD)."""
        if self.zero == 1 or self.grad is not None:
            return None
        self.grad = torch.zeros(self.size * self.world, dtype=self.shard.dtype, device=self.shard.device)
        self._attach_grads(self.own)
        return self.grad

    def close_grads(self) -> None:
        """After a backward op, where the whole gradients are reduced per op: reduce-scattered (summed) into the
        shard, then freed."""
        if self.per_op:
            self.reduce_grad()

    def reduce_grad(self) -> None:
        """ZeRO-2 and 3: the whole gradients reduce-scattered (summed) into the shard, then freed (at torch's
        REDUCE_GRAD without per-op reduction)."""
        if self.zero == 1 or self.grad is None:
            return
        part = torch.empty_like(self.shard.grad)
        REDUCE_SCATTER(part, self.grad, group=self.group)
        self.shard.grad.add_(part)
        for p in self.own:
            p.grad = None
        self.grad = None

    def start_reduce(self) -> tuple[object, torch.Tensor] | None:
        """ZeRO-1, after the stage's last backward: the reduce-scatter of the whole buffer, started (the work and
        where it lands); ZeRO-2 and 3 have reduced after every op, or at REDUCE_GRAD."""
        if self.zero != 1:
            return None
        part = torch.empty_like(self.shard.grad)
        return REDUCE_SCATTER(part, self.grad, group=self.group, async_op=True), part

    def finish_reduce(self, started: tuple[object, torch.Tensor] | None) -> None:
        """The shard's gradient, summed over the replicas (``start_reduce`` waited for), averaged."""
        if started is not None:
            work, part = started
            work.wait()
            self.shard.grad.copy_(part)
        self.shard.grad.div_(self.world)

    def squared_norm(self) -> float:
        """The squares of this replica's shard of the averaged gradient: summed over every rank, the pipeline's."""
        return float(torch.linalg.vector_norm(self.shard.grad)) ** 2

    def full_grads(self) -> list[torch.Tensor]:
        """The averaged gradient of every parameter, gathered from the shards (every replica calls it)."""
        return views_of(self._gathered(self.shard.grad), self.shapes)

    def whole_weights(self) -> list[torch.Tensor]:
        """Every parameter's newest value, gathered from the shards under ZeRO-3 (every replica calls it)."""
        return views_of(self._gathered(self.shard.detach()), self.shapes) if self.zero == 3 else self.own

    def _gathered(self, shard: torch.Tensor) -> torch.Tensor:
        whole = torch.empty(self.size * self.world, dtype=shard.dtype, device=shard.device)
        ALL_GATHER(whole, shard.contiguous(), group=self.group)
        return whole

    def step(self, coefficient: float, lagged: bool) -> list[torch.Tensor]:
        """The optimizer's step on this replica's shard (scaled by ``coefficient``), the gradients zeroed, and every
        replica's updated shard gathered into the whole weights."""
        with torch.no_grad():
            if coefficient != 1.0:
                self.shard.grad.mul_(coefficient)
            self.optimizer.step()
            (self.grad if self.zero == 1 else self.shard.grad).zero_()
            if self.zero < 3:  # ZeRO-3 gathers at its next use
                ALL_GATHER(self.flat, self.shard.detach().clone(), group=self.group)
        self.latest += 1
        self.versions[self.latest] = self.versions.pop(self.latest - 1)
        return []
