"""One call from a schedule and a cost model to a SimResult."""

from __future__ import annotations

import time

from pipescope.simulator.check import ScheduleError, structure_problems
from pipescope.simulator.costs import CostModel, Link
from pipescope.simulator.engine import Engine, LinkLookup, compile_schedule, gc_paused
from pipescope.simulator.ir import Schedule
from pipescope.simulator.result import SimResult, build_result

# Used when no cluster is given: one NVLink-class hop between any two devices.
DEFAULT_LINK = Link(bandwidth=450e9, latency_ns=2_000)


def simulate(schedule: Schedule, costs: CostModel, link: LinkLookup | None = None, samples_per_microbatch: int = 1,
             data_parallel: int = 1, memory_capacity_bytes: int | None = None) -> SimResult:
    """Check, compile and replay ``schedule`` under ``costs``.

    Args:
        schedule: what each device runs, in order.
        costs: durations and bytes per stage.
        link: the path between two devices (bandwidth, latency); a single fast link if None.
        samples_per_microbatch: the microbatch size, for throughput.
        data_parallel: pipeline replicas, for throughput.
        memory_capacity_bytes: device memory, to report OOM.

    Raises:
        ScheduleError: malformed or deadlocking schedule, naming the actions. Structure is checked first;
            deadlocks are found by the engine itself (no separate lockstep pass), naming each stuck op.
    """
    wall = time.perf_counter()
    problems = structure_problems(schedule)
    if problems:
        raise ScheduleError(problems)
    with gc_paused():
        compiled = compile_schedule(schedule, costs, link or (lambda src, dst: DEFAULT_LINK))
        times = Engine(compiled).run()
        samples = schedule.num_microbatches * samples_per_microbatch * data_parallel
        result = build_result(schedule, compiled, times, costs.precision, samples)
    result.sim_wall_s = time.perf_counter() - wall
    result.memory_capacity_bytes = memory_capacity_bytes
    result.warnings.extend(getattr(costs, "warnings", []))
    if schedule.weight_update != "flush" and schedule.iterations == 1:
        result.warnings.append(f"{schedule.name} has no flush but ran one iteration: there is no steady state, so the "
                               f"iteration time is the whole run with fill and drain; use iterations >= 2")
    return result
