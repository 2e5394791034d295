"""Zero-bubble schedules (Qi et al., ICLR 2024): ZB-H1, ZB-H2 and ZB-V.

The backward is split into I (input-grad, on the critical path) and W (weight-grad,
free to move after its I); the W's are moved into what would otherwise be bubbles.
"""

from __future__ import annotations

from collections import Counter

from pipescope.simulator.ir import ActionKind, Action, Schedule, looped_placement, v_placement
from pipescope.simulator.schedules.common import check_sizes, v_chunks


class OrderBuilder:
    """One device's op list; each stage's F, I and W are numbered 0, 1, 2, ... as they are added."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.ops: list[Action] = []
        self.count: Counter[tuple[int, str]] = Counter()

    def left(self, stage: int, kind: ActionKind) -> int:
        """How many ``kind`` ops of ``stage`` are still to be added."""
        return self.m - self.count[(stage, kind)]

    def add(self, stage: int, *kinds: ActionKind) -> None:
        """Append the next microbatch of each kind, skipping kinds that are used up."""
        for kind in kinds:
            if self.left(stage, kind) > 0:
                self.ops.append(Action(stage, kind, self.count[(stage, kind)]))
                self.count[(stage, kind)] += 1

    def drain(self, stage: int) -> None:
        """The cool-down: [I, W] while I's are left, then the W's still deferred."""
        while self.left(stage, ActionKind.I):
            self.add(stage, ActionKind.I, ActionKind.W)
        while self.left(stage, ActionKind.W):
            self.add(stage, ActionKind.W)


def zb_h1_order(r: int, p: int, m: int) -> list[Action]:
    """Device r: 1F1B with I for B, its first W only after r+1 I's (so r W's are left for the drain).

    Order: F x (p-r), I, [F, I] x r, W, [F, I, W] x (m-p), [I, W] x (p-r-1), W x r.
    """
    out = OrderBuilder(m)
    for _ in range(p - r):
        out.add(r, ActionKind.F)
    out.add(r, ActionKind.I)
    for _ in range(r):
        out.add(r, ActionKind.F, ActionKind.I)
    out.add(r, ActionKind.W)
    while out.left(r, ActionKind.F):
        out.add(r, ActionKind.F, ActionKind.I, ActionKind.W)
    out.drain(r)
    return out.ops


def zb_h2_order(r: int, p: int, m: int) -> list[Action]:
    """Device r: F x (2(p-r)-1), [I, F] x 2r, [I, W, F] while F's last, [I, W], leftover W's.

    The extra warm-up forwards fill the wait for the first I. Device r defers 2r W's
    (docs/schedules.md's recipe says r): the drain needs device r to end with its last I
    followed by 2r+1 W's, and with only r deferred the first devices idle in the drain
    and the bubble stays ZB-H1's. In-flight activations 2(p-r)-1 plus 2r deferred W's
    keep every device within the paper's (2p-1) M_B. With m < 2p-1 the phases are cut short.
    """
    out = OrderBuilder(m)
    for _ in range(2 * (p - r) - 1):
        out.add(r, ActionKind.F)
    for _ in range(2 * r):
        if out.left(r, ActionKind.F):
            out.add(r, ActionKind.I, ActionKind.F)
    while out.left(r, ActionKind.F):
        out.add(r, ActionKind.I, ActionKind.W, ActionKind.F)
    out.drain(r)
    return out.ops


def zb_v_order(r: int, p: int, m: int) -> list[Action]:
    """Device r of ZB-V (torch ScheduleZBVZeroBubble): chunk 0 is stage r, chunk 1 stage 2p-1-r.

    Warm-up: F0 x (2(p-r)-1), [F1, F0] x r, [F1, I1, W1] x (p-r); steady: [F0, I0, W0, F1, I1, W1]
    until the forwards run out; cool-down: [I0, I1] x r, [I0, W0] x (p-r), then the W's left.
    Built for n = max(m, 2p-1) microbatches and cut to m (dropping microbatches keeps it valid).
    """
    n = max(m, 2 * p - 1)
    c0, c1 = r, 2 * p - 1 - r
    out = OrderBuilder(n)
    for _ in range(2 * (p - r) - 1):
        out.add(c0, ActionKind.F)
    for _ in range(r):
        out.add(c1, ActionKind.F)
        out.add(c0, ActionKind.F)
    for _ in range(p - r):
        out.add(c1, ActionKind.F, ActionKind.I, ActionKind.W)
    while out.left(c1, ActionKind.F):
        out.add(c0, ActionKind.F, ActionKind.I, ActionKind.W)
        out.add(c1, ActionKind.F, ActionKind.I, ActionKind.W)
    for _ in range(r):
        out.add(c0, ActionKind.I)
        out.add(c1, ActionKind.I)
    while out.left(c0, ActionKind.I):
        out.add(c0, ActionKind.I, ActionKind.W)
    while out.left(c1, ActionKind.W):
        out.add(c1, ActionKind.W)
    while out.left(c0, ActionKind.W):
        out.add(c0, ActionKind.W)
    return [a for a in out.ops if a.microbatch < m]


def zb_h1(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """ZB-H1: 1F1B's memory (p in-flight microbatches), bubble (p-1)(F+I-W)."""
    _single_stage_checks("zb-h1", p, m, chunks)
    lists = tuple(tuple(zb_h1_order(r, p, m)) for r in range(p))
    return Schedule("zb-h1", p, m, looped_placement(p, 1), lists, recompute=recompute,
                    weight_versions=(1,) * p)


def zb_h2(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """ZB-H2: up to 2p-1 in-flight microbatches, bubble (p-1)(F+I-2W) (zero when F = I = W)."""
    _single_stage_checks("zb-h2", p, m, chunks)
    lists = tuple(tuple(zb_h2_order(r, p, m)) for r in range(p))
    return Schedule("zb-h2", p, m, looped_placement(p, 1), lists, recompute=recompute,
                    weight_versions=(1,) * p)


def zb_v(p: int, m: int, chunks: int = 2, recompute: bool = False) -> Schedule:
    """ZB-V: V placement (2p stages), p microbatches' activations per device, no bubble when F = I = W."""
    v_chunks("zb-v", chunks)
    check_sizes("zb-v", p, m, min_m=p)
    lists = tuple(tuple(zb_v_order(r, p, m)) for r in range(p))
    return Schedule("zb-v", p, m, v_placement(p), lists, recompute=recompute,
                    weight_versions=(1,) * p)


def _single_stage_checks(name: str, p: int, m: int, chunks: int) -> None:
    check_sizes(name, p, m, min_m=p)
    if chunks != 1:
        raise ValueError(f"schedule.chunks: got {chunks}, expected 1 for {name}; use 'zb-v' for two chunks")
