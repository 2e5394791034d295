"""The vocabulary-parallel output layer and input embedding run for real: p ranks over torch.distributed (gloo on
CPU, nccl on CUDA), each holding its shard of both tables, launched and supervised by the executor's launcher
(``executor.launch``).

Per case every rank builds the full tables from the case's seed and keeps its shard (as the executor builds each
stage from its own seed). The last rank stands for the last pipeline stage: it draws X and the targets and
broadcasts them (C0). Then S, C1, T and, for vocab-1, C2 (``vocab_parallel``). Rank 0 stands for the first stage: it
draws the token ids and broadcasts them, every rank looks up its rows and the parts are all-reduced; the output
gradient it draws is broadcast and every rank computes its rows' gradient. This is a program of its own: the pipeline
executor does not place S and T passes yet (docs/validation.md, "Vocabulary parallelism, run for real").
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipescope.executor.run import launch
from pipescope.calibration.vocab_parallel import (ALGORITHMS, Shard, embedding_backward, embedding_forward, finish,
                                                  pack_max, pack_sum, s_pass, t_pass)

STEPS = ("C0", "S", "C1", "T", "C2", "embedding lookup", "embedding all-reduce", "embedding grad broadcast",
         "embedding grad", "the end of the case")


@dataclass(frozen=True)
class VocabCase:
    """One vocabulary-parallel step: the algorithm, the table shape, the tokens (X is ``tokens x hidden``), the
    seed every rank draws the tables and inputs from, and how long no rank may make progress."""

    algorithm: str
    vocab: int
    hidden: int
    tokens: int
    seed: int = 0
    dtype: torch.dtype = torch.float64
    timeout_s: float = 60.0

    def check(self) -> None:
        """ValueError, one line naming the field, for a case that cannot run."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"VocabCase.algorithm: got {self.algorithm!r}, expected one of {', '.join(ALGORITHMS)}")
        for name in ("vocab", "hidden", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VocabCase.{name}: got {value!r}, expected an integer >= 1")


@dataclass(frozen=True)
class VocabInputs:
    """What a case's seed draws: the output layer's weight, X and targets, the embedding table, ids and the
    gradient of the embedding output."""

    weight: torch.Tensor
    x: torch.Tensor
    targets: torch.Tensor
    table: torch.Tensor
    ids: torch.Tensor
    grad_embedding: torch.Tensor


def case_inputs(case: VocabCase) -> VocabInputs:
    """The case's tables and inputs, the same in every process."""
    g = torch.Generator().manual_seed(case.seed)
    v, h, n = case.vocab, case.hidden, case.tokens
    return VocabInputs(torch.randn(v, h, generator=g, dtype=case.dtype), torch.randn(n, h, generator=g,
                       dtype=case.dtype), torch.randint(v, (n,), generator=g), torch.randn(v, h, generator=g,
                       dtype=case.dtype), torch.randint(v, (n,), generator=g), torch.randn(n, h, generator=g,
                       dtype=case.dtype))


@dataclass
class VocabResult:
    """Per rank: the loss, grad X (after C1 for vocab-2, C2 for vocab-1), its shard's grad W and embedding-row
    grad, and the embedding lookup after the all-reduce. ``grad_weight`` and ``grad_table`` are the shards
    concatenated in rank order, padding rows included."""

    losses: list[float]
    grad_x: list[torch.Tensor]
    embeddings: list[torch.Tensor]
    grad_weight: torch.Tensor
    grad_table: torch.Tensor


def run_vocab(cases: list[VocabCase], world: int, device: str = "cpu") -> list[VocabResult]:
    """Run every case on ``world`` ranks in one launch.

    Raises:
        ValueError: a bad case or world (one line naming it).
        RunError: a rank died or no rank made progress for the case's ``timeout_s``; every rank is killed.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"run_vocab: world got {world!r}, expected an integer >= 1")
    for case in cases:
        case.check()

    def where(rank: int, index: int, step: int) -> str:
        what = "its start (spawn, process group)" if step < 0 else STEPS[min(step, len(STEPS) - 1)]
        return f"{what} of case {index} ({cases[index].algorithm}, vocab {cases[index].vocab})"

    with tempfile.TemporaryDirectory() as out:
        launch(world, "nccl" if device == "cuda" else "gloo", _rank_body, (cases, device), Path(out), where,
               lambda index: cases[index].timeout_s)
        return [_collect(Path(out), index, world) for index in range(len(cases))]


def _collect(out: Path, index: int, world: int) -> VocabResult:
    parts = [torch.load(out / f"{index}.{r}.pt") for r in range(world)]
    return VocabResult([p["loss"] for p in parts], [p["grad_x"] for p in parts], [p["embedding"] for p in parts],
                       torch.cat([p["grad_weight"] for p in parts]), torch.cat([p["grad_table"] for p in parts]))


def _rank_body(rank: int, payload: tuple[list[VocabCase], str], out: str, progress) -> None:
    """One rank: every case in turn, its results saved to ``{case}.{rank}.pt`` under ``out``."""
    cases, device_kind = payload
    device = torch.device("cuda", rank % torch.cuda.device_count()) if device_kind == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    for index, case in enumerate(cases):
        progress[2 * rank] = index

        def step(name: str) -> None:
            progress[2 * rank + 1] = STEPS.index(name)

        step("C0")
        inputs = case_inputs(case)
        shard = Shard(rank, world, case.vocab)
        result = _output_layer(case, inputs, shard, device, step)
        result.update(_embedding(inputs, shard, device, step))
        step("the end of the case")
        torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()},
                   os.path.join(out, f"{index}.{rank}.pt"))


def _output_layer(case: VocabCase, inputs: VocabInputs, shard: Shard, device: torch.device, step) -> dict:
    """C0, S, C1, T (and C2 for vocab-1) of this rank's shard."""
    last = shard.count - 1
    x, targets = inputs.x.to(device), inputs.targets.to(device)
    if shard.index != last:  # only the last stage has them; the others receive them
        x, targets = torch.empty_like(x), torch.empty_like(targets)
    dist.broadcast(x, last)
    dist.broadcast(targets, last)
    weight = shard.take(inputs.weight).to(device)
    local = shard.local(targets)
    vocab2 = case.algorithm == "vocab-2"
    step("S")
    s = s_pass(x, weight, local, shard.valid, extras=vocab2)
    step("C1")
    global_max = pack_max(s)
    dist.all_reduce(global_max, dist.ReduceOp.MAX)
    summed = pack_sum(s, global_max)
    dist.all_reduce(summed)
    reduced = finish(global_max, summed)
    step("T")
    grad_w, grad_x = t_pass(x, weight, local, s, reduced, input_grad=not vocab2)
    if vocab2:
        grad_x = reduced.grad_x
    else:
        step("C2")
        dist.all_reduce(grad_x)
    return {"loss": float(reduced.loss), "grad_x": grad_x, "grad_weight": grad_w}


def _embedding(inputs: VocabInputs, shard: Shard, device: torch.device, step) -> dict:
    """The input embedding: ids broadcast from rank 0, the lookup all-reduced, the output grad broadcast back."""
    ids, grad = inputs.ids.to(device), inputs.grad_embedding.to(device)
    if shard.index != 0:
        ids, grad = torch.empty_like(ids), torch.empty_like(grad)
    dist.broadcast(ids, 0)
    step("embedding lookup")
    table = shard.take(inputs.table).to(device)
    embedding = embedding_forward(ids, table, shard)
    step("embedding all-reduce")
    dist.all_reduce(embedding)
    step("embedding grad broadcast")
    dist.broadcast(grad, 0)
    step("embedding grad")
    return {"embedding": embedding, "grad_table": embedding_backward(ids, grad, table, shard)}
