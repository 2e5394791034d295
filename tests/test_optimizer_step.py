"""The optimizer step as part of the iteration: ``sOPTk`` ops where the real executor runs them (after the device's
last op behind clipping's norm all-reduce for flush schedules, after each stage's last backward of an iteration for
2BW, after every backward for PipeDream; simulator/lowering.py ``add_optimizer_steps``), each waiting for its stage's
gradient all-reduce."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from pipescope.simulator.costs import StageCost, UniformCosts
from pipescope.simulator.engine import Engine
from pipescope.simulator.ir import ActionKind, Collective
from pipescope.simulator.lowering import NORM_BYTES, add_optimizer_steps, lower
from pipescope.simulator.memory_overheads import NCCL_COMMUNICATOR_BYTES
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


def _device_lists(name: str, **kw) -> list[list]:
    """The lowered program with its steps, per device (what ``simulate`` runs when steps take time)."""
    return [list(acts) for acts in add_optimizer_steps(lower(build(name, 4, 8, **kw))).device_actions]


def _after_backward(acts: list, at: int, microbatch: int) -> None:
    """The step at ``at`` follows the backward of ``microbatch`` directly, or that backward's SEND_B."""
    before = acts[at - 1]
    if before.kind is ActionKind.SEND_B:
        before = acts[at - 2]
    assert (before.kind, before.microbatch) == (ActionKind.B, microbatch), (acts[at], before)


def test_2bw_steps_each_stage_right_after_its_last_backward_of_each_iteration() -> None:
    """As the executor does (SCHEDULES.md section 3): the next iteration's backwards accumulate into the buffer."""
    for stage, acts in enumerate(_device_lists("2bw", iterations=4)):
        steps = [at for at, a in enumerate(acts) if a.kind is ActionKind.OPT]
        assert [str(acts[at]) for at in steps] == [f"{stage}OPT{8 * k + 7}" for k in range(4)]
        for k, at in enumerate(steps):
            _after_backward(acts, at, 8 * k + 7)
            assert all(a.microbatch // 8 > k for a in acts[at + 1:] if a.kind is ActionKind.B)
        if stage > 0:  # the gradient the previous stage waits for leaves before the step
            assert acts[steps[0] - 1].kind is ActionKind.SEND_B


def test_pipedream_steps_after_every_backward_named_by_its_microbatch() -> None:
    """One step per backward, right after it and its SEND_B, named sOPTk with k the microbatch (the executor's
    rows carry the same names, so validate matches them)."""
    for stage, acts in enumerate(_device_lists("pipedream", iterations=2)):
        steps = [at for at, a in enumerate(acts) if a.kind is ActionKind.OPT]
        assert [acts[at].microbatch for at in steps] == list(range(16))
        for at in steps:
            assert acts[at].stage == stage
            _after_backward(acts, at, acts[at].microbatch)


def test_pipedream_steps_lengthen_every_device_by_m_steps_per_iteration() -> None:
    schedule = build("pipedream", 4, 8, iterations=3)
    result = simulate(schedule, StepCosts())
    base = simulate(schedule, UniformCosts())
    for stepped, plain in zip(result.devices, base.devices):
        assert stepped.busy_s == pytest.approx(plain.busy_s + 3 * 8 * STEP_NS / 1e9)


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


def test_flush_clipping_all_reduces_the_norm_over_the_pipeline_before_any_step() -> None:
    """Each device ends with the 8-byte norm all-reduce over the pipeline's devices, then its steps: so every step
    starts once the slowest device's backward and the all-reduce have ended."""
    lists = _device_lists("1f1b")
    norm = Collective(-1, ActionKind.ALL_REDUCE, 7, (0, 1, 2, 3), NORM_BYTES)
    for device, acts in enumerate(lists):
        assert acts[-2:] == [norm, (device, ActionKind.OPT, 7)]
    result = simulate(build("1f1b", 4, 8), StepCosts(), servers(1, 4, 450 * GB, 2 * GB))
    frame = result.timeline
    steps, reduce = _steps(frame), frame[frame["kind"] == "ALL_REDUCE"]
    backwards_end = frame[frame["kind"] == "B"]["end_ns"].max()
    assert len(set(reduce["end_ns"])) == 1 and reduce["bytes"].eq(NORM_BYTES).all()
    assert reduce["start_ns"].min() >= backwards_end  # the last member to join starts it
    assert reduce["end_ns"].iloc[0] > reduce["start_ns"].iloc[0]  # it takes time on this network
    assert (steps["start_ns"] == reduce["end_ns"].iloc[0]).all()


def test_no_step_time_means_no_norm_all_reduce() -> None:
    assert not any(isinstance(a, Collective) for acts in lower(build("1f1b", 4, 8)).device_actions for a in acts)
    frame = simulate(build("1f1b", 4, 8), UniformCosts(), servers(1, 4, 450 * GB, 2 * GB)).timeline
    assert (frame["kind"] != "ALL_REDUCE").all()


@pytest.mark.parametrize("name, iterations", [("1f1b", 1), ("2bw", 3), ("pipedream", 2)])
def test_data_parallel_steps_wait_for_their_own_all_reduce(name: str, iterations: int) -> None:
    """Replicas get their own norm all-reduce (groups shifted); PipeDream all-reduces each backward's gradient
    before its step, 2BW each iteration's; engine equals oracle."""
    schedule = build(name, 4, 8, iterations=iterations) if iterations > 1 else build(name, 4, 8)
    program, stage_costs = prepare(schedule, StepCosts())
    program = data_parallel(program, schedule, 2, [c.params * 2 for c in stage_costs], GradSync(512 << 20))
    network = servers(2, 4, 450 * GB, 2 * GB)
    engine = Engine(program, network).run()
    assert engine == Oracle(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    norms = {a.group for a in program.actions if isinstance(a, Collective) and a.stage == -1}
    assert norms == ({(0, 1, 2, 3), (4, 5, 6, 7)} if name == "1f1b" else set())
    per_step = 1 if name == "pipedream" else 8
    for entry, action in enumerate(program.actions):
        if action.kind is ActionKind.OPT:
            reduces = [program.flow_of[i] for i, a in enumerate(program.actions) if isinstance(a, Collective)
                       and (a.stage, a.microbatch) == (action.stage, action.microbatch)]
            assert len(reduces) == 2 * len(set(reduces)) > 0  # each bucket: one flow, an entry per replica
            assert engine.entry_start[entry] >= max(engine.flow_end[f] for f in reduces)
    steps = sum(a.kind is ActionKind.OPT for a in program.actions)
    assert steps == 2 * 4 * iterations * 8 // per_step


@dataclasses.dataclass(frozen=True)
class ParamCosts(UniformCosts):
    """Parameters to all-reduce, no step time: no OPT op."""

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        return dataclasses.replace(super().stage_cost(stage, num_stages, chunks), params=10**9 // chunks)


def test_without_step_time_pipedreams_next_forward_waits_for_the_backwards_all_reduce() -> None:
    """PipeDream's next forward runs on the newest weights, so with no step op it waits for the all-reduce of the
    stage's previous backward instead."""
    schedule = build("pipedream", 4, 8, iterations=2)
    program, stage_costs = prepare(schedule, ParamCosts())
    assert not any(a.kind is ActionKind.OPT for a in program.actions)
    program = data_parallel(program, schedule, 2, [c.params * 2 for c in stage_costs], GradSync(512 << 20))
    engine = Engine(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(2, 4, 450 * GB, 2 * GB)).run()
    ends = {}
    for i, a in enumerate(program.actions):
        if isinstance(a, Collective):
            key = (a.stage, a.microbatch, program.device[i] // 4)
            ends[key] = max(ends.get(key, 0), engine.flow_end[program.flow_of[i]])
    checked = 0
    for device in range(8):
        ops = [i for i in program.device_steps[device] if not isinstance(program.actions[i], Collective)]
        for at, i in enumerate(ops):
            done = program.actions[i]
            forward = next((j for j in ops[at + 1:] if program.actions[j].kind is ActionKind.F), None)
            if done.kind is ActionKind.B and forward is not None:
                assert engine.entry_start[forward] >= ends[done.stage, done.microbatch, device // 4]
                checked += 1
    assert checked > 0


def test_2bw_with_replicas_defers_its_step_and_keeps_a_second_gradient_buffer() -> None:
    """2BW with w > 1 steps as PipeDream-2BW's runtime does: iteration k's step just before the stage's first
    forward of iteration k + 2 (its all-reduce hidden behind iteration k + 1), and each device holds a second
    gradient buffer; with w = 1 it steps right after the iteration's last backward, as the executor does."""
    import pipescope

    def run(width: int):
        return pipescope.run(pipescope.load_config(raw={
            "schedule": {"name": "2bw", "stages": 2, "microbatches": 4},
            "model": {"preset": "gpt-355m"}, "cluster": {"topology": "dgx-h100", "data_parallel": width}}))

    alone, replicated = run(1), run(2)
    order = {w: [a for a in r.timeline.query("device == 0").action if a.startswith(("0F", "0OPT"))]
             for w, r in ((1, alone), (2, replicated))}
    assert order[1].index("0OPT3") == order[1].index("0F4") + 1  # after iteration 0's last backward, among F4..
    assert order[2].index("0OPT3") == order[2].index("0F8") - 1  # just before iteration 2's first forward
    gradients = [c.params * 4 for c in alone.stage_costs]  # Megatron's fp32 main_grad under bf16
    communicator = replicated.memory_overheads.nccl - alone.memory_overheads.nccl  # the data-parallel group's
    assert communicator == NCCL_COMMUNICATOR_BYTES
    assert [d.static_memory_bytes for d in replicated.devices[:2]] == [
        d.static_memory_bytes + g + communicator for d, g in zip(alone.devices, gradients)]
