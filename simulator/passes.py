"""Lowering: the ordered passes from a schedule to the program the engine runs (docs/architecture.md, "Lowering").

As torch.distributed.pipelining's runtime lowers a schedule (``_add_unshard_reshard``, ``_add_reduce_grad``,
``_add_send_recv``), each pass adds one kind of action, and a pass that does not apply to a run leaves it as it is.
The first three rewrite the per-device lists; compiling turns them into the engine's arrays; the passes after it work
on those arrays, and the data-parallel one tiles the one replica compiled. ``PASSES`` is the order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipescope.simulator.costs import StageCost
from pipescope.simulator.faults import ComputeFaults
from pipescope.simulator.ir import Schedule
from pipescope.simulator.lowering import add_fsdp_actions, add_optimizer_steps, lower, stage_actions
from pipescope.simulator import replicas
from pipescope.simulator.program import Program, compile_program, op_durations
from pipescope.simulator.replicas import GradSync
from pipescope.simulator.vocab_placement import is_overlapped, overlap_collectives


@dataclass
class Lowering:
    """What the passes read and write: the run's schedule (with torch's FSDP actions once added: what ran), its
    per-device lists as lowered so far, then the compiled program."""

    schedule: Schedule
    stage_costs: list[StageCost]
    deferred_steps: bool = False  # lowering.add_optimizer_steps's ``deferred``
    width: int = 1  # data-parallel replicas simulated
    grad_bytes: list[int] = field(default_factory=list)  # per stage, what its replicas reduce
    weight_bytes: list[int] = field(default_factory=list)  # per stage, what ZeRO gathers
    sync: GradSync = field(default_factory=GradSync)
    faults: ComputeFaults | None = None
    lists: Schedule | None = None  # the lowered lists (the schedule's until the send/recv pass)
    program: Program | None = None
    base: Program | None = None  # one replica's program, before the data-parallel pass replicates it


def fsdp_actions(run: Lowering) -> None:
    """torch's UNSHARD, RESHARD and REDUCE_GRAD, where ZeRO-3 without resharding runs them and a compute-only
    schedule lacks them (docs/parallelism.md, "torch's FSDP actions")."""
    s, sharding = run.schedule, run.sync.sharding
    if (run.width > 1 and sharding.zero >= 3 and not sharding.reshard_after_forward and not s.is_lowered
            and not stage_actions(s)):
        run.schedule = add_fsdp_actions(s)


def send_recv(run: Lowering) -> None:
    """SEND/RECV pairs, placed as torch's ``_add_send_recv`` places them (a lowered schedule stays as it is)."""
    run.lists = lower(run.schedule)


def optimizer_steps(run: Lowering) -> None:
    """Each stage's optimizer step and clipping's norm all-reduce, where the stage costs have a step."""
    if any(c.optimizer_ns for c in run.stage_costs):  # none under the closed forms' costs: their programs stay
        run.lists = add_optimizer_steps(run.lists, run.deferred_steps, run.grad_bytes)


def compile_lists(run: Lowering) -> None:
    """The flat arrays the engine replays, with each op's duration and each transfer's bytes."""
    run.program = compile_program(run.lists, op_durations(run.stage_costs, run.schedule.recompute),
                                  [c.boundary_bytes for c in run.stage_costs])


def vocab_overlap(run: Lowering) -> None:
    """vocab-1/vocab-2: their collectives taken off the compute streams (``vocab_placement``)."""
    if is_overlapped(run.schedule):
        overlap_collectives(run.program, run.schedule.num_stages, run.schedule.stage_to_device[-1])


def data_parallel(run: Lowering) -> None:
    """The replicas over the mesh's data axis, with their gradient syncs and ZeRO's gathers (``replicas``)."""
    run.base = run.program
    if run.width > 1:
        run.program = replicas.data_parallel(run.program, run.schedule, run.width, run.grad_bytes, run.sync,
                                             run.weight_bytes, units=[c.units for c in run.stage_costs])


def compute_faults(run: Lowering) -> None:
    """Stragglers and jitter scale the compiled ops' durations (``faults``)."""
    if run.faults is not None:
        run.faults.apply(run.program)


Pass = Callable[[Lowering], None]
PASSES: tuple[Pass, ...] = (fsdp_actions, send_recv, optimizer_steps, compile_lists, vocab_overlap, data_parallel,
                            compute_faults)
ONE_REPLICA: tuple[Pass, ...] = (send_recv, optimizer_steps, compile_lists, vocab_overlap)  # one pipeline's program


def run_passes(run: Lowering, passes: tuple[Pass, ...] = PASSES) -> Lowering:
    """``run`` after each of ``passes``, in order."""
    for each in passes:
        each(run)
    return run
