"""One call from a schedule, a cost model and a network to a SimResult."""

from __future__ import annotations

import time
from typing import Any

from pipescope.simulator.check import structure_problems
from pipescope.simulator.costs import CostModel, StageCost, check_stage_costs
from pipescope.simulator.engine import Engine, gc_paused
from pipescope.simulator.ir import Schedule, ScheduleError, WeightUpdate
from pipescope.simulator.lowering import lower
from pipescope.simulator.network import FifoLinks, Network
from pipescope.simulator.program import Program, compile_program, op_durations
from pipescope.simulator.result import SimResult, build_result
from pipescope.simulator.timeline import replay_timeline


def simulate(schedule: Schedule, costs: CostModel, network: Network | None = None, *, samples_per_microbatch: int = 1,
             data_parallel: int = 1, **extra: Any) -> SimResult:
    """Check, lower, compile and replay ``schedule``.

    Args:
        schedule: what each device runs, in order (compute-only, or lowered already).
        costs: compute durations and bytes per stage.
        network: moves the data; None means free, instantaneous transfers (the plain timing model with zero p2p).
        samples_per_microbatch: the microbatch size, for throughput.
        data_parallel: pipeline replicas, for throughput.
        **extra: further ``SimResult`` fields: ``memory_capacity_bytes`` (to report OOM),
            ``model_flops_per_iteration`` and ``peak_flops_per_device`` (MFU), ``config`` (what it came from).

    Raises:
        ScheduleError: malformed or deadlocking schedule, naming the actions. Structure is checked first;
            deadlocks are found by the lowering or the engine itself, naming each stuck action.
    """
    wall = time.perf_counter()
    with gc_paused():
        problems = structure_problems(schedule)
        if problems:
            raise ScheduleError(problems)
        program, stage_costs = prepare(schedule, costs)
        times = Engine(program, network or FifoLinks.fixed_delay(0)).run()
        samples = schedule.num_microbatches * samples_per_microbatch * data_parallel
        result = build_result(schedule, replay_timeline(program, times, schedule.num_devices), stage_costs,
                              costs.precision, samples, warnings=costs.notes() + _run_notes(schedule), **extra)
    result.sim_wall_s = time.perf_counter() - wall
    return result


def prepare(schedule: Schedule, costs: CostModel) -> tuple[Program, list[StageCost]]:
    """The lowered, compiled program of ``schedule`` under ``costs``, and the per-stage costs it used."""
    stage_costs = [costs.stage_cost(s, schedule.num_stages, schedule.chunks) for s in range(schedule.num_stages)]
    check_stage_costs(stage_costs)
    program = compile_program(lower(schedule), op_durations(stage_costs, schedule.recompute),
                              [c.boundary_bytes for c in stage_costs])
    return program, stage_costs


def _run_notes(schedule: Schedule) -> list[str]:
    if schedule.weight_update is not WeightUpdate.FLUSH and schedule.iterations == 1:
        return [f"{schedule.name} has no flush but ran one iteration: there is no steady state, so the iteration "
                f"time is the whole run with fill and drain; use iterations >= 2"]
    return []
