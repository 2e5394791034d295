"""Where the vocabulary passes go (docs/schedules.md section 7): the S and T passes and the C0/C1/C2 collectives
put into a 1F1B or V-Half schedule (``vocab_schedule``), and, once compiled, the vocab-1/vocab-2 collectives taken
off the compute streams (``overlap_collectives``). The methods and the shards' costs are ``simulator.vocab``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipescope.simulator.ir import Action, ActionKind, Collective, Role, Schedule, producers
from pipescope.simulator.vocab import C2_KIND, VocabMethod

if TYPE_CHECKING:  # program.py imports the cost models, which import simulator.vocab
    from pipescope.simulator.program import Program

K = ActionKind


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
    # clipping's norm all-reduce (stage -1, ``lowering.add_optimizer_steps``) stays on the stream: the steps follow it
    ours = {i for i, a in enumerate(program.actions) if program.role[i] is Role.COLLECTIVE and a.stage >= 0}
    for d, steps in enumerate(program.device_steps):
        kept = [i for i in steps if i not in ours]
        first, before = (kept[0] if kept else None), None
        for i in steps:
            if i not in ours:
                before = i if program.role[i] is not Role.COLLECTIVE else before
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
