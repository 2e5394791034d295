"""Stage-by-stage op times: every stage of a schedule run by the executor on one rank, one op after another.

This is how Megatron's own pipeline simulator gets its costs: time each stage's forward and backward on one device,
then replay the schedule over those times. ``validate --op-times stages`` uses it so that the prediction is checked
on what the simulator is responsible for (the order, the dependencies, the transfers and what overlaps), with op
costs measured by the same code the pipeline runs rather than by ``calibrate``'s kernel benches
(docs/validation.md, "Two sources of op times").

The serial program puts all stages on device 0 and runs each microbatch's forward through every stage, then its
backward back (B, or I then W where the schedule splits backwards); the executor hands activations between stages on
one rank without a transfer, then steps each stage's optimizer. A forward thus follows a backward, as in 1F1B.

With more CPU ranks than cores, validate runs that rank as several copies at once (replicas whose gradients are
averaged) and times each op by its thread's CPU time: the cost of an op when ranks take turns on a core, whose wait
for the core the simulation adds itself (docs/validation.md, "More ranks than cores").
"""

from __future__ import annotations

import dataclasses
import statistics

from pipescope.executor.run import RunResult, RunSpec, execute_timed
from pipescope.simulator.ir import Action, ActionKind, Schedule

K = ActionKind
TIMED_KINDS = {K.F.value, K.B.value, K.I.value, K.W.value, K.OPT.value}  # the rows' kinds are the enum's values
BACKWARDS = {K.B.value, K.I.value, K.W.value}


def serial_schedule(schedule: Schedule) -> Schedule:
    """``schedule``'s stages on one device, microbatch after microbatch: F through every stage, then the backward
    (B, or I then W when ``schedule`` splits it) from the last stage back. Always a flush, so each stage's OPT is a
    flush's step: PipeDream's and 2BW's copy of the newest weights into a version buffer, and PipeDream's
    per-backward norm, are not in it."""
    stages = range(schedule.num_stages)
    back = [K.I, K.W] if schedule.splits_backward else [K.B]
    actions: list[Action] = []
    for mb in range(schedule.num_microbatches):
        actions += [Action(s, K.F, mb) for s in stages]
        actions += [Action(s, kind, mb) for kind in back for s in reversed(stages)]
    return Schedule(f"{schedule.name} stage by stage", 1, schedule.num_microbatches, (0,) * schedule.num_stages,
                    (tuple(actions),), recompute=schedule.recompute)


def stage_op_times(spec: RunSpec, copies: int = 1, cpu_time: bool = False) -> list[dict[str, int]]:
    """Per stage of ``spec.schedule``, the mean ns of each op it runs (F, B or I and W, OPT) over ``spec.iterations``
    runs of its serial program on ``copies`` spawned ranks at once (``spec``'s warm-up dropped;
    ``executor.execute_timed``), by the wall clock or by each rank's thread CPU time."""
    serial = dataclasses.replace(spec, schedule=serial_schedule(spec.schedule), data_parallel=copies,
                                 cpu_time=cpu_time)
    return op_means(execute_timed(serial), spec.schedule.num_stages)


def op_means(run: RunResult, num_stages: int) -> list[dict[str, int]]:
    """Mean duration (ns) per stage and op kind over every measured run's rows of every rank (the copies run the
    same program), the optimizer step with its share of the gradient norm (``norm_shares``).

    The mean, not the median: an iteration is a sum of ops, so its typical length is the sum of their means, and
    CPU op times have a long upper tail that a median drops (docs/validation.md, "Two sources of op times")."""
    samples: list[dict[str, list[int]]] = [{} for _ in range(num_stages)]
    for rows in (rank for ranks in run.rows for rank in ranks):
        steps = norm_shares(rows)
        for _, kind, stage, _, start, end in rows:
            if kind in TIMED_KINDS:
                norm = steps.get(stage, 0) if kind == K.OPT.value else 0
                samples[stage].setdefault(kind, []).append(end - start + norm)
    return [{kind: int(statistics.mean(values)) for kind, values in ops.items()} for ops in samples]


def norm_shares(rows: list) -> dict[int, int]:
    """Each stage's share of the gradient norm that a flush computes between its last backward and its first step
    (the gap there), by its step's duration (both read every gradient once). The simulator's step stands for the
    norm and the step (``StageCost.optimizer_ns``); the norm's own all-reduce is a collective of its own."""
    opt = [(stage, start, end) for _, kind, stage, _, start, end in rows if kind == K.OPT.value]
    if not opt:
        return {}
    first = min(start for _, start, _ in opt)
    ends = [end for _, kind, _, _, _, end in rows if kind in BACKWARDS and end <= first]
    if not ends:
        return {}
    steps = {stage: end - start for stage, start, end in opt}
    gap, total = first - max(ends), sum(steps.values()) or 1
    return {stage: gap * ns // total for stage, ns in steps.items()}
