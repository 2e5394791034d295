"""Vocabulary parallelism in torch: the split output layer and input embedding against the unsplit ones, shards
simulated in one process and held by real gloo ranks (one launch for every case)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402 (after the torch skip)

from pipescope.executor.vocab_exec import VocabCase, case_inputs, run_vocab  # noqa: E402
from pipescope.calibration.vocab_parallel import (Shard, embedding_backward, embedding_forward, reduce_shards,  # noqa: E402
                                                  s_pass, shard_size, t_pass)

torch.set_num_threads(1)


def unsplit(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """torch's cross-entropy over the whole layer: loss, grad X, grad W."""
    x, weight = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = F.cross_entropy(x @ weight.t(), targets)
    loss.backward()
    return loss.detach(), x.grad, weight.grad


def split(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, shards: int,
          algorithm: str) -> tuple[torch.Tensor, ...]:
    """The split layer with its shards in a loop: S on each, C1 as a sum over them, T on each, C2 (vocab-1) as a
    sum. Loss, grad X, grad W of the padded table."""
    vocab2 = algorithm == "vocab-2"
    views = [Shard(k, shards, weight.shape[0]) for k in range(shards)]
    weights = [view.take(weight) for view in views]
    locals_ = [view.local(targets) for view in views]
    parts = [s_pass(x, w, t, view.valid, extras=vocab2) for view, w, t in zip(views, weights, locals_, strict=True)]
    reduced = reduce_shards(parts)
    grads = [t_pass(x, w, t, s, reduced, input_grad=not vocab2)
             for w, t, s in zip(weights, locals_, parts, strict=True)]
    grad_x = reduced.grad_x if vocab2 else sum(g[1] for g in grads)
    return reduced.loss, grad_x, torch.cat([g[0] for g in grads])


def inputs(vocab: int, hidden: int, tokens: int, scale: float = 1.0,
           dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(vocab * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype) * scale
    weight = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    targets = torch.randint(vocab, (tokens,), generator=g)
    targets[:2] = torch.tensor([0, vocab - 1])  # the first and the last row of the table are targets
    return x, weight, targets


@pytest.mark.parametrize("algorithm", ["vocab-1", "vocab-2"])
@pytest.mark.parametrize(("vocab", "shards"), [(37, 3), (37, 1), (5, 4), (64, 4)])
def test_split_layer_equals_unsplit_cross_entropy(algorithm: str, vocab: int, shards: int) -> None:
    """Loss, grad X and grad W equal torch's over the unsplit layer; padding rows get exactly zero gradient.
    37 over 3 shards pads to 42 (the last shard holds 9 real rows of 14); 5 over 4 leaves shard 3 all padding."""
    x, weight, targets = inputs(vocab, 8, 24)
    loss, grad_x, grad_w = split(x, weight, targets, shards, algorithm)
    ref_loss, ref_x, ref_w = unsplit(x, weight, targets)
    assert grad_w.shape[0] == shards * shard_size(vocab, shards) >= vocab
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_w[:vocab], ref_w, rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(grad_w[vocab:]) == 0


@pytest.mark.parametrize("algorithm", ["vocab-1", "vocab-2"])
def test_split_layer_is_stable_for_large_logits_in_float32(algorithm: str) -> None:
    """Logits in the hundreds overflow exp() in float32 unless every shard shifts by the global max."""
    x, weight, targets = inputs(50, 16, 32, scale=40.0, dtype=torch.float32)
    loss, grad_x, grad_w = split(x, weight, targets, 4, algorithm)
    ref_loss, ref_x, ref_w = unsplit(x, weight, targets)
    assert ref_loss > 100 and torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_w[:50], ref_w, rtol=1e-4, atol=1e-4)


def test_split_embedding_equals_unsplit_lookup_and_gradient() -> None:
    """The shards' lookups summed are the lookup; their row gradients are autograd's, padding rows zero."""
    vocab, shards = 37, 3
    g = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(vocab, (4, 6), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])
    grad = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)
    (F.embedding(ids, table) * grad).sum().backward()
    views = [Shard(k, shards, vocab) for k in range(shards)]
    parts = [view.take(table.detach()) for view in views]
    lookup = sum(embedding_forward(ids, part, view) for part, view in zip(parts, views, strict=True))
    torch.testing.assert_close(lookup, F.embedding(ids, table.detach()), rtol=0, atol=0)
    grads = torch.cat([embedding_backward(ids, grad, part, view) for part, view in zip(parts, views, strict=True)])
    torch.testing.assert_close(grads[:vocab], table.grad, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(grads[vocab:]) == 0


def test_shards_pad_to_a_multiple_of_2p_and_refuse_bad_indices() -> None:
    assert shard_size(50257, 4) * 4 == 50264 and shard_size(64, 4) == 16
    assert [Shard(k, 3, 37).valid for k in range(3)] == [14, 14, 9]
    with pytest.raises(ValueError, match=r"^Shard.index: got 3, expected 0..2$"):
        Shard(3, 3, 37)
    with pytest.raises(ValueError, match=r"^VocabCase.algorithm: got 'vocab-3', expected one of vocab-1, vocab-2$"):
        run_vocab([VocabCase("vocab-3", 37, 8, 24)], world=2)
    with pytest.raises(ValueError, match=r"^VocabCase.tokens: got 0, expected an integer >= 1$"):
        run_vocab([VocabCase("vocab-1", 37, 8, 0)], world=2)


GLOO_CASES = [VocabCase("vocab-1", 37, 8, 24, seed=1), VocabCase("vocab-2", 37, 8, 24, seed=2),
              VocabCase("vocab-2", 3, 4, 10, seed=3)]  # 3 over 2 ranks pads to 4: rank 1 holds 1 real row


def test_gloo_ranks_equal_the_unsplit_layer() -> None:
    """2 gloo ranks each hold their shard and run C0, S, C1, T (C2 for vocab-1) and the embedding's lookup,
    all-reduce and row gradients: every rank's loss and grad X, the shards' grad W and the embedding equal the
    unsplit layer in one process."""
    for case, result in zip(GLOO_CASES, run_vocab(GLOO_CASES, world=2), strict=True):
        data = case_inputs(case)
        ref_loss, ref_x, ref_w = unsplit(data.x, data.weight, data.targets)
        for loss, grad_x in zip(result.losses, result.grad_x, strict=True):
            assert loss == pytest.approx(float(ref_loss), rel=1e-12)
            torch.testing.assert_close(grad_x, ref_x, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result.grad_weight[:case.vocab], ref_w, rtol=1e-10, atol=1e-12)
        assert torch.count_nonzero(result.grad_weight[case.vocab:]) == 0
        table = data.table.clone().requires_grad_(True)
        (F.embedding(data.ids, table) * data.grad_embedding).sum().backward()
        for embedding in result.embeddings:
            torch.testing.assert_close(embedding, F.embedding(data.ids, data.table), rtol=0, atol=0)
        torch.testing.assert_close(result.grad_table[:case.vocab], table.grad, rtol=1e-12, atol=1e-12)

