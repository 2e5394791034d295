"""The optimizer step as part of the iteration: one ``sOPTk`` per stage and iteration, after the backwards it
applies (simulator/lowering.py ``add_optimizer_steps``), waiting for the stage's gradient all-reduce."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from pipescope.simulator.costs import StageCost, UniformCosts
from pipescope.simulator.engine import Engine
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.oracle import Oracle
from pipescope.simulator.replicas import GradSync, data_parallel
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import prepare, simulate
from tests.test_network import servers

GB = 1e9
STEP_NS = 500_000_000  # a whole device-stage's step: 0.5 s against F = I = W = 1 s


@dataclasses.dataclass(frozen=True)
class StepCosts(UniformCosts):
    """Uniform costs plus an optimizer step of STEP_NS per device-stage, and parameters to all-reduce."""

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        cost = super().stage_cost(stage, num_stages, chunks)
        return dataclasses.replace(cost, optimizer_ns=STEP_NS // chunks, params=10**9 // chunks)


def _steps(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["kind"] == "OPT"]


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-v", 2)])
def test_flush_schedules_step_every_stage_once_after_the_devices_last_op(name: str, chunks: int) -> None:
    schedule = build(name, 4, 8, chunks=chunks)
    base, stepped = simulate(schedule, UniformCosts()), simulate(schedule, StepCosts())
    frame, steps = stepped.timeline, _steps(stepped.timeline)
    assert sorted(steps["stage"]) == list(range(4 * chunks))
    assert set(steps["microbatch"]) == {7}  # the iteration's last microbatch, as its all-reduce is numbered
    assert ((steps["end_ns"] - steps["start_ns"]) == STEP_NS // chunks).all()
    for _, rows in frame[frame["stream"] == "compute"].groupby("device"):
        assert set(rows.sort_values("start_ns")["kind"].iloc[-chunks:]) == {"OPT"}  # after every F, I, W, B
    # nothing waits for a step, so the iteration grows by the step of the device that ends last
    assert stepped.makespan_ns == base.makespan_ns + STEP_NS
    assert stepped.devices[0].busy_s == pytest.approx(base.devices[0].busy_s + STEP_NS / 1e9)


def test_schedules_that_span_iterations_step_before_the_forward_that_needs_the_update() -> None:
    schedule = build("2bw", 4, 8, iterations=4)
    frame = simulate(schedule, StepCosts()).timeline
    compute = frame[frame["stream"] == "compute"].sort_values("start_ns")
    for stage in range(4):
        rows = compute[compute["device"] == stage].reset_index(drop=True)
        for k in range(4):
            at = rows.index[rows["action"] == f"{stage}OPT{8 * k + 7}"]
            assert len(at) == 1
            backwards = rows[(rows["kind"] == "B") & (rows["microbatch"] // 8 == k)]
            assert backwards.index.max() < at[0]  # after the iteration's gradients
            if k + 2 < 4:  # just before the first forward of iteration k + 2, the first that uses the update
                assert rows.loc[at[0] + 1, "action"] == f"{stage}F{8 * (k + 2)}"


def test_no_step_time_means_no_step_op_and_the_closed_forms_untouched() -> None:
    result = simulate(build("1f1b", 4, 8), UniformCosts())
    assert _steps(result.timeline).empty
    assert result.iteration_time_s == pytest.approx((8 + 3) * 3)  # (m + p - 1)(F + B)


def test_the_step_waits_for_the_stages_all_reduce_and_engine_equals_oracle() -> None:
    schedule = build("1f1b", 4, 8)
    program, stage_costs = prepare(schedule, StepCosts())
    grads = [c.params * 2 for c in stage_costs]
    program = data_parallel(program, schedule, 2, grads, GradSync(bucket_bytes=512 << 20))
    engine = Engine(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    for entry, action in enumerate(program.actions):
        if action.kind is ActionKind.OPT:
            stage = action.stage
            reduces = [program.flow_of[i] for i, a in enumerate(program.actions)
                       if a.kind is ActionKind.ALL_REDUCE and a.stage == stage]
            assert reduces
            assert engine.entry_start[entry] >= max(engine.flow_end[f] for f in reduces)
