"""ZeRO on real gloo ranks, checked against one process and against the memory ledger (docs/parallelism.md,
"Checked on real ranks").

``check_zero`` trains the executor's GPT pieces (``executor.state.build_modules``: the embedding, the blocks, the
output layer, each from its seed) for one step of AdamW on ``world`` CPU ranks, each on its slice of one batch, with
torch's own ZeRO: stage 1 is ``ZeroRedundancyOptimizer`` over DDP (the optimizer state partitioned by parameter),
stage 3 is FSDP2's ``fully_shard`` with each module a unit, as the simulator's units are (``reshard_after_forward``
as asked); stage 2, which torch does not ship for CPU ranks, is the executor's own (``Zero2``: whole weights,
gradients reduce-scattered into each rank's shard, AdamW over that shard, the weights all-gathered back). It returns
the mean loss, the full gradients, the weights after the step and the model-state bytes each
rank holds after the step (its weights, gradients and Adam moments, counted from its tensors' local storage), beside
one process training the whole batch. The launcher is the executor's (spawned processes, one thread each, killed on
error or timeout).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipescope.executor.run import launch
from pipescope.executor.state import batch, build_modules
from pipescope.executor.zero import ALL_GATHER, REDUCE_SCATTER, flat_views, views_of
from pipescope.calibration.presets import Shape

STAGES = (1, 2, 3)  # torch's ZeroRedundancyOptimizer (1) and fully_shard (3); the executor's own Zero2
LEARNING_RATE = 1e-3


class _Whole(nn.Module):
    """The executor's modules in order, as one model (FSDP's root; DDP's module)."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules[i] for i in sorted(modules))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.parts[0](ids)
        for block in self.parts[1:-1]:
            x = block(x)
        return self.parts[-1](x, targets)


@dataclass
class ZeroCheck:
    """One step on ``world`` ranks and in one process: losses, full gradients and weights after the step, and each
    rank's model-state bytes after it (``state_bytes``, by rank) and its parameters (``params``, whole model)."""

    stage: int
    world: int
    loss: float
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state_bytes: list[int]
    params: int
    reference_loss: float
    reference_grads: dict[str, torch.Tensor]
    reference_weights: dict[str, torch.Tensor]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (every rank calls it), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class Zero2:
    """ZeRO stage 2 over this process group (Rajbhandari et al. 2020, section 5.2): every rank keeps the whole weights
    in one flat buffer (each parameter a view of it), ``reduce`` reduce-scatters the gradients into this rank's
    shard (averaged) and frees the whole ones, and ``step`` runs AdamW over the rank's shard of the buffer (a view,
    so the weights update in place) and all-gathers the shards back. Padding makes the buffer a multiple of the
    ranks."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.params = list(model.parameters())
        world, rank = dist.get_world_size(), dist.get_rank()
        self.flat = flat_views(self.params, world)
        size = len(self.flat) // world
        self.shard = nn.Parameter(self.flat.narrow(0, rank * size, size))
        self.optim = torch.optim.AdamW([self.shard], lr=lr)

    def reduce(self) -> None:
        """The whole gradients, reduce-scattered (averaged) into this rank's shard; the whole ones freed."""
        whole = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            whole[offset:offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
            p.grad = None
        self.shard.grad = torch.empty_like(self.shard)
        REDUCE_SCATTER(self.shard.grad, whole, op=dist.ReduceOp.AVG)

    def full_grads(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The averaged whole gradients, gathered from every rank's shard (for the check; every rank calls it)."""
        whole = torch.empty_like(self.flat)
        ALL_GATHER(whole, self.shard.grad)
        return {name: g.clone() for name, g in zip(names, views_of(whole, [p.shape for p in self.params]))}

    def step(self) -> None:
        self.optim.step()
        ALL_GATHER(self.flat, self.shard.detach().clone())

    def held_bytes(self) -> int:
        """The gradient shard: the ledger's sharded gradients."""
        return self.shard.grad.numel() * self.shard.grad.element_size()


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | Zero2) -> int:
    """What this rank holds of the model states: its weights' and gradients' local storage and its Adam moments (the
    step counters, a few bytes, are left out as the ledger's static part leaves them)."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    if isinstance(optimizer, Zero2):  # its weights are the model's (counted above), its gradients a shard
        total += optimizer.held_bytes()
    state = optimizer.optim.state if hasattr(optimizer, "optim") else optimizer.state
    for entry in state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                total += _local(entry[key]).numel() * entry[key].element_size()
    return total


def _wrapped(stage: int, model: _Whole, reshard: bool) -> tuple[nn.Module, torch.optim.Optimizer | Zero2]:
    """The model and optimizer of ZeRO ``stage`` (torch's own; the executor's ``Zero2``)."""
    if stage == 2:
        return model, Zero2(model, LEARNING_RATE)
    if stage == 3:
        from torch.distributed.fsdp import fully_shard

        for part in model.parts:
            fully_shard(part, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)


def _rank_body(rank: int, payload: tuple[Shape, int, int, int, int, bool], out: str, progress) -> None:
    """One rank: its slice of the batch, forward, backward, step; rank 0 saves what ``ZeroCheck`` holds (every rank
    gathers the sharded tensors, a collective) and every rank its state bytes."""
    shape, stage, microbatch_size, seed, world, reshard = payload
    progress[2 * rank + 1] = 0
    model, optimizer = _wrapped(stage, _Whole(build_modules(shape, seed)), reshard)
    ids, targets = batch(shape, microbatch_size * world, 1, seed)[0]
    mine = slice(rank * microbatch_size, (rank + 1) * microbatch_size)
    loss = model(ids[mine], targets[mine])
    progress[2 * rank + 1] = 1
    loss.backward()
    if isinstance(optimizer, Zero2):
        optimizer.reduce()
        grads = optimizer.full_grads([name for name, _ in model.named_parameters()])
    else:
        grads = {name: _full(p.grad).clone() for name, p in model.named_parameters()}
    optimizer.step()
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, loss.detach().reshape(1))
    Path(out, f"state.{rank}").write_text(str(_state_bytes(model, optimizer)))
    if rank == 0:
        torch.save({"loss": float(torch.cat(losses).mean()), "grads": _plain(grads), "weights": _plain(weights)},
                   os.path.join(out, "result.pt"))


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without DDP's ``module.`` prefix, so the ranks' and the reference's match."""
    return {name.removeprefix("module."): t for name, t in tensors.items()}


def reference(shape: Shape, microbatch_size: int, world: int, seed: int
              ) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process on the whole batch: the loss, the gradients and the weights after one AdamW step."""
    model = _Whole(build_modules(shape, seed))
    ids, targets = batch(shape, microbatch_size * world, 1, seed)[0]
    loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE).step()
    return loss.item(), grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def check_zero(shape: Shape, stage: int, world: int = 2, microbatch_size: int = 2, seed: int = 0,
               reshard_after_forward: bool = True, timeout_s: float = 120.0) -> ZeroCheck:
    """One AdamW step under ZeRO ``stage`` on ``world`` gloo ranks (CPU), beside one process on the whole batch.

    Raises:
        RunError: a rank died or the ranks took longer than ``timeout_s`` (start-up included); they are killed.
        ValueError: a stage other than 1, 2 or 3.
    """
    if stage not in STAGES:
        raise ValueError(f"stage: got {stage}, expected one of {', '.join(map(str, STAGES))}")

    def where(rank: int, index: int, step: int) -> str:
        return "its start (spawn, process group)" if step < 0 else ("its forward", "its backward")[min(step, 1)]

    with tempfile.TemporaryDirectory() as out:
        launch(world, "gloo", _rank_body, (shape, stage, microbatch_size, seed, world, reshard_after_forward),
               Path(out), where, lambda index: timeout_s)
        saved = torch.load(Path(out) / "result.pt")
        state = [int(Path(out, f"state.{rank}").read_text()) for rank in range(world)]
    loss, grads, weights = reference(shape, microbatch_size, world, seed)
    params = sum(t.numel() for t in weights.values())
    return ZeroCheck(stage, world, saved["loss"], saved["grads"], saved["weights"], state, params, loss, grads,
                     weights)
