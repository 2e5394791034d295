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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipescope.simulator.ir import Action, ActionKind, Schedule, v_placement
from pipescope.simulator.schedules.common import v_chunks

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


def dualpipev(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """DualPipeV for ``p`` devices, ``2p`` stages in a V, ``m >= 2p`` microbatches (torch's bound: every stage's
    warm-up needs them)."""
    v_chunks("dualpipev", chunks)
    if p < 1:
        raise ValueError(f"schedule.stages(={p}) must be >= 1 for dualpipev")
    if m < 2 * p:
        raise ValueError(f"schedule.microbatches(={m}) must be >= 2 x schedule.stages(={p}) = {2 * p} for "
                         f"dualpipev: its warm-up feeds every one of its 2p stages before the steady state")
    devices = [device_order(r, p, m) for r in range(p)]
    return Schedule("dualpipev", p, m, v_placement(p), tuple(tuple(d.order) for d in devices), recompute=recompute,
                    weight_versions=(1,) * p, overlapped=frozenset(pair for d in devices for pair in d.pairs))
