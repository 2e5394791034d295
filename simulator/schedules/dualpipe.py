"""DualPipeV (DeepSeek-V3's DualPipe "cut in half"; torch's ``ScheduleDualPipeV``): the V placement of ZB-V, device r
holding stages r and 2p-1-r, with microbatches fed from one end, in eight phases per device (docs/schedules.md,
"DualPipeV"):

1. ``2(p-r-1)`` forwards of the first chunk (stage r);
2. ``r+1`` pairs of forwards, first chunk then second (stage 2p-1-r);
3. ``p-r-1`` times: the second chunk's input-gradient, the oldest deferred weight-gradient, its forward;
4. the steady state, ``m-2p+r+1`` times: a forward of the first chunk with a backward of the second, then a forward
   of the second with a backward of the first (each an "F&B" pair, which DeepSeek-V3 overlaps to hide its
   communication; the last device's first pair is not overlapped, to shorten the bubble);
5. ``p-r-1`` times: a backward of the second chunk, then the pair (second chunk's forward, first chunk's backward);
6. ``r+1`` pairs of backwards, second chunk then first, whole until half-way and then input-gradients only
   (their weight-gradients deferred; odd devices switch one backward earlier);
7. ``p-r-1`` times: a deferred weight-gradient, then the first chunk's input-gradient;
8. the ``r+1`` weight-gradients left.

A pair is its forward then its backward on the device's stream: the simulator has no communication inside a
stage to hide, so F&B takes F + B.

DualPipe itself (DeepSeek-V3; deepseek-ai/DualPipe, ``dualpipe.py``) runs two pipelines of ``p`` stages over ``p``
devices (p even), one fed from the first device and one from the last, each with half the microbatches: device r
holds stage r of the first and stage ``p-1-r`` of the second, so every device holds two stages' parameters. Its
eight steps are DualPipeV's with ``p/2`` ranks and ``m/2`` microbatches: device r runs DualPipeV's order of rank
``h = min(r, p-1-r)``, its first chunk (V stage h) being the pipeline in which r sits h from the start and its second
(V stage p-1-h) the other, where r sits h from the end (``dualpipe``). So devices r and p-1-r run mirrored orders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipescope.simulator.ir import Action, ActionKind, Schedule, v_placement
from pipescope.simulator.schedules.common import check_two_pipelines, v_chunks

K = ActionKind


class _Device:
    """One device's order as it is written: each chunk's next microbatch per pass, and the deferred W's."""

    def __init__(self, rank: int, p: int) -> None:
        self.stages = (rank, 2 * p - 1 - rank)  # the V's first and second leg
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.deferred: deque[Action] = deque()
        self.order: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []

    def forward(self, chunk: int) -> None:
        self.order.append(Action(self.stages[chunk], K.F, self.forwards[chunk]))
        self.forwards[chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        """A whole backward (B), or with ``split`` its input-gradient (I), the weight-gradient deferred."""
        stage, microbatch = self.stages[chunk], self.backwards[chunk]
        self.backwards[chunk] += 1
        self.order.append(Action(stage, K.I if split else K.B, microbatch))
        if split:
            self.deferred.append(Action(stage, K.W, microbatch))

    def weight(self) -> None:
        """The oldest deferred weight-gradient, if one waits."""
        if self.deferred:
            self.order.append(self.deferred.popleft())

    def pair(self, forward_chunk: int) -> None:
        """An F&B pair: a forward of ``forward_chunk`` and a whole backward of the other chunk."""
        self.forward(forward_chunk)
        self.backward(1 - forward_chunk)
        self.pairs.append((self.order[-2], self.order[-1]))


def _repeat(times: int, step: Callable[[int], None]) -> None:
    for i in range(times):
        step(i)


def device_order(rank: int, p: int, m: int) -> _Device:
    """Device ``rank``'s DualPipeV order (the module doc's eight phases) and its F&B pairs."""
    d, last = _Device(rank, p), rank == p - 1
    _repeat(2 * (p - rank - 1), lambda _: d.forward(0))
    _repeat(rank + 1, lambda _: (d.forward(0), d.forward(1)))
    _repeat(p - rank - 1, lambda _: (d.backward(1, split=True), d.weight(), d.forward(1)))

    def steady(i: int) -> None:
        if i == 0 and last:  # the same ops as the pair, not overlapped
            d.forward(0)
            d.backward(1)
        else:
            d.pair(0)
        d.pair(1)

    _repeat(m - 2 * p + rank + 1, steady)
    _repeat(p - rank - 1, lambda _: (d.backward(1), d.pair(1)))
    half, odd = (rank + 1) // 2, rank % 2 == 1
    _repeat(rank + 1, lambda i: (d.backward(1, split=i > half or (i == half and odd)),
                                 d.backward(0, split=i >= half)))
    _repeat(p - rank - 1, lambda _: (d.weight(), d.backward(0, split=True)))
    _repeat(rank + 1, lambda _: d.weight())
    return d


def dualpipe(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """DualPipe for ``p`` devices (even): stages ``0..p-1`` the pipeline fed from device 0, ``p..2p-1`` the one fed
    from device p-1 (stage ``p+j`` on device ``p-1-j``), each with ``m/2`` of the ``m`` microbatches (``m`` even and at
    least ``2p``, DeepSeek's bound); microbatches ``0..m/2-1`` take the first (``Schedule.pipeline_of``)."""
    check_two_pipelines("dualpipe", p, chunks)
    if m % 2 or m < 2 * p:
        raise ValueError(f"schedule.microbatches: got {m}, expected an even number from 2 x schedule.stages (={p}) "
                         f"= {2 * p} for dualpipe: half of them feed each pipeline, whose warm-up needs p")
    half, per = p // 2, m // 2
    orders, pairs = [], set()
    for r in range(p):
        order = device_order(min(r, p - 1 - r), half, per)

        def place(a: Action, first_half: bool = r < half) -> Action:
            # V stage s < p/2 is the device's pipeline in which it sits early; the first half's is the first pipeline
            if (a.stage < half) == first_half:
                return a
            return Action(p + a.stage, a.kind, per + a.microbatch)

        orders.append(tuple(map(place, order.order)))
        pairs |= {(place(f), place(b)) for f, b in order.pairs}
    return Schedule("dualpipe", p, m, v_placement(p), tuple(orders), recompute=recompute, weight_versions=(1,) * p,
                    overlapped=frozenset(pairs), pipelines=2)


def dualpipev(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """DualPipeV for ``p`` devices, ``2p`` stages in a V, ``m >= 2p`` microbatches (torch's bound: every stage's
    warm-up needs them)."""
    v_chunks("dualpipev", chunks)
    if p < 1:
        raise ValueError(f"schedule.stages: got {p}, expected at least 1 for dualpipev")
    if m < 2 * p:
        raise ValueError(f"schedule.microbatches: got {m}, expected at least 2 x schedule.stages (={p}) = {2 * p} for "
                         f"dualpipev: its warm-up feeds every one of its 2p stages before the steady state")
    devices = [device_order(r, p, m) for r in range(p)]
    return Schedule("dualpipev", p, m, v_placement(p), tuple(tuple(d.order) for d in devices), recompute=recompute,
                    weight_versions=(1,) * p, overlapped=frozenset(pair for d in devices for pair in d.pairs))
