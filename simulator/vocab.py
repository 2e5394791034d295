"""Vocabulary layers as explicit work (docs/schedules.md section 7, "Vocabulary parallelism").

``schedule.vocab`` picks how the input embedding and the output layer (logits, softmax, cross-entropy) are placed:

- ``naive``: the embedding on the first stage, the output layer on the last (the cost models' default).
- ``redistribute``: as naive, with fewer transformer layers on the vocabulary-heavy stages (``balance_layers``).
- ``vocab-1``, ``vocab-2``: both layers split over all p devices by vocabulary (padded to a multiple of 2p); every
  device runs an S and a T pass per microbatch over its shard, joined by the collectives C0 (broadcast of the last
  stage's output), C1 (all-reduce of max and sum; vocab-2 also reduces grad X) and C2 (vocab-1: reduce of grad X).
  The collectives run beside the compute stream (``overlap_collectives``), as the paper's separate stream does.
- ``interlaced``: the same shards, tensor-parallel style: the vocab-1 passes with collectives that hold every
  device's stream (not overlapped), and 1.5p activations on the first device.

This module holds the method names and their checks, the shard's kernels and bytes (``VocabShards``, read by the
cost models), the placement of the S and T passes into a schedule (``vocab_schedule``), the compiled program's
collective overlap, and the layer split of ``redistribute``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from pipescope.simulator.ir import Action, ActionKind, Collective, Role, Schedule, producers
from pipescope.simulator.models import PRECISIONS, Kernel, ModelSpec, output_activation_bytes, output_kernels
from pipescope.simulator.units import short_repr

if TYPE_CHECKING:  # program.py imports the cost models, which import this module
    from pipescope.simulator.program import Program

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
    output layer's kernels (``models.output_kernels``, the one home of them) at the shard's vocabulary: forward
    kernels go to S, weight-gradient kernels to T, and the input-gradient kernels (d logits, the grad-X product)
    to T under vocab-1 and interlaced, to S under vocab-2 (its S pass computes softmax'(Y)W and G*W). The final
    layer norm stays with the last transformer stage and is left out here (two memory-bound kernels over b*s*h).
    """

    method: VocabMethod
    devices: int
    model: ModelSpec
    microbatch_size: int
    precision: str

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
        for kernel in output_kernels(shard, self.microbatch_size, self.precision):
            if kernel.name != "final layer norm":
                passes[{"F": "S", "I": grad_x_in, "W": "T"}[kernel.op]].append(kernel)
        return passes

    def params(self, stage: int) -> int:
        """Parameters the stage holds of the vocabulary layers: its device's shard of the embedding and the output
        projection (the first stage also keeps the position embedding)."""
        if not self.owns(stage):
            return 0
        shard = 2 * self.shard_vocab * self.model.hidden
        return shard + (self.model.seq * self.model.hidden if stage == 0 else 0)

    def stash_bytes(self) -> int:
        """What S keeps until T: the shard's logits and fp32 softmax."""
        return output_activation_bytes(dataclasses.replace(self.model, vocab=self.shard_vocab),
                                       self.microbatch_size, self.precision)

    def collective_bytes(self) -> dict[ActionKind, int]:
        """Bytes of C0, C1 and C2 for one microbatch (``vocab_schedule``'s ``nbytes``)."""
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


def warmup_forwards(method: VocabMethod, rank: int, p: int) -> int:
    """Forwards device ``rank`` runs before its first backward in 1F1B: one more than 1F1B's p-1-r for vocab-2 (p+1
    activations on device 0), two more for vocab-1 (p+2), 3p//2-1-r for interlaced (1.5p), as the paper's code."""
    if method is VocabMethod.INTERLACED:
        return 3 * p // 2 - 1 - rank
    return p - 1 - rank + (2 if method is VocabMethod.VOCAB_1 else 1)


def one_f_one_b_orders(method: VocabMethod, p: int, m: int) -> list[list[Action]]:
    """Each device's 1F1B order of transformer ops with the method's longer warm-up."""
    orders = []
    for r in range(p):
        warmup = min(warmup_forwards(method, r, p), m)
        order = [Action(r, K.F, k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [Action(r, K.F, warmup + k), Action(r, K.B, k)]
        orders.append(order + [Action(r, K.B, k) for k in range(m - warmup, m)])
    return orders


def vocab_schedule(schedule: Schedule, method: VocabMethod, durations: dict[tuple[int, ActionKind], int],
                   nbytes: dict[ActionKind, int]) -> Schedule:
    """``schedule`` with every device's S and T passes and the C0/C1/C2 collectives placed (1F1B or V-Half).

    1F1B gets the method's longer warm-up (``warmup_forwards``); V-Half keeps its own order. The passes are then
    placed by ``place_passes`` with the run's own op times, and each collective sits right after the op that
    produces its data (C0 after the last stage's F on its device and before S elsewhere, C1 after S, C2 after T).

    Args:
        schedule: a 1F1B or V-Half schedule from the generators (one iteration).
        method: a sharded method.
        durations: ns per (stage, compute kind), ``program.op_durations`` of the run's stage costs.
        nbytes: bytes per collective kind (``VocabShards.collective_bytes``).
    """
    p, m = schedule.num_devices, schedule.num_microbatches
    if schedule.name == "1f1b":
        orders = one_f_one_b_orders(method, p, m)
    else:
        orders = [[a for a in acts if a is not None] for acts in schedule.device_actions]
    placed = place_passes(orders, schedule.stage_to_device, durations, method)
    lists = with_collectives(placed, schedule.num_stages, schedule.stage_to_device, method, nbytes)
    return dataclasses.replace(schedule, name=f"{schedule.name}+{method.value}",
                               device_actions=tuple(tuple(acts) for acts in lists))


def grad_x_ready_after(method: VocabMethod) -> ActionKind:
    """The pass whose collective hands the last stage its input gradient: T (then C2) for vocab-1 and interlaced,
    S (then C1) for vocab-2."""
    return K.S if method is VocabMethod.VOCAB_2 else K.T


def place_passes(orders: list[list[Action]], home: Sequence[int], durations: dict[tuple[int, ActionKind], int],
                 method: VocabMethod) -> list[list[Action]]:
    """Insert S(k) and T(k) into every device's order by list scheduling with the run's op times.

    Transfers and collectives are taken as free. Repeatedly the op that can start earliest anywhere runs (a ready
    vocabulary pass before a transformer op that could start at the same time): a transformer op when its inputs
    (``ir.producers``) have ended, the last stage's backward also when its grad X is in (``grad_x_ready_after``);
    S(k) when the last stage's F(k) has ended; T(k) when every device's S(k) has. The transformer order itself is
    kept, so the activation peak is the order's. The paper's code places S and T from measured F and B times with a
    closed-form offset per rank; this greedy rule is its simulator analogue (docs/schedules.md section 7).

    Under interlaced the passes are gang-scheduled, as its stream-holding collectives make them: a device that
    reaches S(k) (or T(k)) waits there, and all devices start it together when the last one arrives.
    """
    p, num_stages = len(orders), len(home)
    last, gradx_kind = num_stages - 1, grad_x_ready_after(method)
    present = {a for order in orders for a in order}
    needs = {a: _needs(a, num_stages, present, gradx_kind) for a in present}
    known: list[int | None] = [None] * p  # the start-ready time of each device's next transformer op, once known
    end: dict[Action, int] = {}
    free, cursor = [0] * p, [0] * p
    pending: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]  # per device: (ready, 0 S / 1 T, mb)
    done_count: dict[tuple[ActionKind, int], int] = {}
    done_at: dict[tuple[ActionKind, int], int] = {}  # when every device's S(k) (or T(k)) has ended
    out: list[list[Action]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders) + 2 * p * len({a.microbatch for a in present if a.stage == last})
    gang, parked = method is VocabMethod.INTERLACED, {}  # parked: device -> when it reached the gang's pass
    while remaining:
        best: tuple[int, int, int, Action] | None = None  # (start, 0 vocab / 1 transformer, device, action)
        for d in range(p):
            if d in parked:
                continue
            if pending[d]:
                ready, lane, mb = min(pending[d])
                option = (max(free[d], ready), 0, d, Action(d, K.T if lane else K.S, mb))
                best = option if best is None or option < best else best
            if cursor[d] < len(orders[d]):
                action = orders[d][cursor[d]]
                ready = known[d] if known[d] is not None else _ready(needs[action], end, done_at)
                known[d] = ready
                if ready is not None:
                    option = (max(free[d], ready), 1, d, action)
                    best = option if best is None or option < best else best
        if best is None:
            stuck = [str(o[c]) for o, c in zip(orders, cursor) if c < len(o)]
            raise ValueError(f"vocabulary placement found nothing to run; next ops {', '.join(stuck)}")
        start, is_transformer, d, action = best
        if is_transformer:
            cursor[d], known[d] = cursor[d] + 1, None
        else:
            pending[d].remove(min(pending[d]))
            if gang:
                parked[d] = start
                if len(parked) < p:
                    continue
                start = max(parked.values())
        for device in (sorted(parked) if gang and not is_transformer else [d]):
            ran = action if device == d else Action(device, action.kind, action.microbatch)
            free[device] = end[ran] = start + durations.get((ran.stage, ran.kind), 0)
            out[device].append(ran)
            remaining -= 1
            _after(ran, end[ran], last, p, pending, done_count, done_at)
        if gang and not is_transformer:
            parked = {}
    return out


def _needs(action: Action, num_stages: int, present: set[Action], gradx_kind: ActionKind,
           ) -> tuple[list[Action], tuple[ActionKind, int] | None]:
    """The ops ``action`` waits for (``ir.producers``), and for the last stage's backward the vocabulary pass whose
    end on every device brings its grad X."""
    last_backward = action.stage == num_stages - 1 and action.kind in (K.I, K.B)
    return producers(action, num_stages, present), ((gradx_kind, action.microbatch) if last_backward else None)


def _ready(needs: tuple[list[Action], tuple[ActionKind, int] | None], end: dict[Action, int],
           done_at: dict[tuple[ActionKind, int], int]) -> int | None:
    """When an op's inputs are all in, or None while one is still to run."""
    ops, vocab = needs
    times = [end.get(a) for a in ops]
    if vocab is not None:
        times.append(done_at.get(vocab))
    return None if None in times else max(times, default=0)


def _after(action: Action, now: int, last: int, p: int, pending: list[list[tuple[int, int, int]]],
           done_count: dict[tuple[ActionKind, int], int], done_at: dict[tuple[ActionKind, int], int]) -> None:
    """What ``action`` ending at ``now`` makes ready: the S passes after the last stage's F, the T passes once every
    device's S has ended."""
    kind, mb = action.kind, action.microbatch
    if kind is K.F and action.stage == last:
        for d in range(p):
            pending[d].append((now, 0, mb))
    elif kind in (K.S, K.T):
        key = (kind, mb)
        done_count[key] = done_count.get(key, 0) + 1
        done_at[key] = max(done_at.get(key, 0), now)
        if kind is K.S and done_count[key] == p:
            for d in range(p):
                pending[d].append((done_at[key], 1, mb))


def with_collectives(placed: list[list[Action]], num_stages: int, home: Sequence[int], method: VocabMethod,
                     nbytes: dict[ActionKind, int]) -> list[list[Action | Collective]]:
    """The placed orders with C0, C1 (and C2) of every microbatch on every device, each right after the op that
    produces its data on that device (C0: after the last stage's F on its device, just before S elsewhere)."""
    p, last = len(placed), num_stages - 1
    group = tuple(range(p))

    def collective(kind: ActionKind, mb: int) -> Collective:
        return Collective(last, kind, mb, group, nbytes[kind])

    out: list[list[Action | Collective]] = []
    for d, order in enumerate(placed):
        acts: list[Action | Collective] = []
        for a in order:
            if a.kind is K.S and d != home[last]:
                acts.append(collective(K.BROADCAST, a.microbatch))
            acts.append(a)
            if a.kind is K.F and a.stage == last:
                acts.append(collective(K.BROADCAST, a.microbatch))
            elif a.kind is K.S:
                acts.append(collective(K.ALL_REDUCE, a.microbatch))
            elif a.kind is K.T and method is not VocabMethod.VOCAB_2:
                acts.append(collective(C2_KIND, a.microbatch))
        out.append(acts)
    return out


def is_overlapped(schedule: Schedule) -> bool:
    """True for a vocab-1 or vocab-2 schedule, whose collectives run beside the compute stream."""
    return schedule.name.endswith((f"+{VocabMethod.VOCAB_1.value}", f"+{VocabMethod.VOCAB_2.value}"))


def overlap_collectives(program: Program, num_stages: int, root: int) -> None:
    """Take a compiled vocab-1/vocab-2 program's collectives off the compute streams, in place.

    Each member joins its collective when the compute op before it on its device ends (the op that produced the
    data, ``with_collectives``); a broadcast's receivers join at once. Only the ops that need the result wait for
    its end: S(k) for C0, T(k) for C1, and the last stage's backward of k for the collective that brings its grad X
    (C1 under vocab-2, C2 under vocab-1). So communication hides behind the transformer ops in between, as on the
    paper's separate stream.

    Args:
        program: compiled from a ``vocab_schedule``.
        num_stages: stages of the schedule.
        root: the device of the last stage, which broadcasts X in C0.
    """
    last, n = num_stages - 1, program.num_entries
    entry = {a: i for i, a in enumerate(program.actions) if program.role[i] is Role.COMPUTE}
    has_c2 = any(isinstance(a, Collective) and a.kind is C2_KIND for a in program.actions)
    grad_x = C2_KIND if has_c2 else K.ALL_REDUCE
    for d, steps in enumerate(program.device_steps):
        kept = [i for i in steps if program.role[i] is not Role.COLLECTIVE]
        first, before = (kept[0] if kept else None), None
        for i in steps:
            if program.role[i] is not Role.COLLECTIVE:
                before = i
                continue
            collective, flow = program.actions[i], program.flow_of[i]
            if before is None or (collective.kind is K.BROADCAST and d != root):
                # a receiver contributes no data: it posts the broadcast as soon as its host reaches the op, long
                # before its stream does (CUDA launches run ahead), so it joins when its first op starts
                program.joins.setdefault(first, []).append((flow, 0))
            else:
                program.joins.setdefault(before, []).append((flow, program.duration[before]))
            for consumer in _consumers(collective, d, last, grad_x):
                j = entry.get(consumer)
                if j is not None and program.device[j] == d:
                    program.waits[j] = [*program.waits[j], n + flow]
        program.device_steps[d] = kept


def _consumers(collective: Collective, device: int, last: int, grad_x: ActionKind) -> list[Action]:
    mb = collective.microbatch
    if collective.kind is K.BROADCAST:
        return [Action(device, K.S, mb)]
    out = [Action(device, K.T, mb)] if collective.kind is K.ALL_REDUCE else []
    if collective.kind is grad_x:
        out += [Action(last, K.I, mb), Action(last, K.B, mb)]
    return out


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
