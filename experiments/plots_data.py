"""What the Gantt and memory figures draw, in one shape whatever it came from: a ``SimResult`` (the library and
``simulate --gantt``), a Chrome trace (``simulate --trace``) or a timeline file (``simulate --timeline``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from pipescope.simulator.ir import Action, ActionKind, producers
from pipescope.simulator.result import SimResult
from pipescope.simulator.readers.units import format_time

LANES = ("compute", "send", "recv", "collective")
# A stream's lane: the timeline's ``send->3`` and ``recv<-1`` and the trace's ``collective 2`` drop their peer or
# number.
STREAM = re.compile(r"^(compute|send->[0-9]{1,6}|recv<-[0-9]{1,6}|collective(?: [0-9]{1,6})?)$")
OPT = ActionKind.OPT

# What each sweep figure plots: the line, x and y columns of a sweep's table (``pipescope sweep``'s results)
SWEEP_COLUMNS = {"bubble": ("schedule.name", "schedule.microbatches", "bubble_rate"),
                 "throughput": ("schedule.name", "schedule.stages", "throughput_samples_per_s"),
                 "vocab": ("schedule.name", "model.vocab", "mfu")}



@dataclass(frozen=True)
class RunData:
    """One run's actions, memory and links, ready to draw.

    Attributes:
        ops: one row per action: device, lane (``LANES``), kind, stage, microbatch, start_ns, end_ns.
        pipeline_devices: devices of one pipeline replica; replica r's device d is r x pipeline_devices + d.
        chunks: stages per device (odd chunks are drawn darker).
        microbatches: microbatches per iteration, which tells iterations apart; 0 when unknown.
        memory: per device of replica 0, (times ns, bytes in use); empty when the source has none.
        capacity_bytes: each device's memory, when known.
        links: the busiest links' busy spans (ns), busiest first.
        title: what the run was, for a figure's default title.
        timed_measures: the part of ``title`` read off the run's times (iteration, bubble), which a figure in unit
            steps leaves out.
        stalls: (device, from ns, to ns) of each wait inside an op that runs unit by unit (ZeRO-3's gathers).
    """

    ops: pd.DataFrame
    pipeline_devices: int
    chunks: int
    microbatches: int = 0
    memory: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    capacity_bytes: int | None = None
    links: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    title: str = ""
    timed_measures: str = ""
    stalls: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))  # (device, from, to)

    @property
    def counted_bytes(self) -> bool:
        """Whether the run counted any memory: uniform costs count none, and a line flat at zero says nothing."""
        return any(len(used) and used.max() > 0 for _, used in self.memory)

    @property
    def devices(self) -> int:
        """Every device, replicas included."""
        return int(self.ops["device"].max()) + 1 if len(self.ops) else 0

    @property
    def replicas(self) -> int:
        return max(1, self.devices // max(1, self.pipeline_devices))


def lanes(streams: pd.Series) -> pd.Series:
    """Each stream's lane; ValueError naming the first stream that is none of the timeline's."""
    bad = ~streams.astype(str).str.fullmatch(STREAM.pattern)
    if bad.any():
        raise ValueError(f"stream: got {str(streams[bad].iloc[0])[:60]!r}, expected compute, send->D, recv<-S or "
                         f"collective")
    return streams.astype(str).str.extract(r"^(compute|send|recv|collective)", expand=False)


def run_data(result: SimResult | RunData) -> RunData:
    """A ``SimResult``'s actions, memory and links (a ``RunData`` is returned as it is)."""
    if isinstance(result, RunData):
        return result
    if not isinstance(result, SimResult):
        raise ValueError(f"result: got {type(result).__name__}, expected a SimResult (pipescope.run) or a RunData "
                         f"(a trace or timeline read by plots_inputs)")
    frame = result.timeline
    ops = frame[["device", "kind", "stage", "microbatch", "start_ns", "end_ns"]].assign(lane=lanes(frame["stream"]))
    s = result.schedule
    replicas = f" x{result.data_parallel} replicas" if result.data_parallel > 1 else ""
    parallel = getattr(result.config, "parallel", None)  # the text headline's t=, cp= and ZeRO, which it lacked
    if parallel is not None:
        shown = [f"t={parallel.tensor}" if parallel.tensor > 1 else "", f"cp={parallel.context}"
                 if parallel.context > 1 else ""]
        replicas = "".join(f" {part}" for part in shown if part) + replicas
        replicas += f" ZeRO-{parallel.zero_stage}" if parallel.zero_stage and result.data_parallel > 1 else ""
    measures = f"  iteration {format_time(result.iteration_time_s)}, bubble {result.bubble_rate:.1%}"
    return RunData(ops, s.num_devices, s.chunks, s.num_microbatches if s.iterations > 1 else 0,
                   [(m.times, m.bytes_in_use) for m in result.memory], result.memory_capacity_bytes,
                   dict(result.link_spans), f"{s.name}: p={s.num_devices}{replicas} m={s.num_microbatches} "
                   f"v={s.chunks}{measures}", measures, result.records.stalls)


def from_ops(ops: pd.DataFrame, memory: list[tuple[np.ndarray, np.ndarray]], title: str,
             microbatches: int | None = None, links: dict | None = None) -> RunData:
    """A run from its action rows alone (a file): the replicas, chunks and iteration size are read off the rows.

    Replica r runs the stages of replica 0 on devices r x D + d, so D is the device count over the number of devices
    that run stage 0. An OPT row ``3OPT7`` closes the iteration whose last microbatch is 7, which gives the iteration
    size (not PipeDream's, which step after every microbatch); ``microbatches`` stands in where no row tells
    (ValueError naming the flag when the rows contradict it).
    """
    stage0 = ops.loc[(ops["lane"] == "compute") & (ops["stage"] == 0), "device"].nunique()
    devices = int(ops["device"].max()) + 1 if len(ops) else 1
    pipeline = max(1, devices // max(1, stage0))
    chunks = max(1, (int(ops["stage"].max()) + 1) // pipeline) if len(ops) else 1
    steps = ops.loc[ops["kind"] == OPT, "microbatch"]
    if len(steps) and not (steps.min() == 0 and steps.nunique() > 1):  # PipeDream steps after every microbatch
        found = int(steps.min()) + 1
        if microbatches is not None and microbatches != found:
            raise ValueError(f"--microbatches: got {microbatches}, but the file's OPT rows close an iteration every "
                             f"{found} microbatches; expected {found}, or no --microbatches")
        microbatches = found
    return RunData(ops, pipeline, chunks, microbatches or 0, memory, None, links or {}, title)


def iteration_ends(ops: pd.DataFrame, microbatches: int, end: str = "end_ns") -> list[float]:
    """Where each iteration but the last ends: its last compute op (OPT steps excluded: a step can run late, before
    the forward that needs it), in the units of column ``end``; empty for one iteration or an unknown size."""
    if microbatches <= 0:
        return []
    compute = ops[(ops["lane"] == "compute") & (ops["kind"] != OPT)]
    ends = compute.groupby(compute["microbatch"] // microbatches)[end].max().sort_index()
    return ends.iloc[:-1].tolist()


def unit_steps(compute: pd.DataFrame, pipeline_devices: int) -> np.ndarray:
    """Each compute op's cell when every op lasts one step and transfers are free: one step after the op before it
    on its device and after its inputs (the one dependency rule, ``ir.producers``). Rows are taken in start order,
    which puts every producer before its consumers in a run that happened."""
    order = np.lexsort((compute["device"].to_numpy(), compute["start_ns"].to_numpy()))
    device, stage, micro = (compute[c].to_numpy()[order] for c in ("device", "stage", "microbatch"))
    kinds = [_known(k) for k in compute["kind"].to_numpy()[order]]
    stages = int(stage.max()) + 1 if len(stage) else 0
    replica = device // max(1, pipeline_devices)
    present = {Action(int(s), k, int(m)) for s, k, m, r in zip(stage, kinds, micro, replica) if k and r == 0}
    free: dict[int, int] = {}
    done: dict[tuple[int, Action], int] = {}
    steps = np.zeros(len(order), dtype=np.int64)
    for i, (d, s, k, m, r) in enumerate(zip(device.tolist(), stage.tolist(), kinds, micro.tolist(), replica.tolist())):
        step = free.get(d, 0)
        if k is not None:
            action = Action(s, k, m)
            step = max([step] + [done.get((r, dep), 0) for dep in producers(action, stages, present)])
            done[(r, action)] = step + 1
        steps[i], free[d] = step, step + 1
    out = np.empty_like(steps)
    out[order] = steps
    return out


def _known(kind: str) -> ActionKind | None:
    """The kind as an ``ActionKind``; None for one this version does not know (drawn, without dependencies)."""
    try:
        return ActionKind(kind)
    except ValueError:
        return None


def sweep_table(frame: object, needed: tuple[str, ...], what: str) -> pd.DataFrame:
    """``frame`` if it is a table with the ``needed`` columns; ValueError naming the first missing one (a timeline or
    a summary handed to a sweep figure from Python)."""
    if not isinstance(frame, pd.DataFrame):
        raise ValueError(f"INPUT: got {type(frame).__name__}, expected a pandas DataFrame: {what}")
    missing = [c for c in needed if c not in frame]
    if missing:
        raise ValueError(f"INPUT: no column {missing[0]!r}; expected {what}")
    return frame
