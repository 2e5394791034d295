"""What is timed for each component, and its byte counts, as rows of the profile tables.

Per transformer layer: F (forward, recording the graph), I (``autograd.grad`` of the output w.r.t. the layer
input and the LayerNorm affine parameters, every Linear deferred), W (the deferred Linears' weight and bias
gradients from the stashed inputs and output grads), B (fused ``autograd.backward``), R (the forward a
recomputing backward replays from the stashed input). Embedding: F and W (its whole backward, a weight
gradient). Output layer (LayerNorm, projection, cross-entropy): F, I, W, B as for a layer. Vocabulary shards:
S, T (vocab-1) and S2, T2 (vocab-2) per shard count. Optimizer: the executor's op (gradient norm, AdamW ``step()``,
the gradient buffer zeroed) on fp32 master copies of several parameter groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipescope.calibration.memory import peak_backward_bytes, saved_tensor_bytes
from pipescope.calibration.model import Block, Embedding, OutputLayer
from pipescope.simulator.readers.profile_schema import EMBEDDING, LAYER, OPTIMIZER, OUTPUT, OUTPUT_SHARD
from pipescope.calibration.timing import Bench, Stats, Timer, spread
from pipescope.calibration.vocab_parallel import Reduced, Shard, SPass, reduce_shards, s_pass, t_pass

Row = dict[str, object]


def timing_row(component: str, op: str, mb: int, seq: int, stats: Stats, params: int, tensors: int,
               shards: int = 1) -> Row:
    """One row of the timings table."""
    return {"component": component, "op": op, "microbatch_size": mb, "seq": seq, "shards": shards,
            "params": params, "tensors": tensors, "median_ns": stats.median_ns, "p10_ns": stats.p10_ns,
            "p90_ns": stats.p90_ns, "min_ns": stats.min_ns, "reps": stats.reps, "attempts": stats.attempts}


NOISY_KEYS = ("component", "op", "microbatch_size", "seq", "shards", "median_ns", "p90_ns", "attempts")


def noisy_rows(rows: list[Row], max_spread: float) -> list[Row]:
    """The timing rows whose p90 / median is above ``max_spread`` (what stayed noisy after every re-measurement):
    where they were measured, median, p90, attempts and the spread, rounded to 4 decimals."""
    return [{**{k: row[k] for k in NOISY_KEYS}, "spread": round(ratio, 4)} for row in rows
            if (ratio := spread(row["median_ns"], row["p90_ns"])) > max_spread]


def memory_row(component: str, mb: int, seq: int, module: nn.Module, activation: int, weight_grad: int,
               boundary: int, peak: float) -> Row:
    """One row of the memory table."""
    params = list(module.parameters())
    return {"component": component, "microbatch_size": mb, "seq": seq, "params": sum(p.numel() for p in params),
            "tensors": len(params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "activation_bytes": activation, "weight_grad_bytes": weight_grad, "boundary_bytes": boundary,
            "peak_backward_bytes": peak}


def _counts(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters())
    return sum(p.numel() for p in params), len(params)


def split_benches(module: nn.Module, forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
                  grad: torch.Tensor | None) -> dict[str, Bench]:
    """F, I, W, B, R benches of a Deferrable module; ``inputs`` are the leaves I differentiates against."""
    store = module.store
    inputs = inputs + module.undeferred_params()

    def deferred_forward() -> torch.Tensor:
        store.pending.clear()
        with store.defer():
            return forward()

    def after_input() -> None:
        torch.autograd.grad(deferred_forward(), inputs, grad)

    return {
        "F": Bench(lambda _: forward(), after_backward(forward, grad)),
        "I": Bench(lambda y: torch.autograd.grad(y, inputs, grad), deferred_forward),
        "W": Bench(lambda _: store.run(), after_input),
        "B": Bench(lambda y: torch.autograd.backward(y, grad), forward),
        "R": Bench(lambda _: forward(), after_backward(forward, grad)),
    }


def after_backward(forward: Callable[[], torch.Tensor], grad: torch.Tensor | None) -> Callable[[], None]:
    """A setup that runs a forward and its backward, untimed: a forward is then timed as training runs it, after a
    backward. On a CPU that matters: a forward timed back to back finds its weights and the allocator warm and runs
    1.3-1.5x faster than one after a backward (docs/costs.md, "What a forward is timed after")."""

    def setup() -> None:
        torch.autograd.backward(forward(), grad)

    return setup


def weight_grad_bytes(module: nn.Module, forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
                      grad: torch.Tensor | None) -> int:
    """M_W: bytes the deferred W still holds once I has run and freed the graph."""
    split_benches(module, forward, inputs, grad)["W"].setup()
    nbytes = module.store.nbytes()
    module.store.pending.clear()
    return nbytes


def layer_rows(timer: Timer, block: Block, mb: int, seq: int) -> tuple[list[Row], Row]:
    """Time one transformer block and count its bytes for a (microbatch, seq) point."""
    p = next(block.parameters())
    x = torch.randn(mb, seq, p.shape[-1], dtype=p.dtype, device=p.device, requires_grad=True)
    dy = torch.randn_like(x)
    benches = split_benches(block, lambda: block(x), [x], dy)
    params, tensors = _counts(block)
    rows = [timing_row(LAYER, op, mb, seq, timer.measure(b), params, tensors) for op, b in benches.items()]
    activation, y = saved_tensor_bytes(lambda: block(x), exclude=block.parameters())
    peak = peak_backward_bytes(x.device, lambda: torch.autograd.backward(y, dy))
    m_w = weight_grad_bytes(block, lambda: block(x), [x], dy)
    return rows, memory_row(LAYER, mb, seq, block, activation, m_w, y.numel() * y.element_size(), peak)


def embedding_rows(timer: Timer, embedding: Embedding, mb: int, seq: int) -> tuple[list[Row], Row]:
    """Time the input embedding's forward and its backward (all of it a weight gradient)."""
    weight = embedding.tokens.weight
    ids = torch.randint(weight.shape[0], (mb, seq), device=weight.device)
    grad = torch.randn(mb, seq, weight.shape[1], dtype=weight.dtype, device=weight.device)
    params, tensors = _counts(embedding)
    benches = {"F": Bench(lambda _: embedding(ids), after_backward(lambda: embedding(ids), grad)),
               "W": Bench(lambda y: torch.autograd.backward(y, grad), lambda: embedding(ids))}
    rows = [timing_row(EMBEDDING, op, mb, seq, timer.measure(b), params, tensors) for op, b in benches.items()]
    activation, y = saved_tensor_bytes(lambda: embedding(ids), exclude=embedding.parameters())
    peak = peak_backward_bytes(ids.device, lambda: torch.autograd.backward(y, grad))
    return rows, memory_row(EMBEDDING, mb, seq, embedding, activation, activation, y.numel() * y.element_size(), peak)


def output_rows(timer: Timer, output: OutputLayer, mb: int, seq: int) -> tuple[list[Row], Row]:
    """Time the output layer (norm, projection, cross-entropy) split into F, I, W, B, R."""
    weight = output.head.weight
    x = torch.randn(mb, seq, weight.shape[1], dtype=weight.dtype, device=weight.device, requires_grad=True)
    targets = torch.randint(weight.shape[0], (mb, seq), device=weight.device)
    benches = split_benches(output, lambda: output(x, targets), [x], None)
    params, tensors = _counts(output)
    rows = [timing_row(OUTPUT, op, mb, seq, timer.measure(b), params, tensors) for op, b in benches.items()]
    activation, loss = saved_tensor_bytes(lambda: output(x, targets), exclude=output.parameters())
    peak = peak_backward_bytes(x.device, loss.backward)
    m_w = weight_grad_bytes(output, lambda: output(x, targets), [x], None)
    return rows, memory_row(OUTPUT, mb, seq, output, activation, m_w, 0, peak)


def shard_rows(timer: Timer, output: OutputLayer, mb: int, seq: int, max_shards: int) -> list[Row]:
    """Time shard 0's vocabulary-parallel passes (``calibration/vocab_parallel.py``) for 1..max_shards shards: S and T
    of vocab-1 (T: grad W and the partial grad X), S2 and T2 of vocab-2 (S2: S plus ``exp(Y - m) W`` and
    ``W[target]``; T2: grad W only). The collectives between them are timed by calibrate-comms, not here."""
    full = output.head.weight
    vocab, hidden = full.shape
    x = torch.randn(mb * seq, hidden, dtype=full.dtype, device=full.device)
    targets = torch.randint(vocab, (mb * seq,), device=full.device)
    rows = []
    for shards in range(1, max_shards + 1):
        shard = Shard(0, shards, vocab)
        # Shard 0's rows of the real head: random N(0, 1) rows would give logits of spread sqrt(h), whose
        # exponentials underflow to denormals and run 5-10x slower on CPU.
        weight = shard.take(full.detach())
        local = shard.local(targets)  # shard 0's view: its own rows keep their index, the others are -1
        for suffix, extras in (("", False), ("2", True)):
            benches = shard_benches(x, weight, local, shard.valid, extras)
            rows += [timing_row(OUTPUT_SHARD, op + suffix, mb, seq, timer.measure(bench), shard.rows * hidden, 1,
                                shards) for op, bench in benches.items()]
    return rows


def shard_benches(x: torch.Tensor, weight: torch.Tensor, local: torch.Tensor, valid: int,
                  extras: bool) -> dict[str, Bench]:
    """S and T benches of one shard; T's setup runs S and C1's arithmetic on this shard alone (no collective)."""

    def after_c1() -> tuple[SPass, Reduced]:
        s = s_pass(x, weight, local, valid, extras)
        return s, reduce_shards([s])

    return {"S": Bench(lambda _: s_pass(x, weight, local, valid, extras)),
            "T": Bench(lambda sr: t_pass(x, weight, local, *sr, input_grad=not extras), after_c1)}


def optimizer_groups(blocks: list[Block], embedding: Embedding, output: OutputLayer) -> list[list[nn.Module]]:
    """Module groups whose optimizer step is timed: one block, all given blocks, embedding, output, all."""
    groups = [[blocks[0]], list(blocks), [embedding], [output], [embedding, *blocks, output]]
    unique, seen = [], set()
    for group in groups:
        key = tuple(id(m) for m in group)
        if key not in seen:
            seen.add(key)
            unique.append(group)
    return unique


def attach_flat_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Each parameter's gradient a view of ``flat``, in order, as the executor keeps them (one buffer per stage)."""
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def optimizer_rows(timer: Timer, groups: list[list[nn.Module]]) -> list[Row]:
    """Time each group's optimizer op as the executor runs it (``executor.weights``), on fp32 masters (mixed
    precision keeps fp32 masters): the gradient norm read back to the host, AdamW's ``step()`` on gradients that
    are views of one flat buffer, and that buffer zeroed. The simulator's step stands for all three
    (``StageCost.optimizer_ns``). On an H200, ``step()`` alone fell 17% short of the executor's op on GPT 1.3B's
    stages; the zeroing, the norm and the GPU idling while the host launches the step after the norm's sync are
    most of that (docs/validation.md, "The probes")."""
    rows = []
    for group in groups:
        masters = [nn.Parameter(p.detach().float().clone()) for m in group for p in m.parameters()]
        # Gradient-like values, refilled before each repetition (the op zeroes them, and an all-zero gradient
        # makes AdamW several times slower on CPU).
        values = torch.randn(sum(p.numel() for p in masters), device=masters[0].device) * 1e-3
        flat = values.clone()
        attach_flat_grads(masters, flat)
        optimizer = torch.optim.AdamW(masters, lr=1e-4)

        def executor_op(_, o=optimizer, g=flat) -> None:
            float(torch.linalg.vector_norm(g))
            o.step()
            g.zero_()

        stats = timer.measure(Bench(executor_op, setup=lambda g=flat, v=values: g.copy_(v)))
        rows.append(timing_row(OPTIMIZER, "step", 0, 0, stats, sum(p.numel() for p in masters), len(masters)))
        del optimizer, masters, flat, values
    return rows
