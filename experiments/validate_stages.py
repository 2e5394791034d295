"""``validate``'s stage-by-stage part: every stage's ops timed by the executor on one rank (one GPU with ``--device
cuda``), compared op by op with the profile's, and, with ``--op-times stages``, put in the profile's place for the
simulation (docs/validation.md, "Two sources of op times" and "GPUs").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import pandas as pd

from pipescope.simulator.ir import ActionKind
from pipescope.simulator.program import op_durations

if TYPE_CHECKING:
    from pipescope.executor.spec import RunSpec
    from pipescope.runner import Prepared

STAGE_TIMING_ITERATIONS = 10  # serial runs whose op means become the simulation's op times


def time_stages(built: Prepared, spec: RunSpec, copies: int = 1, cpu_time: bool = False) -> tuple[Prepared, list[dict]]:
    """(``built`` with its profile's op times replaced by the measured ones, the per-op table ``stage_op_table``);
    ``copies`` and ``cpu_time`` as ``stage_timing.stage_op_times`` takes them."""
    from pipescope.executor.stage_timing import stage_op_times
    measured = stage_op_times(spec, copies, cpu_time)
    table = stage_op_table(op_durations(built.stage_costs(), built.schedule.recompute), measured)
    costs = dataclasses.replace(built.costs, op_times=tuple(measured), _cache={})
    return dataclasses.replace(built, costs=costs), table


def stage_op_table(predicted: dict[tuple[int, ActionKind], int], measured: list[dict[str, int]]) -> list[dict]:
    """Per stage and op kind the executor ran: the profile's time (``program.op_durations``, what the simulation
    would have used), the measured mean, and the signed error (profile - measured) / measured."""
    rows = []
    for stage, ops in enumerate(measured):
        for kind, ns in sorted(ops.items()):
            profile = predicted[stage, ActionKind(kind)]
            rows.append({"stage": stage, "op": kind, "profile_ns": profile, "measured_ns": ns,
                         "error": relative_error(profile, ns)})
    return rows


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured, signed; inf for a measured 0 (validate's one definition)."""
    return (predicted - measured) / measured if measured else float("inf")


def op_error_summary(table: list[dict]) -> dict[str, float]:
    """Median signed error and the p90 of its size over the table's rows (the p90 as the pipeline report's)."""
    errors = pd.Series([row["error"] for row in table], dtype=float)
    return {"op_time_error_median": float(errors.median()), "op_time_error_p90": float(errors.abs().quantile(0.9))}


def op_table_lines(table: list[dict]) -> list[str]:
    """The per-op table as text lines."""
    lines = ["stage  op    profile    measured    error"]
    lines += [f"{row['stage']:>5}  {row['op']:<4} {row['profile_ns'] / 1e6:>7.3f} ms "
              f"{row['measured_ns'] / 1e6:>8.3f} ms {row['error']:>+7.1%}" for row in table]
    return lines
