"""Chimera (Li and Hoefler, SC'21, arXiv 2107.06925; docs/schedules.md, "Chimera"): two pipelines of ``p`` stages
over the same ``p`` devices (p even), one with stage ``k`` on device ``k`` ("down") and one with stage ``k`` on device
``p-1-k`` ("up"), so every device holds two stages' parameters.

The order is Chimera's unit-time construction, as its authors' runtime builds it (Shigangli/Chimera,
``chimera_pipeline_rank.py``): a unit of ``p`` microbatches gives each pipeline ``p/2``, injected two steps apart; a
microbatch does its forward at one stage per step down its pipeline, then its whole backward at one stage per step
back, so microbatch ``j`` of a unit starting at step ``t`` runs stage ``k``'s forward at ``t + 2j + k`` and its
backward at ``t + 2j + 2p - 1 - k``; the two pipelines never ask a device for the same step. With ``m > p`` the units
are concatenated: the next starts when the previous unit's first microbatch has come back, ``2p`` steps later
(the paper's "direct concatenation"). Each device runs its ops in step order.
"""

from __future__ import annotations

from pipescope.simulator.ir import Action, ActionKind, Schedule, v_placement
from pipescope.simulator.schedules.common import check_two_pipelines

K = ActionKind


def chimera(p: int, m: int, chunks: int = 1, recompute: bool = False) -> Schedule:
    """Chimera for ``p`` devices (even) and ``m`` microbatches, a multiple of ``p``: microbatches ``0..m/2-1`` run
    through the down pipeline (stages ``0..p-1``), the rest through the up one (stage ``p+k`` on device ``p-1-k``)."""
    check_two_pipelines("chimera", p, chunks)
    if m % p:
        raise ValueError(f"schedule.microbatches: got {m}, expected a multiple of schedule.stages (={p}) for "
                         f"chimera: it runs units of p microbatches, p/2 in each direction")
    half, per = p // 2, m // 2
    steps: list[dict[int, Action]] = [{} for _ in range(p)]
    for unit in range(m // p):
        for j in range(half):
            start = 2 * p * unit + 2 * j
            for pipeline in (0, 1):
                microbatch = pipeline * per + unit * half + j
                for k in range(p):
                    device = k if pipeline == 0 else p - 1 - k
                    for step, kind in ((start + k, K.F), (start + 2 * p - 1 - k, K.B)):
                        if step in steps[device]:  # the construction never collides; a change that did is a bug
                            raise AssertionError(f"chimera p={p} m={m}: two ops on device {device} at step {step}")
                        steps[device][step] = Action(pipeline * p + k, kind, microbatch)
    orders = tuple(tuple(ops[s] for s in sorted(ops)) for ops in steps)
    return Schedule("chimera", p, m, v_placement(p), orders, recompute=recompute, weight_versions=(1,) * p,
                    pipelines=2)
