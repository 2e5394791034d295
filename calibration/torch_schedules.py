"""Replay torch.distributed.pipelining schedules as pipescope Schedules (docs/schedules.md section 8).

torch's schedule classes compute their ``pipeline_order`` (per rank, compute actions and idle ``None`` steps) in
their constructors from a few attributes of the stage objects they are given, so lightweight stand-in stages are
enough: no process group, no module, no tensors. The multi-stage classes also lower the order to send/recv,
UNSHARD/RESHARD and REDUCE_GRAD in their constructors and validate it there; that step is skipped here, so a
malformed order reaches ``simulator.check.check`` (which names what is wrong) instead of failing inside torch.
The order is taken as torch builds it, never repaired: torch 2.13's ``Schedule1F1B`` gives the last rank forwards
``1..m`` instead of ``0..m-1``, and the checker reports it.

torch is imported lazily, so this module imports (and the IR helpers work) without torch installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipescope.simulator.ir import Action, ActionKind, Schedule

# torch's names (``get_schedule_class`` keys) with the stages per rank each supports: None means any.
SCHEDULE_CHUNKS: dict[str, int | None] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": None,
    "LoopedBFS": None,
    "InterleavedZeroBubble": None,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULE_CHUNKS)
DEFAULT_LOOPED_CHUNKS = 2  # stages per rank of the looped and V schedules when none is given
# Those whose pipeline_order is well formed in torch 2.13, with stages per rank (1F1B's gives the last rank
# forwards 1..m); the tests hold the replay, the lowering and the dry-run counts to these.
WELL_FORMED: tuple[tuple[str, int], ...] = (("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2),
                                            ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))

# torch's computation-type values that are compute in our IR; everything else (comms, FSDP, REDUCE_GRAD) is skipped.
_COMPUTE_TYPES = {k: ActionKind(k) for k in "FBIW"}
_OVERLAP = "OVERLAP_F_B"

TorchOrder = dict[int, list[Any]]
"""torch's schedule IR: rank -> list of ``torch...schedules._Action`` or ``None`` (an idle step)."""


@dataclass
class StandInStage:
    """The attributes of a ``_PipelineStageBase`` that torch's schedule constructors read.

    Attributes:
        stage_index: global stage index (torch's numbering, the same as ours).
        num_stages: stages in the whole pipeline.
        group_size: pipeline ranks ``p``.
        group_rank: this stage's rank (the order is built for every rank regardless).
        submod: no module; torch's torch.compile check skips stages whose ``submod`` is not an ``nn.Module``.
        stage_index_to_group_rank: written by the schedule constructor.
    """

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: None = None
    stage_index_to_group_rank: dict[int, int] | None = None


def canonical_name(name: str) -> str:
    """torch's schedule name for ``name``, case-insensitive, with or without the ``Schedule`` prefix.

    Raises:
        ValueError: unknown name; the message lists the available ones.
    """
    bare = name.strip()
    if bare.lower().startswith("torch:"):
        bare = bare[len("torch:"):]
    if bare.lower().startswith("schedule"):
        bare = bare[len("schedule"):]
    for known in SCHEDULE_NAMES:
        if known.lower() == bare.lower():
            return known
    raise ValueError(f"schedule.name: got {name!r}, expected a torch schedule, one of {', '.join(SCHEDULE_NAMES)}")


def default_chunks(name: str) -> int:
    """Stages per rank of torch schedule ``name`` when none is given: the one it supports, else 2."""
    needed = SCHEDULE_CHUNKS[canonical_name(name)]
    return needed if needed is not None else DEFAULT_LOOPED_CHUNKS


def _check_shape(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if stages < 1:
        raise ValueError(f"schedule.stages: got {stages}, expected at least 1")
    if microbatches < 1:
        raise ValueError(f"schedule.microbatches: got {microbatches}, expected at least 1")
    needed = SCHEDULE_CHUNKS[name]
    if needed is not None and chunks != needed:
        raise ValueError(f"schedule.chunks: got {chunks}, expected {needed} for torch:{name}")
    if chunks < 1:
        raise ValueError(f"schedule.chunks: got {chunks}, expected at least 1")
    if name == "DualPipeV" and microbatches < stages * chunks:  # torch's own bound, checked before torch words it
        raise ValueError(f"schedule.microbatches: got {microbatches}, expected at least schedule.stages x 2 = "
                         f"{stages * chunks} for torch:DualPipeV (torch's bound: one for each stage of its V)")


def _without_lowering(cls: type) -> type:
    """A subclass of a multi-stage torch schedule whose constructor stops after building ``pipeline_order``."""

    def keep_compute_order(self: Any, actions: TorchOrder, format: str = "compute_only") -> None:
        """Skip torch's validation and comm lowering: the caller checks and lowers (or not) itself."""

    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": keep_compute_order})


def build_torch_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, lowered: bool = False) -> Any:
    """Construct torch's schedule object on stand-in stages (no process group).

    Args:
        name: torch schedule name (see ``canonical_name``).
        stages: pipeline ranks ``p``.
        microbatches: microbatches per step ``m``.
        chunks: stages per rank (1 for GPipe and 1F1B, 2 for ZBVZeroBubble and DualPipeV).
        lowered: run the multi-stage classes' own validation and comm lowering too (as a real run does), so that
            ``pipeline_order_with_comms`` and ``_dump_csv(format="compute_comms")`` exist; torch raises on orders
            it finds malformed.

    Returns:
        The torch schedule; its ``pipeline_order`` is the order as torch builds it.
    """
    known = canonical_name(name)
    _check_shape(known, stages, microbatches, chunks)
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = torch_schedules.get_schedule_class(known)
    num_stages = stages * chunks
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(StandInStage(0, num_stages, stages, 0), microbatches)
    local = [StandInStage(i * stages, num_stages, stages, 0) for i in range(chunks)]
    return (cls if lowered else _without_lowering(cls))(local, microbatches)


def torch_pipeline_order(name: str, stages: int, microbatches: int, chunks: int = 1) -> TorchOrder:
    """torch's compute-only ``pipeline_order`` for the named schedule, exactly as torch builds it."""
    return build_torch_schedule(name, stages, microbatches, chunks).pipeline_order


def torch_action_to_actions(action: Any) -> list[Action]:
    """Our compute actions for one torch action: one for F/B/I/W, its sub-actions for OVERLAP_F_B, none for comms.

    Raises:
        ValueError: a compute action without a microbatch index.
    """
    kind = action.computation_type.value
    if kind == _OVERLAP:
        return [sub for part in action.sub_actions or () for sub in torch_action_to_actions(part)]
    if kind not in _COMPUTE_TYPES:
        return []
    if action.microbatch_index is None:
        raise ValueError(f"torch action {action} has microbatch_index(=None), expected an int")
    return [Action(action.stage_index, _COMPUTE_TYPES[kind], action.microbatch_index)]


def _device_actions(actions: Iterable[Any]) -> tuple[Action | None, ...]:
    out: list[Action | None] = []
    for action in actions:
        out.extend([None] if action is None else torch_action_to_actions(action))
    return tuple(out)


def _stage_homes(device_actions: Sequence[Sequence[Action | None]]) -> tuple[int, ...]:
    """Device of each stage, where it first appears (the checker reports a stage seen on a second device)."""
    home: dict[int, int] = {}
    for device, actions in enumerate(device_actions):
        for action in actions:
            if action is not None:
                home.setdefault(action.stage, device)
    missing = [s for s in range(max(home, default=-1) + 1) if s not in home]
    if not home or missing:
        raise ValueError(f"torch order has no action for stage(s) {missing or [0]}, expected every stage somewhere")
    return tuple(home[s] for s in range(len(home)))


def schedule_from_torch_order(order: TorchOrder, microbatches: int, name: str) -> Schedule:
    """Convert torch's ``pipeline_order`` (rank -> actions) into our Schedule, keeping idle steps as ``None``.

    Comm, FSDP and REDUCE_GRAD actions are skipped; OVERLAP_F_B becomes its sub-actions in order.
    """
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"torch order ranks: got {ranks}, expected 0..{len(ranks) - 1}")
    device_actions = tuple(_device_actions(order[rank]) for rank in ranks)
    return Schedule(
        name=name,
        num_devices=len(ranks),
        num_microbatches=microbatches,
        stage_to_device=_stage_homes(device_actions),
        device_actions=device_actions,
    )


def torch_schedule(name: str, stages: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """The named torch.distributed.pipelining schedule as our Schedule, named ``torch:<ScheduleName>``.

    Args:
        name: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
            ``ZBVZeroBubble`` or ``DualPipeV``, case-insensitive, with or without the ``Schedule`` prefix.
        stages: pipeline ranks ``p``.
        microbatches: microbatches per step ``m``.
        chunks: stages per rank ``v`` (ZBVZeroBubble and DualPipeV need exactly 2); None: ``default_chunks``.

    Returns:
        The order exactly as torch builds it; run ``simulator.check.check`` on it before simulating.

    Raises:
        ValueError: unknown name, bad sizes, or a size torch itself rejects.
    """
    known = canonical_name(name)
    order = torch_pipeline_order(known, stages, microbatches, chunks or default_chunks(known))
    return schedule_from_torch_order(order, microbatches, f"torch:{known}")


def expand_overlaps(order: TorchOrder) -> TorchOrder:
    """The order with each OVERLAP_F_B replaced by its sub-actions in order (as our replay runs them)."""
    return {rank: [sub for a in actions for sub in ((a,) if a is None or a.sub_actions is None else a.sub_actions)]
            for rank, actions in order.items()}


def torch_dry_run(order: TorchOrder, stage_to_rank: Callable[[int], int], num_stages: int) -> TorchOrder:
    """torch's own unit-time dry run of an order's compute actions, after torch's send/recv lowering.

    This is what torch's tests do: drop idle steps and non-compute actions (GPipe and 1F1B orders carry
    REDUCE_GRAD), ``_add_send_recv``, then ``_simulate_comms_compute``. The runtime's full lowering also adds
    UNSHARD/RESHARD/REDUCE_GRAD, which the dry run rejects, and the dry run rejects OVERLAP_F_B (DualPipeV):
    pass ``expand_overlaps(order)`` to dry-run its sub-actions instead.

    Returns:
        The simulated timeline: rank -> one entry per step (an action, or ``None`` when the rank waited).

    Raises:
        AssertionError: torch's lowering found the order malformed ("can't schedule sends/recvs").
        ValueError: torch's dry run stalled or met an action type it does not support.
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    compute = {rank: [a for a in actions if a is not None and a.is_compute_op] for rank, actions in order.items()}
    with_comms = torch_schedules._add_send_recv(compute, stage_to_rank=stage_to_rank, num_stages=num_stages)
    return torch_schedules._simulate_comms_compute(with_comms, stage_to_rank=stage_to_rank, num_stages=num_stages)


def dry_run_compute_steps(timeline: TorchOrder) -> dict[Action, int]:
    """The step at which each compute op ran in a ``torch_dry_run`` timeline (OVERLAP_F_B: both sub-ops)."""
    steps: dict[Action, int] = {}
    for actions in timeline.values():
        for step, action in enumerate(actions):
            for ours in [] if action is None else torch_action_to_actions(action):
                steps[ours] = step
    return steps


def to_torch_order(schedule: Schedule) -> TorchOrder:
    """Our per-device actions as torch ``_Action`` objects, idle steps dropped (as torch's dry run does)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    return {d: [torch_schedules._Action(a.stage, torch_schedules._ComputationType(str(a.kind)), a.microbatch)
                for a in acts if a is not None] for d, acts in enumerate(schedule.device_actions)}


def dry_run_steps(schedule: Schedule) -> tuple[int | None, str]:
    """torch's own unit-time dry run of ``schedule`` (lowered by torch's ``_add_send_recv`` unless it holds sends
    and receives already): (step count, "") when it finishes, (None, the reason) when torch stalls or refuses."""
    import contextlib
    import io

    from torch.distributed.pipelining import schedules as torch_schedules

    home = schedule.stage_to_device
    order = to_torch_order(schedule)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # torch prints its partial timeline before raising
            if schedule.is_lowered:
                timeline = torch_schedules._simulate_comms_compute(order, lambda s: home[s], schedule.num_stages)
            else:
                timeline = torch_dry_run(order, lambda s: home[s], schedule.num_stages)
    except (AssertionError, ValueError) as err:
        return None, str(err).splitlines()[0] if str(err) else type(err).__name__
    return max((len(actions) for actions in timeline.values()), default=0), ""
