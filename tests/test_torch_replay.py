"""Replay of torch.distributed.pipelining schedules (calibration/torch_schedules.py, docs/schedules.md section 8).

Exact match with torch's dry-run step counts (comms lowered): tests/test_lowering.py.
"""

from __future__ import annotations

import csv
import io
import os
from types import ModuleType

import pytest

from pipescope.calibration.torch_schedules import (
    WELL_FORMED,
    SCHEDULE_NAMES,
    build_torch_schedule,
    canonical_name,
    dry_run_compute_steps,
    dry_run_steps,
    expand_overlaps,
    torch_action_to_actions,
    torch_dry_run,
    torch_pipeline_order,
    torch_schedule,
)
from pipescope.simulator.check import check
from pipescope.simulator.readers.csvio import from_csv_text, read_csv, to_csv_text
from pipescope.simulator.ir import Action, ActionKind, Schedule, ScheduleError, producers
from pipescope.simulator.lowering import add_send_recv
from goldens import golden_name, golden_path

MULTI_STAGE_CSV = [("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)]
SIZES = [(1, 4), (2, 4), (3, 6), (4, 8)]
GOLDENS = [("GPipe", 1), ("1F1B", 1), ("ZBVZeroBubble", 2)]



def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def _torch_compute_lists(order: dict) -> list[list[Action]]:
    return [[ours for a in order[rank] if a is not None for ours in torch_action_to_actions(a)]
            for rank in sorted(order)]


def _asap_steps(schedule: Schedule) -> dict[Action, int]:
    """Earliest unit-time step of each op given per-device order and producers (longest path in that DAG)."""
    lists = [schedule.compute_actions(d) for d in range(schedule.num_devices)]
    present = frozenset(a for acts in lists for a in acts)
    before = {a: acts[i - 1] for acts in lists for i, a in enumerate(acts) if i}
    steps: dict[Action, int] = {}

    def start(action: Action) -> int:
        if action not in steps:
            deps = producers(action, schedule.num_stages, present) + ([before[action]] if action in before else [])
            steps[action] = max((start(d) + 1 for d in deps), default=0)
        return steps[action]

    for action in present:
        start(action)
    return steps


def test_names_with_or_without_prefix() -> None:
    """Names are case-insensitive and take an optional ``Schedule`` (or ``torch:``) prefix."""
    assert canonical_name("ScheduleZBVZeroBubble") == "ZBVZeroBubble"
    assert canonical_name("1f1b") == "1F1B"
    assert canonical_name("torch:ScheduleGPipe") == "GPipe"
    assert golden_name("Schedule1F1B", 4, 8) == "torch_1F1B_p4_m8.csv"


def test_unknown_name_lists_available() -> None:
    """An unknown name is a ValueError that lists every available schedule."""
    with pytest.raises(ValueError, match="Nope") as err:
        canonical_name("Nope")
    assert all(name in str(err.value) for name in SCHEDULE_NAMES)


def test_v_schedules_need_two_chunks_and_take_them_by_default() -> None:
    """ZBVZeroBubble and DualPipeV take exactly 2 stages per rank (their default); GPipe exactly 1."""
    with pytest.raises(ValueError, match=r"chunks: got 1, expected 2"):
        torch_schedule("ZBVZeroBubble", 4, 8, chunks=1)
    assert torch_schedule("ZBVZeroBubble", 4, 8).chunks == 2
    with pytest.raises(ValueError, match=r"chunks: got 2, expected 1"):
        torch_schedule("GPipe", 4, 8, chunks=2)
    # torch's own words named neither the key nor the stages given (4 ranks, "8 stages")
    with pytest.raises(ValueError, match=r"^schedule.microbatches: got 4, expected at least schedule.stages x 2 = 8"):
        torch_schedule("DualPipeV", 4, 4)


@pytest.mark.parametrize(("name", "chunks"), [*WELL_FORMED, ("1F1B", 1)])
def test_replay_keeps_torch_order(torch_sched: ModuleType, name: str, chunks: int) -> None:
    """Per rank, our compute ops are torch's in torch's order, stages where torch places them."""
    schedule = torch_schedule(f"Schedule{name}", 4, 8, chunks)
    torch_obj = build_torch_schedule(name, 4, 8, chunks)
    assert schedule.name == f"torch:{name}"
    assert [schedule.compute_actions(d) for d in range(4)] == _torch_compute_lists(torch_obj.pipeline_order)
    if chunks > 1:
        mapping = torch_obj.stage_index_to_group_rank
        assert schedule.stage_to_device == tuple(mapping[s] for s in range(len(mapping)))


@pytest.mark.parametrize(("name", "chunks"), WELL_FORMED)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_well_formed_torch_schedules_pass_the_checker(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                                      microbatches: int) -> None:
    """Every well-formed torch schedule passes check(), which returns the lockstep step count: the longest path of
    device order + producers."""
    schedule = torch_schedule(name, stages, microbatches, chunks)
    assert check(schedule) == max(_asap_steps(schedule).values()) + 1


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 4), (4, 8)])
def test_torch_1f1b_order_is_malformed(torch_sched: ModuleType, stages: int, microbatches: int) -> None:
    """torch 2.13's Schedule1F1B order gives the last rank F1..Fm, not F0..Fm-1; the checker rejects it.

    The order is replayed as torch builds it, never repaired. check() names the out-of-range forward
    ``{last}F{m}`` and the missing ``{last}F0`` (that ``{last}B0`` needs); our send/recv lowering, like torch's,
    rejects the same order for p > 1, naming the stuck ``{last}F{m}``; with p == 1 torch's dry run accepts it.
    """
    last = stages - 1
    schedule = torch_schedule("1F1B", stages, microbatches)
    forwards = [a.microbatch for a in schedule.compute_actions(last) if a.kind == "F"]
    assert forwards == list(range(1, microbatches + 1))
    outside = f"{last}F{microbatches} has microbatch outside 0..{microbatches - 1}"
    with pytest.raises(ScheduleError, match=outside) as err:
        check(schedule)
    assert f"stage {last} microbatch 0: missing F ({last}F0)" in err.value.problems
    order = torch_pipeline_order("1F1B", stages, microbatches)
    if stages > 1:
        with pytest.raises(ScheduleError, match=rf"deadlock: cannot place sends/recvs: device {last} position \d+: "
                                                rf"{last}F{microbatches} waits for"):
            add_send_recv(schedule)
        with pytest.raises(AssertionError, match="Malformed compute schedule"):
            torch_dry_run(order, lambda s: s, stages)
        assert dry_run_steps(schedule) == (None, "Malformed compute schedule, can't schedule sends/recvs")
    else:
        torch_dry_run(order, lambda s: s, stages)
        assert dry_run_steps(schedule)[0] is not None


@pytest.mark.parametrize(("name", "chunks"), WELL_FORMED)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_check_steps_bound_torch_dry_run(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                        microbatches: int) -> None:
    """The torch schedules replay and match torch's own unit-time dry run where torch's IR is well formed.

    torch's dry run (``_add_send_recv`` then ``_simulate_comms_compute``, as torch's tests run it) counts steps
    of the comms-lowered program: every SEND and RECV takes a step on its rank, a RECV sits where torch's
    lowering put it and blocks the rank until the matching SEND, so a cross-rank result reaches its consumer
    two steps later at the earliest. Our lockstep replays compute only, comms free, a result visible the next
    step on any device. So the counts agree exactly only with one rank (no comms); in general the relation is:

    1. after torch's dry run, each rank's compute ops are our device's ops in the same order;
    2. torch's timeline is a valid unit-time execution under our dependencies (every producer of an op ran at
       an earlier step, a cross-rank one at least 2 steps earlier: SEND, then RECV, then the consumer), so each
       op's torch step >= its earliest possible step, which is what lockstep gives:
       lockstep steps == longest path of (device order + producers) <= torch's last compute step + 1 <= torch's
       step count, op by op.

    DualPipeV's OVERLAP_F_B is rejected by torch's dry run, so its sub-actions are dry-run in order, as we replay.
    """
    schedule = torch_schedule(name, stages, microbatches, chunks)
    order = expand_overlaps(torch_pipeline_order(name, stages, microbatches, chunks))
    timeline = torch_dry_run(order, lambda s: schedule.stage_to_device[s], schedule.num_stages)
    torch_steps = max(len(actions) for actions in timeline.values())
    assert dry_run_steps(schedule) == (torch_steps, "")
    ours = check(schedule)
    assert [schedule.compute_actions(d) for d in range(stages)] == _torch_compute_lists(timeline)
    ran_at = dry_run_compute_steps(timeline)
    present = frozenset(ran_at)
    home = schedule.stage_to_device
    for action in present:
        for needed in producers(action, schedule.num_stages, present):
            assert ran_at[action] - ran_at[needed] >= (2 if home[needed.stage] != home[action.stage] else 1)
    earliest = _asap_steps(schedule)
    assert max(earliest.values()) + 1 == ours
    assert all(earliest[a] <= ran_at[a] for a in present)
    assert ours <= max(ran_at.values()) + 1 <= torch_steps
    if stages == 1:
        assert ours == torch_steps


def test_dual_pipe_v_overlap_is_expanded(torch_sched: ModuleType) -> None:
    """OVERLAP_F_B becomes its F and B sub-actions in order; torch's dry run itself rejects OVERLAP_F_B."""
    order = torch_pipeline_order("DualPipeV", 2, 4, 2)
    overlap = next(a for a in order[0] if a is not None and a.sub_actions is not None)
    assert torch_action_to_actions(overlap) == [Action(s.stage_index, s.computation_type.value, s.microbatch_index)
                                                for s in overlap.sub_actions]
    with pytest.raises(ValueError, match="Unsupported action type"):
        torch_dry_run(order, lambda s: torch_schedule("DualPipeV", 2, 4, 2).stage_to_device[s], 4)


@pytest.mark.parametrize(("name", "chunks"), MULTI_STAGE_CSV)
def test_csv_round_trip(torch_sched: ModuleType, tmp_path: os.PathLike, name: str, chunks: int) -> None:
    """torch ``_dump_csv`` (compute only) -> our read_csv -> our to_csv_text gives torch's rows back."""
    path = os.path.join(tmp_path, "order.csv")
    build_torch_schedule(name, 4, 8, chunks, lowered=True)._dump_csv(path, format="compute_only")
    with open(path, encoding="utf-8", newline="") as handle:
        torch_text = handle.read()
    schedule = read_csv(path, 8)
    assert _rows(to_csv_text(schedule)) == _rows(torch_text)
    assert schedule.stage_to_device == torch_schedule(name, 4, 8, chunks).stage_to_device
    assert check(schedule) == check(torch_schedule(name, 4, 8, chunks))


@pytest.mark.parametrize(("name", "chunks"), MULTI_STAGE_CSV + [("DualPipeV", 2)])
def test_send_recv_csv_loads_and_skips_comms(torch_sched: ModuleType, name: str, chunks: int) -> None:
    """A CSV of torch's send/recv lowering (SEND_F/RECV_F/SEND_B/RECV_B cells) loads; the replay skips comms."""
    schedule = torch_schedule(name, 4, 8, chunks)
    order = expand_overlaps(torch_pipeline_order(name, 4, 8, chunks))
    compute = {rank: [a for a in actions if a is not None] for rank, actions in order.items()}
    lowered = torch_sched._add_send_recv(compute, lambda s: schedule.stage_to_device[s], schedule.num_stages)
    out = io.StringIO()
    csv.writer(out).writerows(lowered[rank] for rank in sorted(lowered))
    loaded = from_csv_text(out.getvalue(), 8)
    assert any(a.kind == "RECV_F" for acts in loaded.device_actions for a in acts if a is not None)
    assert [loaded.compute_actions(d) for d in range(4)] == [schedule.compute_actions(d) for d in range(4)]
    assert check(loaded) == check(schedule)


def test_runtime_compute_comms_csv_loads(torch_sched: ModuleType, tmp_path: os.PathLike) -> None:
    """torch's runtime ``_dump_csv`` default (compute_comms, with FSDP and REDUCE_GRAD actions) loads."""
    path = os.path.join(tmp_path, "comms.csv")
    build_torch_schedule("ZBVZeroBubble", 4, 8, 2, lowered=True)._dump_csv(path)
    loaded = read_csv(path, 8)
    assert [loaded.compute_actions(d) for d in range(4)] == [
        torch_schedule("ZBVZeroBubble", 4, 8, 2).compute_actions(d) for d in range(4)]


def test_dual_pipe_v_compute_only_csv_loads(torch_sched: ModuleType, tmp_path: os.PathLike) -> None:
    """DualPipeV's compute-only CSV (with OVERLAP_F_B cells) loads as its sub-actions."""
    path = os.path.join(tmp_path, "dualpipev.csv")
    build_torch_schedule("DualPipeV", 4, 8, 2, lowered=True)._dump_csv(path, format="compute_only")
    loaded = read_csv(path, 8)
    assert [loaded.compute_actions(d) for d in range(4)] == [
        torch_schedule("DualPipeV", 4, 8, 2).compute_actions(d) for d in range(4)]


@pytest.mark.parametrize(("name", "chunks"), GOLDENS)
def test_goldens_match_installed_torch(torch_sched: ModuleType, name: str, chunks: int) -> None:
    """The golden CSVs are what the installed torch builds (regenerate with ``tests/goldens.py``)."""
    path = golden_path(name, 4, 8)
    with open(path, encoding="utf-8") as handle:
        assert handle.read() == to_csv_text(torch_schedule(name, 4, 8, chunks))
    if name != "1F1B":  # malformed: check() rejects it (test_goldens_check_without_torch)
        assert check(torch_schedule(name, 4, 8, chunks)) == check(read_csv(path, 8))


def test_replayed_actions_carry_action_kinds(torch_sched: ModuleType) -> None:
    """The replay's actions have ``ActionKind`` kinds, as parsed ones do (the IR compares kinds by identity)."""
    schedule = torch_schedule("ZBVZeroBubble", 2, 4, 2)
    assert all(type(a.kind) is ActionKind for d in range(2) for a in schedule.compute_actions(d))


def test_goldens_check_without_torch() -> None:
    """From the goldens alone: torch's 1F1B is rejected naming the bad forward, GPipe and ZBV pass."""
    def golden(name: str) -> Schedule:
        return read_csv(golden_path(name, 4, 8), 8)

    with pytest.raises(ScheduleError, match="3F8 has microbatch outside 0..7"):
        check(golden("1F1B"))
    assert check(golden("GPipe")) == 22
    assert check(golden("ZBVZeroBubble")) == 51
