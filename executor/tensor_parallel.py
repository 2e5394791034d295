"""Megatron-style tensor parallelism of the executor's GPT pieces over t gloo ranks, checked against the unsplit model
(docs/validation.md, "Tensor parallelism").

Each rank holds its slice of every split weight (Shoeybi et al. 2019, "Megatron-LM"): QKV and MLP up are
column-parallel (its heads' and its MLP columns' rows), the out projection and MLP down row-parallel (the matching
input columns; their biases whole, added once after the all-reduce), the token embedding and the output projection
vocabulary-parallel (its rows of the vocabulary), and the layer norms and position embedding whole. Megatron's two
conjugate operators join them: ``f`` (identity forward, all-reduce of the gradient backward) before each
column-parallel part and ``g`` (all-reduce forward, identity backward) after each row-parallel one, so a layer runs
two all-reduces in forward and two in backward, as the simulator charges (docs/costs.md, "Tensor parallelism").
Cross-entropy over the split vocabulary all-reduces each token's max, sum of exponentials and target logit.

``check_tensor_parallel`` runs one forward and backward of a batch on t ranks through the executor's launcher
(``executor.launch``: spawned processes, one thread each, killed on error or timeout) and returns the loss and the
gradients, gathered to full shapes, beside those of the unsplit model in this process.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipescope.executor.run import launch
from pipescope.executor.state import batch, build_modules
from pipescope.calibration.presets import Shape

# Per parameter suffix: how the full tensor is split, as (view of the full tensor, dimension cut into t slices). QKV's
# rows are (q|k|v, head, head dim): a rank takes its heads of each of the three. None: kept whole on every rank.
_SPLITS: dict[str, tuple[str, int] | None] = {
    "qkv.weight": ("3,H,h", 1), "qkv.bias": ("3,H", 1), "proj.weight": ("h,H", 1), "proj.bias": None,
    "fc1.weight": ("4H,h", 0), "fc1.bias": ("4H", 0), "fc2.weight": ("h,4H", 1), "fc2.bias": None,
    "ln1.weight": None, "ln1.bias": None, "ln2.weight": None, "ln2.bias": None,
    "tokens.weight": ("V,h", 0), "positions.weight": None, "norm.weight": None, "norm.bias": None,
    "head.weight": ("V,h", 0),
}


def _view(shape: Shape, spec: str) -> tuple[int, ...]:
    sizes = {"3": 3, "H": shape.hidden, "4H": 4 * shape.hidden, "h": shape.hidden, "V": shape.vocab}
    return tuple(sizes[part] for part in spec.split(","))


def _split(name: str) -> tuple[str, int] | None:
    return _SPLITS[name.split(".", 1)[1]]


class _Copy(torch.autograd.Function):
    """Megatron's ``f``: the identity forward, the all-reduce of the gradient backward (before a column split)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _Reduce(torch.autograd.Function):
    """Megatron's ``g``: the all-reduce forward (after a row split), the identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split by vocabulary: three all-reduces of one value per token."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
        top = logits.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        hit = (~outside).to(softmax.dtype).unsqueeze(-1)
        return softmax.scatter_add(-1, local.unsqueeze(-1), -hit) * grad.unsqueeze(-1), None, None


class TensorParallelGPT(nn.Module):
    """One rank's share of the executor's GPT (``build_modules``' embedding, blocks and output layer) over the whole
    world of ``tensor`` ranks; parameters keep the unsplit model's names (``{module index}.{name}``)."""

    def __init__(self, shape: Shape, full: dict[int, nn.Module], rank: int, tensor: int):
        super().__init__()
        if shape.heads % tensor or shape.vocab % tensor:
            raise ValueError(f"tensor: got {tensor}, expected a divisor of heads ({shape.heads}) and vocab "
                             f"({shape.vocab})")
        self.shape, self.rank, self.tensor = shape, rank, tensor
        named = {f"{index}.{name}": param.detach() for index, module in full.items()
                 for name, param in module.named_parameters()}
        self.names, self.full_shapes = list(named), {name: param.shape for name, param in named.items()}
        self.weights = nn.ParameterList(nn.Parameter(self._slice(name, param)) for name, param in named.items())
        self._at = {name: i for i, name in enumerate(self.names)}

    def _slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full parameter: rows (column-parallel, vocabulary) or columns (row-parallel)."""
        split = _split(name)
        if split is None:
            return full.clone()
        view, dim = _view(self.shape, split[0]), split[1]
        part = full.reshape(view).chunk(self.tensor, dim)[self.rank]
        columns = full.dim() == len(view) == 2 and dim == 1
        return (part.reshape(full.shape[0], -1) if columns else part.reshape(-1, *full.shape[1:])).clone()

    def p(self, name: str) -> nn.Parameter:
        return self.weights[self._at[name]]

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        layers, rows = self.shape.layers, self.shape.vocab // self.tensor
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        tokens = F.embedding(local.clamp(0, rows - 1), self.p("0.tokens.weight")).masked_fill(outside.unsqueeze(-1), 0)
        x = _Reduce.apply(tokens) + self.p("0.positions.weight")[:ids.shape[1]]
        for index in range(1, layers + 1):
            x = self._block(x, f"{index}.")
        out = f"{layers + 1}."
        y = _Copy.apply(F.layer_norm(x, x.shape[-1:], self.p(out + "norm.weight"), self.p(out + "norm.bias")))
        logits = F.linear(y, self.p(out + "head.weight"))
        losses = _VocabCrossEntropy.apply(logits.reshape(-1, rows), targets.reshape(-1), self.rank * rows)
        return losses.mean()

    def _block(self, x: torch.Tensor, at: str) -> torch.Tensor:
        """calibration.model.Block's forward on this rank's heads and MLP columns."""
        b, s, h = x.shape
        heads, p = self.shape.heads // self.tensor, self.p
        y = _Copy.apply(F.layer_norm(x, (h,), p(at + "ln1.weight"), p(at + "ln1.bias")))
        qkv = F.linear(y, p(at + "qkv.weight"), p(at + "qkv.bias")).view(b, s, 3, heads, h // self.shape.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + _Reduce.apply(F.linear(attn, p(at + "proj.weight"))) + p(at + "proj.bias")
        y = _Copy.apply(F.layer_norm(x, (h,), p(at + "ln2.weight"), p(at + "ln2.bias")))
        up = F.gelu(F.linear(y, p(at + "fc1.weight"), p(at + "fc1.bias")))
        return x + _Reduce.apply(F.linear(up, p(at + "fc2.weight"))) + p(at + "fc2.bias")

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient in the unsplit shape: split ones all-gathered from the ranks."""
        grads = {}
        for name, param in zip(self.names, self.weights):
            split = _split(name)
            if split is None:
                grads[name] = param.grad.clone()
                continue
            view, dim = _view(self.shape, split[0]), split[1]
            chunk = list(view)
            chunk[dim] //= self.tensor
            parts = [torch.empty(chunk) for _ in range(self.tensor)]
            dist.all_gather(parts, param.grad.reshape(chunk).contiguous())
            grads[name] = torch.cat(parts, dim).reshape(self.full_shapes[name])
        return grads


@dataclass
class TensorCheck:
    """One batch's loss and full-shaped gradients on ``tensor`` ranks and in one unsplit process."""

    tensor: int
    loss: float
    grads: dict[str, torch.Tensor]
    reference_loss: float
    reference_grads: dict[str, torch.Tensor]


def reference(shape: Shape, microbatch_size: int, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model's loss and gradients on the batch (the executor's modules and batch, from ``seed``)."""
    modules = build_modules(shape, seed)
    ids, targets = batch(shape, microbatch_size, 1, seed)[0]
    x = modules[0](ids)
    for index in range(1, shape.layers + 1):
        x = modules[index](x)
    loss = modules[shape.layers + 1](x, targets)
    loss.backward()
    return loss.item(), {f"{i}.{n}": p.grad.clone() for i, m in modules.items() for n, p in m.named_parameters()}


def _rank_body(rank: int, payload: tuple[Shape, int, int, int], out: str, progress) -> None:
    """One tensor-parallel rank (the launcher's body, in its process group): build the unsplit modules from the
    seed, keep its slices, one forward and backward; rank 0 saves the loss and the gathered gradients."""
    shape, microbatch_size, seed, world = payload
    progress[2 * rank + 1] = 0
    model = TensorParallelGPT(shape, build_modules(shape, seed), rank, world)
    ids, targets = batch(shape, microbatch_size, 1, seed)[0]
    loss = model(ids, targets)
    progress[2 * rank + 1] = 1
    loss.backward()
    grads = model.full_grads()
    if rank == 0:
        torch.save({"loss": loss.item(), "grads": grads}, os.path.join(out, "result.pt"))


STEPS = ("its forward", "its backward")


def check_tensor_parallel(shape: Shape, tensor: int = 2, microbatch_size: int = 2, seed: int = 0,
                          timeout_s: float = 120.0) -> TensorCheck:
    """One forward and backward on ``tensor`` gloo ranks (CPU) beside the unsplit model in this process.

    Raises:
        RunError: a rank died or the ranks took longer than ``timeout_s`` (start-up included); they are killed.
        ValueError: ``tensor`` does not divide the heads or the vocabulary.
    """
    if shape.heads % tensor or shape.vocab % tensor:
        raise ValueError(f"tensor: got {tensor}, expected a divisor of heads ({shape.heads}) and vocab "
                         f"({shape.vocab})")
    def where(rank: int, index: int, step: int) -> str:
        return "its start (spawn, process group)" if step < 0 else f"{STEPS[min(step, 1)]} at t = {tensor}"

    with tempfile.TemporaryDirectory() as out:
        launch(tensor, "gloo", _rank_body, (shape, microbatch_size, seed, tensor), Path(out), where,
               lambda index: timeout_s)
        saved = torch.load(Path(out) / "result.pt")
    loss, grads = saved["loss"], saved["grads"]
    reference_loss, reference_grads = reference(shape, microbatch_size, seed)
    return TensorCheck(tensor, loss, grads, reference_loss, reference_grads)
