"""Vocabulary layers as explicit work (docs/schedules.md section 7, "Vocabulary parallelism").

``schedule.vocab`` picks how the input embedding and the output layer (logits, softmax, cross-entropy) are placed:

- ``naive``: the embedding on the first stage, the output layer on the last (the cost models' default).
- ``redistribute``: as naive, with fewer transformer layers on the vocabulary-heavy stages (``balance_layers``).
- ``vocab-1``, ``vocab-2``: both layers split over all p devices by vocabulary (padded to a multiple of 2p); every
  device runs an S and a T pass per microbatch over its shard, joined by the collectives C0 (broadcast of the last
  stage's output), C1 (all-reduce of max and sum; vocab-2 also reduces grad X) and C2 (vocab-1: reduce of grad X).
  The collectives run beside the compute stream (``vocab_placement.overlap_collectives``), as the paper's
  separate stream does.
- ``interlaced``: the same shards, tensor-parallel style: the vocab-1 passes with collectives that hold every
  device's stream (not overlapped), and 1.5p activations on the first device.

This module holds the method names and their checks, the shard's kernels and bytes (``VocabShards``, read by the
cost models) and the layer split of ``redistribute``; ``vocab_placement`` puts the S and T passes and the
collectives into a schedule and overlaps the collectives with compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pipescope.simulator.ir import ActionKind
from pipescope.simulator.kernels import Kernel, output_kernels
from pipescope.simulator.models import PRECISIONS, ModelSpec, allocated_vocab, output_activation_bytes
from pipescope.simulator.readers.units import short_repr

K = ActionKind


class VocabMethod(StrEnum):
    """The values of ``schedule.vocab``."""

    NAIVE = "naive"
    REDISTRIBUTE = "redistribute"
    VOCAB_1 = "vocab-1"
    VOCAB_2 = "vocab-2"
    INTERLACED = "interlaced"


SHARDED = frozenset({VocabMethod.VOCAB_1, VocabMethod.VOCAB_2, VocabMethod.INTERLACED})
# The schedules each sharded method is defined with (the paper: 1F1B and V-Half; interlaced: 1F1B only).
SCHEDULES = {VocabMethod.VOCAB_1: ("1f1b", "v-half"), VocabMethod.VOCAB_2: ("1f1b", "v-half"),
             VocabMethod.INTERLACED: ("1f1b",)}
SCHEDULE_ALIASES = {"flush": "1f1b", "pipedream-flush": "1f1b"}


def vocab_method(value: str, schedule_name: str) -> VocabMethod:
    """``schedule.vocab`` checked against its choices and against ``schedule.name``.

    Raises:
        ValueError: one line naming ``schedule.vocab`` (and ``schedule.name`` for a combination the paper does
            not define).
    """
    try:
        method = VocabMethod(value)
    except ValueError:
        choices = ", ".join(m.value for m in VocabMethod)
        raise ValueError(f"schedule.vocab: got {short_repr(value)}, expected one of {choices}") from None
    name = SCHEDULE_ALIASES.get(schedule_name, schedule_name)
    if method in SHARDED and name not in SCHEDULES[method]:
        raise ValueError(f"schedule.vocab: {method.value} is defined with schedule.name "
                         f"{' or '.join(SCHEDULES[method])}, got schedule.name {short_repr(schedule_name)}")
    return method


def padded_vocab(vocab: int, devices: int) -> int:
    """The vocabulary padded to a multiple of 2p (the paper's code pads it so every shard is equal and even)."""
    unit = 2 * devices
    return -(-vocab // unit) * unit


@dataclass(frozen=True)
class VocabShards:
    """One device's vocabulary shard under a sharded method: its S and T kernels, parameters and stash.

    The shard is ``padded_vocab / p`` rows of both the embedding and the output projection. Its passes are the
    output layer's kernels (``kernels.output_kernels``, the one home of them) at the shard's vocabulary: forward
    kernels go to S, weight-gradient kernels to T, and the input-gradient kernels (d logits, the grad-X product)
    to T under vocab-1 and interlaced, to S under vocab-2 (its S pass computes softmax'(Y)W and G*W). The final
    layer norm stays with the last transformer stage and is left out here (two memory-bound kernels over b*s*h).
    """

    method: VocabMethod
    devices: int
    model: ModelSpec
    microbatch_size: int
    precision: str
    runtime: str = "torch"  # whose padding the shard's logits run with: Megatron pads the vocabulary first

    @property
    def shard_vocab(self) -> int:
        return padded_vocab(self.model.vocab, self.devices) // self.devices

    def owns(self, stage: int) -> bool:
        """The stage that carries its device's shard: the device's first stage (stage d is on device d both in the
        looped 1F1B placement and in the V placement)."""
        return stage < self.devices

    def pass_kernels(self) -> dict[str, list[Kernel]]:
        """The shard's kernels per pass, ``{"S": [...], "T": [...]}``, for one microbatch."""
        shard = dataclasses.replace(self.model, vocab=self.shard_vocab)
        grad_x_in = "S" if self.method is VocabMethod.VOCAB_2 else "T"
        passes: dict[str, list[Kernel]] = {"S": [], "T": []}
        allocated = padded_vocab(allocated_vocab(self.runtime, self.model.vocab), self.devices) // self.devices
        for kernel in output_kernels(shard, self.microbatch_size, self.precision, allocated=allocated):
            if kernel.name != "final layer norm":
                passes[{"F": "S", "I": grad_x_in, "W": "T"}[kernel.op]].append(kernel)
        return passes

    def params(self, stage: int) -> int:
        """Parameters the stage holds of the vocabulary layers: its device's shard of the embedding and the output
        projection (the first stage also keeps GPT's position embedding)."""
        if not self.owns(stage):
            return 0
        shard = 2 * self.shard_vocab * self.model.hidden
        return shard + (self.model.embedding_whole_params() if stage == 0 else 0)

    def stash_bytes(self) -> int:
        """What S keeps until T: the shard's logits and fp32 softmax, and its copy of the broadcast input X (T's
        weight gradient reads it)."""
        x = self.microbatch_size * self.model.seq * self.model.hidden * PRECISIONS[self.precision].activation_bytes
        return x + output_activation_bytes(dataclasses.replace(self.model, vocab=self.shard_vocab),
                                           self.microbatch_size, self.precision)

    def collective_bytes(self) -> dict[ActionKind, int]:
        """Bytes of C0, C1 and C2 for one microbatch (``vocab_placement.vocab_schedule``'s ``nbytes``)."""
        tokens = self.microbatch_size * self.model.seq
        x = tokens * self.model.hidden * PRECISIONS[self.precision].activation_bytes
        stats = 2 * tokens * 4  # fp32 max and sum per token
        return collective_bytes(self.method, x, stats)


def collective_bytes(method: VocabMethod, x_bytes: int, stats_bytes: int) -> dict[ActionKind, int]:
    """C0 broadcasts X; C1 all-reduces the max and sum (vocab-2: and grad X); C2 reduces grad X (vocab-1,
    interlaced). Keyed by the collective kind that runs each (C2 runs as a reduce-scatter, see ``C2_KIND``)."""
    c1 = stats_bytes + (x_bytes if method is VocabMethod.VOCAB_2 else 0)
    out = {K.BROADCAST: x_bytes, K.ALL_REDUCE: c1}
    if method is not VocabMethod.VOCAB_2:
        out[C2_KIND] = x_bytes
    return out


# The networks have no reduce-to-one collective. A ring reduce moves (n-1)/n of the bytes over each link, as a
# reduce-scatter does, so C2 runs as one (docs/schedules.md section 7, "What differs from the paper").
C2_KIND = K.REDUCE_SCATTER


def balance_layers(start: Sequence[int], home: Sequence[int], stage_ns: Callable[[tuple[int, ...]], list[int]],
                   ) -> tuple[int, ...]:
    """``redistribute``'s split: from ``start``, move one transformer layer at a time from a stage of the slowest
    device to a stage of the fastest while that lowers (slowest device's time, sum of squares of device times).

    Args:
        start: the split to improve (the equal split); every stage keeps at least one layer.
        home: stage -> device.
        stage_ns: per stage, its F + I + W time for a split (the run's cost model with that split).

    Returns:
        A split no slower than ``start`` on its slowest device.
    """
    devices = max(home) + 1

    def score(split: tuple[int, ...]) -> tuple[int, int, list[int]]:
        per_device = [0] * devices
        for stage, ns in enumerate(stage_ns(split)):
            per_device[home[stage]] += ns
        return max(per_device), sum(t * t for t in per_device), per_device

    split = tuple(start)
    best = score(split)
    for _ in range(sum(split)):
        times = best[2]
        slow = max(range(devices), key=times.__getitem__)
        # among equally fast devices the last: in 1F1B device d stashes p - d microbatches, so a layer costs the
        # least memory there (the paper's caveat: redistribution can raise the first stages' memory)
        fast = min(range(devices), key=lambda d: (times[d], -d))
        moves = [(a, b) for a in range(len(split)) if home[a] == slow and split[a] > 1
                 for b in range(len(split)) if home[b] == fast]
        improved = None
        for a, b in moves:
            trial = list(split)
            trial[a], trial[b] = trial[a] - 1, trial[b] + 1
            trial_score = score(tuple(trial))
            if trial_score[:2] < best[:2] and (improved is None or trial_score[:2] < improved[1][:2]):
                improved = (tuple(trial), trial_score)
        if improved is None:
            break
        split, best = improved
    return split
