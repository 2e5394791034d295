"""The one-process reference the executor's numerics are checked against: the same model, batch and update rule,
one microbatch at a time, every weight version kept.

Microbatch j of stage s runs with the version the rule gives it: the newest (flush); max(T-1, 0) for global
iteration T (2BW); under PipeDream, the version the stage had when its forward ran in the schedule, i.e. the steps it
had taken by then (its backwards before that forward on its device). Replica r's microbatches are the executor's
(``executor.state.global_microbatch``), each loss divided by w, so the gradient is the average over the replicas.
Then each stage steps as the executor does (``executor.weights.StageWeights.step``), after every microbatch under
PipeDream and after every iteration otherwise, with the same clipping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipescope.executor.state import batch, build_modules, global_microbatch, stage_modules
from pipescope.executor.weights import StageWeights, UpdateRule, clip_coefficient, squared_norm
from pipescope.simulator.ir import ActionKind, Schedule

if TYPE_CHECKING:
    from pipescope.executor.spec import RunSpec


@dataclass
class Reference:
    """The mean loss of every optimizer iteration, each parameter's gradient before its last step (before
    clipping), and its final value, by name."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]

    @property
    def loss(self) -> float:
        return self.losses[-1]


def reference_step(spec: RunSpec) -> Reference:
    """Train ``spec``'s model in one process for ``warmup + iterations`` runs of its schedule (see the module doc)."""
    torch.set_num_threads(1)
    schedule, width = spec.schedule, spec.data_parallel
    m, k = schedule.num_microbatches, schedule.iterations
    rule = UpdateRule.of(schedule.weight_update, m, k)
    parts = stage_modules(spec.shape, schedule.num_stages, spec.layers_per_stage)
    modules = build_modules(spec.shape, spec.seed)
    stages = [StageWeights({i: modules[i] for i in part}, spec.optimizer, spec.lr) for part in parts]
    history = [[_snapshot(stage)] for stage in stages]  # per stage, every version it has had
    data = batch(spec.shape, spec.microbatch_size, k * m * width, spec.seed)
    steps_before = _steps_before_forward(schedule) if rule.per_microbatch else {}
    runs, losses, grads = spec.warmup + spec.iterations, [], {}
    output_layer = spec.shape.layers + 1
    for run in range(runs):
        base = [len(h) - 1 for h in history]
        for t in range(k):
            total = 0.0
            for j in range(t * m, (t + 1) * m):
                versions = [_version(rule, steps_before, base[s], s, j, len(history[s]) - 1)
                            for s in range(len(stages))]
                for replica in range(width):
                    ids, targets = data[global_microbatch(replica, j, m, width)]
                    x = ids
                    for s, stage in enumerate(stages):
                        for index in parts[s]:
                            x = stage.call(index, history[s][versions[s]], x,
                                           *((targets,) if index == output_layer else ()))
                    total += x.item() / (m * width)
                    (x / (rule.loss_divisor * width)).backward()
                if rule.per_microbatch:
                    _step(spec, rule, stages, history, versions, grads if run == runs - 1 and j == k * m - 1 else None)
            if not rule.per_microbatch:
                _step(spec, rule, stages, history, versions, grads if run == runs - 1 and t == k - 1 else None)
            losses.append(total)
    return Reference(losses, grads, {n: t for stage in stages for n, t in stage.named(stage.own).items()})


def _snapshot(stage: StageWeights) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in stage.own]


def _version(rule: UpdateRule, steps_before: dict[tuple[int, int], int], base: int, stage: int, microbatch: int,
             newest: int) -> int:
    lagged = rule.lagged_version(base, microbatch)
    if lagged is not None:
        return lagged
    if rule.per_microbatch:
        return base + steps_before[stage, microbatch]
    return newest


def _steps_before_forward(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(stage, microbatch) -> the backwards (W or B: each ends in a step under PipeDream) that stage ran on its
    device before that microbatch's forward."""
    found: dict[tuple[int, int], int] = {}
    for device in range(schedule.num_devices):
        done: dict[int, int] = {}
        for a in schedule.compute_actions(device):
            if a.kind is ActionKind.F:
                found[a.stage, a.microbatch] = done.get(a.stage, 0)
            elif a.kind in (ActionKind.W, ActionKind.B):
                done[a.stage] = done.get(a.stage, 0) + 1
    return found


def _step(spec: RunSpec, rule: UpdateRule, stages: list[StageWeights], history: list[list[torch.Tensor]],
          versions: list[int], keep: dict[str, torch.Tensor] | None) -> None:
    """Every stage steps on the gradient its version collected (clipped over all stages for flush schedules, per
    stage otherwise); the new version joins the history. ``keep`` receives the gradients before clipping."""
    for stage, tensors, version in zip(stages, history, versions):
        with torch.no_grad():
            stage.grad.copy_(torch.cat([_grad(t).reshape(-1) for t in tensors[version]]))
        for t in tensors[version]:
            t.grad = None
    if keep is not None:
        for stage in stages:
            keep.update(stage.named([p.grad for p in stage.own]))
    total = sum(squared_norm([stage.grad]) for stage in stages)
    for stage, tensors in zip(stages, history):
        squared = total if not rule.inline else squared_norm([stage.grad])
        stage.step(clip_coefficient(squared, spec.clip_norm), lagged=False)
        tensors.append(_snapshot(stage))


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)
