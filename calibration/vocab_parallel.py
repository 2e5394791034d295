"""Vocabulary parallelism (Yeung et al., MLSys 2025, arXiv 2411.05288): the output layer and the input embedding
split along the vocabulary over p shards, as tensor math with the collectives kept apart.

Shard k holds rows ``k * n .. (k + 1) * n - 1`` of the weight, the vocabulary padded to a multiple of 2p
(``shard_size``). Padded rows are masked out of the softmax (their exponentials are exactly zero) and are never
targets, so their gradients are zero.

The output layer, on X (the last stage's normalised hidden states, broadcast to every shard: C0):

- ``s_pass`` (S): local logits ``X W_k^T``, the local max ``m_k``, the sum of ``exp(y - m_k)`` and the target's logit
  where this shard holds it. With ``extras`` (Algorithm 2, "vocab-2") also ``exp(Y - m_k) W_k`` and ``W_k[target]``,
  the two products that give grad X without a T pass.
- C1 (``pack_max`` then ``pack_sum``): all-reduce MAX of the local maxima, then one all-reduce SUM of the rescaled
  sums, the target logits and (vocab-2) the rescaled products. ``finish`` turns the sums into the loss and, for
  vocab-2, grad X: the one barrier of Algorithm 2.
- ``t_pass`` (T): dL/dlogits from the stored exponentials and the global max and sum, then grad W_k and (Algorithm 1,
  "vocab-1") this shard's partial grad X, whose all-reduce SUM is C2, the second barrier. Vocab-2's T pass computes
  grad W only and can be delayed like a W.

``reduce_shards`` is C1 over shards held in one process; ``executor/vocab_exec.py`` runs the same functions with
torch.distributed collectives. ``calibration/ops.py`` times ``s_pass`` and ``t_pass`` (rows S, T, S2, T2). See
docs/validation.md, "Vocabulary parallelism, run for real".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALGORITHMS = ("vocab-1", "vocab-2")


def shard_size(vocab: int, shards: int) -> int:
    """Rows of the output projection on one of ``shards`` devices, the vocabulary padded to a multiple of 2p."""
    multiple = 2 * shards
    padded = -(-vocab // multiple) * multiple
    return padded // shards


@dataclass(frozen=True)
class Shard:
    """Which rows of a ``vocab``-row table shard ``index`` of ``count`` holds."""

    index: int
    count: int
    vocab: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"Shard.index: got {self.index}, expected 0..{self.count - 1}")
        if self.vocab < 1:
            raise ValueError(f"Shard.vocab: got {self.vocab}, expected an integer >= 1")

    @property
    def rows(self) -> int:
        return shard_size(self.vocab, self.count)

    @property
    def start(self) -> int:
        return self.index * self.rows

    @property
    def valid(self) -> int:
        """Rows that are real vocabulary entries (the rest are padding)."""
        return max(0, min(self.rows, self.vocab - self.start))

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in this shard, or -1 where another shard holds it."""
        inside = (ids >= self.start) & (ids < self.start + self.valid)
        return torch.where(inside, ids - self.start, torch.full_like(ids, -1))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's rows of a full ``vocab x h`` table, padding rows zero."""
        part = full.new_zeros(self.rows, full.shape[1])
        part[:self.valid] = full[self.start:self.start + self.valid]
        return part


@dataclass
class SPass:
    """What the S pass of one shard leaves: the exponentials ``exp(y - m_k)`` (padding exactly 0), the local max and
    sum, the target logit (0 where another shard holds the target), and with extras ``exp(Y - m_k) W_k`` and
    ``W_k[target]`` (zero rows where another shard holds it)."""

    exp: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    target_logit: torch.Tensor
    softmax_w: torch.Tensor | None = None
    target_w: torch.Tensor | None = None


@dataclass
class Reduced:
    """C1's result, the same on every shard: the global max and sum of exponentials per row, the mean loss, and
    (vocab-2) grad X of the mean loss."""

    max: torch.Tensor
    sum: torch.Tensor
    loss: torch.Tensor
    grad_x: torch.Tensor | None


def s_pass(x: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, valid: int,
           extras: bool = False) -> SPass:
    """The S pass of one shard (Algorithm 1; with ``extras`` Algorithm 2's).

    Args:
        x: ``N x h`` inputs (every token of the microbatch).
        weight: this shard's ``n x h`` rows.
        local_targets: each token's target row in this shard, -1 where another shard holds it (``Shard.local``).
        valid: rows of ``weight`` that are real vocabulary entries; the rest never win the softmax.
        extras: also compute ``exp(Y - m_k) W_k`` and ``W_k[target]`` (vocab-2).
    """
    logits = x @ weight.t()
    if valid < weight.shape[0]:
        logits[:, valid:] = float("-inf")
    # A shard of padding only has max -inf; the finite floor keeps y - m_k at -inf there, so its exponentials are 0.
    local_max = logits.amax(dim=-1).clamp(min=torch.finfo(logits.dtype).min)
    exp = (logits - local_max.unsqueeze(1)).exp()
    hit = local_targets >= 0
    index = local_targets.clamp(min=0).unsqueeze(1)
    target_logit = torch.where(hit, logits.gather(1, index).squeeze(1), torch.zeros_like(local_max))
    out = SPass(exp, local_max, exp.sum(dim=-1), target_logit)
    if extras:
        out.softmax_w = exp @ weight
        out.target_w = weight.index_select(0, index.squeeze(1)) * hit.unsqueeze(1).to(weight.dtype)
    return out


def pack_max(s: SPass) -> torch.Tensor:
    """What C1 all-reduces with MAX: the local maxima."""
    return s.max.clone()


def pack_sum(s: SPass, global_max: torch.Tensor) -> torch.Tensor:
    """What C1 all-reduces with SUM, once the global max is known: ``N x 2`` (rescaled sum, target logit), and for
    vocab-2 ``N x (2 + 2h)`` with the rescaled ``exp(Y - M) W_k`` and ``W_k[target]``."""
    scale = (s.max - global_max).exp()
    columns = [(s.sum * scale).unsqueeze(1), s.target_logit.unsqueeze(1)]
    if s.softmax_w is not None:
        columns += [s.softmax_w * scale.unsqueeze(1), s.target_w]
    return torch.cat(columns, dim=1)


def finish(global_max: torch.Tensor, summed: torch.Tensor) -> Reduced:
    """The loss (and vocab-2's grad X) from C1's reduced tensors: ``loss = mean(M + log S - y_target)``."""
    total, target_logit = summed[:, 0], summed[:, 1]
    loss = (global_max + total.log() - target_logit).mean()
    grad_x = None
    if summed.shape[1] > 2:
        hidden = (summed.shape[1] - 2) // 2
        softmax_w, target_w = summed[:, 2:2 + hidden], summed[:, 2 + hidden:]
        grad_x = (softmax_w / total.unsqueeze(1) - target_w) / summed.shape[0]
    return Reduced(global_max, total, loss, grad_x)


def reduce_shards(parts: list[SPass]) -> Reduced:
    """C1 over shards held in one process (the sum in shard order, as a ring would not guarantee)."""
    global_max = torch.stack([pack_max(s) for s in parts]).amax(dim=0)
    return finish(global_max, torch.stack([pack_sum(s, global_max) for s in parts]).sum(dim=0))


def t_pass(x: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, s: SPass, reduced: Reduced,
           input_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The T pass of one shard: (grad W_k, partial grad X or None) of the mean loss.

    ``input_grad`` False is vocab-2's T pass (grad X came out of C1); True is vocab-1's, whose partial grad X the
    shards sum in C2.
    """
    # dL/dlogits = (softmax - onehot(target)) / N, the softmax being this shard's exponentials rescaled to the
    # global max and sum. Scatter with a mask rather than indexing the hits, which would synchronise a GPU.
    grad = s.exp * ((s.max - reduced.max).exp() / reduced.sum).unsqueeze(1)
    hit = (local_targets >= 0).to(grad.dtype).unsqueeze(1)
    grad = grad.scatter_add(1, local_targets.clamp(min=0).unsqueeze(1), -hit)
    grad /= x.shape[0]
    return grad.t() @ x, (grad @ weight if input_grad else None)


def embedding_forward(ids: torch.Tensor, weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This shard's part of the token embedding: its rows where it holds the id, zero elsewhere (the shards' parts
    all-reduced with SUM are the lookup)."""
    local = shard.local(ids)
    hit = (local >= 0).to(weight.dtype).unsqueeze(-1)
    return weight[local.clamp(min=0)] * hit


def embedding_backward(ids: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """grad of this shard's embedding rows from the output gradient (broadcast to every shard)."""
    local = shard.local(ids).reshape(-1)
    hit = (local >= 0).to(grad.dtype).unsqueeze(1)
    rows = grad.reshape(-1, grad.shape[-1]) * hit
    return torch.zeros_like(weight).index_add_(0, local.clamp(min=0), rows)
