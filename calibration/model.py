"""The GPT pieces the harness times: a pre-LN block, the input embedding and the output layer.

Every Linear can run in *deferred* mode: its backward computes only the input gradient and leaves
(input, output grad) in a ``WeightGradStore``; ``WeightGradStore.run`` later computes the weight and bias
gradients. That is how zero-bubble runtimes split B into I and W, and it lets I and W be timed apart
without W re-running any part of I.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """What the I pass leaves for the W pass: per deferred Linear, its input, output grad and parameters."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, nn.Parameter, nn.Parameter | None]] = []

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        """Forwards run inside this block build deferred Linears."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def run(self) -> None:
        """The W pass: weight and bias gradients from the stashed pairs, accumulated into ``.grad``."""
        for x, grad_out, weight, bias in self.pending:
            x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
            _accumulate(weight, g2.t() @ x2)
            if bias is not None:
                _accumulate(bias, g2.sum(0))
        self.pending.clear()

    def nbytes(self) -> int:
        """M_W: bytes of the distinct storages the pending pairs keep alive (parameters excluded)."""
        storages = {}
        for x, grad_out, _, _ in self.pending:
            for t in (x, grad_out):
                storages[str(t.device), t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dL/dx and queues the weight-gradient work."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.store = bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.store.pending.append((x, grad_out, weight, ctx.bias))
        return grad_out @ weight, None, None, None


class Deferrable(nn.Module):
    """Base for modules whose Linears can be deferred through a shared store."""

    def __init__(self) -> None:
        super().__init__()
        self.store = WeightGradStore()

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if self.store.deferring:
            return _DeferredLinear.apply(x, layer.weight, layer.bias, self.store)
        return F.linear(x, layer.weight, layer.bias)

    def undeferred_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients the I pass computes (LayerNorm affine): all but the Linears'."""
        linear_params = {id(p) for m in self.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in linear_params]


class Block(Deferrable):
    """Pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x)) with a 4h GELU MLP, causal attention."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.linear(self.ln1(x), self.qkv).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.linear(attn, self.proj)
        return x + self.linear(F.gelu(self.linear(self.ln2(x), self.fc1)), self.fc2)


class Embedding(nn.Module):
    """Token plus learned position embedding (GPT-2 style)."""

    def __init__(self, vocab: int, hidden: int, max_seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(max_seq, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class OutputLayer(Deferrable):
    """Final LayerNorm, projection to the vocabulary (no bias) and mean cross-entropy."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.linear(self.norm(x), self.head)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """The whole model, for a real training step to check predictions against."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.embedding = Embedding(vocab, hidden, seq)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.output = OutputLayer(hidden, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.output(x, targets)

