"""Send/recv lowering and torch's unit-time dry run without torch (simulator/lowering.py, SCHEDULES.md section 8).

Where torch is installed, our lowered orders, timelines and step counts are compared with torch's own
``_add_send_recv`` and ``_simulate_comms_compute``: they match exactly for every well-formed torch schedule and for
our own generators. The pure tests (hand-checked cases, goldens) run without torch.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any

import pytest

from pipescope.calibration.torch_schedules import (
    WELL_FORMED,
    build_torch_schedule,
    expand_overlaps,
    golden_name,
    torch_dry_run,
    torch_pipeline_order,
    torch_schedule,
)
from pipescope.simulator.check import ScheduleError, check, lockstep
from pipescope.simulator.csvio import read_csv
from pipescope.simulator.ir import Action, Schedule, parse_action
from pipescope.simulator.lowering import add_send_recv, comm_pair, comm_steps, lockstep_comms, simulate_comms
from pipescope.simulator.schedules import build

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
OURS = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("v-half", 2)]
SIZES = [(2, 4), (3, 6), (4, 8)]


@pytest.fixture(scope="module")
def torch_sched() -> ModuleType:
    """torch's schedules module; tests that use it skip when torch is not installed."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def _schedule(rows: list[list[str]], placement: tuple[int, ...], microbatches: int = 1) -> Schedule:
    """A schedule from per-device action texts ("" is an idle step)."""
    actions = tuple(tuple(parse_action(t) if t else None for t in row) for row in rows)
    return Schedule("hand", len(rows), microbatches, placement, actions)


def _texts(lists: Any) -> list[list[str]]:
    """Per device (a list of lists, or torch's rank -> list dict), each entry as text, "" for a wait."""
    rows = [lists[r] for r in sorted(lists)] if isinstance(lists, dict) else list(lists)
    return [["" if a is None else str(a) for a in row] for row in rows]


def _to_torch(torch_sched: ModuleType, schedule: Schedule) -> dict[int, list[Any]]:
    """Our actions as torch ``_Action`` objects, idle steps dropped (as torch's dry run does)."""
    return {d: [torch_sched._Action(a.stage, torch_sched._ComputationType(a.kind), a.microbatch)
                for a in acts if a is not None] for d, acts in enumerate(schedule.device_actions)}


def _torch_steps(timeline: dict[int, list[Any]]) -> int:
    """torch's dry-run step count: the longest rank timeline (waits included) ``_simulate_comms_compute`` returns."""
    return max(len(actions) for actions in timeline.values())


# A compute-only 2-device pipeline, one microbatch; lowered and replayed by hand below.
TINY = [["0F0", "0B0"], ["1F0", "1B0"]]
# Hand-lowered: microbatch 0 as add_send_recv places it, then each device receives microbatch 1 before it
# sends its own part, so both wait on a SEND queued behind the other's RECV. The compute order alone is fine.
CRAFTED = [["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0RECV_B1", "0F1", "0SEND_F1", "0B1"],
           ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]]


def test_tiny_lowering_by_hand() -> None:
    """Round 1: 0F0 + its SEND, 1RECV_F0 lands on device 1, then 1F0 (same round); 0B0 waits a round for 1B0's RECV."""
    lowered = add_send_recv(_schedule([["0F0", "", "0B0"], ["1F0", "1B0"]], (0, 1)))
    assert _texts(lowered.device_actions) == [["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
                                              ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]


def test_tiny_dry_run_by_hand() -> None:
    """Step 1: 1RECV_F0 runs right after 0SEND_F0 (lower device first); step 4: the second pass lets 0RECV_B0 follow
    1SEND_B0 in the same step. 6 steps, where the compute-only lockstep takes 4."""
    schedule = _schedule(TINY, (0, 1))
    timeline, stuck = simulate_comms(add_send_recv(schedule))
    assert not stuck
    assert _texts(timeline) == [["0F0", "0SEND_F0", "", "", "0RECV_B0", "0B0"],
                                ["", "1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert comm_steps(schedule) == lockstep_comms(add_send_recv(schedule))[0] == 6
    assert check(schedule) == 4


def test_no_comms_between_stages_on_one_device() -> None:
    """V placement puts stages p-1 and p on one device: no send/recv between them; one device needs none at all."""
    home = (0, 1, 1, 0)
    assert comm_pair(Action(1, "F", 0), home) is None
    assert comm_pair(Action(2, "B", 0), home) is None
    assert comm_pair(Action(2, "F", 3), home) == (Action(2, "SEND_F", 3), Action(3, "RECV_F", 3))
    assert comm_pair(Action(1, "I", 2), home) == (Action(1, "SEND_B", 2), Action(0, "RECV_B", 2))
    assert comm_pair(Action(0, "W", 0), home) is None
    single = build("gpipe", 1, 4)
    assert add_send_recv(single).device_actions == (tuple(single.compute_actions(0)),)
    assert comm_steps(single) == check(single) == 8


def test_deadlock_only_with_comms_names_stuck_actions() -> None:
    """Microbatch 0 runs (6 steps), then both devices wait on a RECV whose SEND the other has not reached."""
    crafted = _schedule(CRAFTED, (0, 1), microbatches=2)
    assert check(crafted) == 8
    steps, stuck = lockstep_comms(crafted)
    assert stuck == ["device 0 position 4: 0RECV_B1 waits for 1SEND_B1 (on device 1)",
                     "device 1 position 4: 1RECV_F1 waits for 0SEND_F1 (on device 0)"]
    assert steps == 7  # as torch counts: the 6 steps that ran plus the sweep that found no device able to move
    with pytest.raises(ScheduleError, match=r"deadlock: device 0 position 4: 0RECV_B1 waits for 1SEND_B1"):
        comm_steps(crafted)


def test_malformed_order_cannot_be_lowered() -> None:
    """torch 2.13's 1F1B (golden): the last rank's 3F8 has no sender, so lowering stops, naming every stuck op."""
    schedule = read_csv(os.path.join(GOLDEN, golden_name("1F1B", 4, 8)), 8)
    with pytest.raises(ScheduleError, match="device 3 position 14: 3F8 waits for 3RECV_F8 or 2F8") as err:
        add_send_recv(schedule)
    assert "device 0 position 15: 0B7 waits for 0RECV_B7 or 1I7 or 1B7" in str(err.value)


def test_lowered_input_is_taken_as_is() -> None:
    """add_send_recv refuses a lowered schedule; comm_steps replays it unchanged."""
    lowered = add_send_recv(_schedule(TINY, (0, 1)))
    with pytest.raises(ValueError, match="already has comm action"):
        add_send_recv(lowered)
    assert comm_steps(lowered) == 6


@pytest.mark.parametrize(("name", "steps"), [("GPipe", 56), ("ZBVZeroBubble", 133)])
def test_goldens_without_torch(name: str, steps: int) -> None:
    """torch's dry-run counts from the golden CSVs alone (torch 2.13 gives the same, see the parity tests)."""
    assert comm_steps(read_csv(os.path.join(GOLDEN, golden_name(name, 4, 8)), 8)) == steps


@pytest.mark.parametrize(("name", "chunks"), OURS)
def test_our_generators_lower_without_deadlock(name: str, chunks: int) -> None:
    """Comms only add steps: torch's count is at least the compute-only lockstep count."""
    schedule = build(name, 4, 8, chunks=chunks)
    assert comm_steps(schedule) >= check(schedule) == lockstep(schedule)[0]


@pytest.mark.parametrize(("name", "chunks"), WELL_FORMED)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_torch_schedules_match_torch_dry_run(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                             microbatches: int) -> None:
    """Our lowering is torch's ``_add_send_recv`` action for action, our replay its timeline step for step, and
    comm_steps is torch_dry_run's step count. DualPipeV's OVERLAP_F_B is expanded to its sub-actions (torch's
    dry run rejects it), as our IR holds it."""
    schedule = torch_schedule(name, stages, microbatches, chunks)
    order = expand_overlaps(torch_pipeline_order(name, stages, microbatches, chunks))
    compute = {rank: [a for a in acts if a is not None and a.is_compute_op] for rank, acts in order.items()}
    home = schedule.stage_to_device
    theirs = torch_sched._add_send_recv(compute, lambda s: home[s], schedule.num_stages)
    lowered = add_send_recv(schedule)
    assert _texts(lowered.device_actions) == _texts(theirs)
    assert _texts(simulate_comms(lowered)[0]) == _texts(
        torch_sched._simulate_comms_compute(theirs, lambda s: home[s], schedule.num_stages))
    assert comm_steps(schedule) == _torch_steps(torch_dry_run(order, lambda s: home[s], schedule.num_stages))


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_runtime_lowering_matches_given_the_same_stage_actions(torch_sched: ModuleType, name: str) -> None:
    """torch's runtime adds UNSHARD/RESHARD/REDUCE_GRAD before placing sends/recvs, and each takes a placement
    round, so its RECVs can sit elsewhere than in the dry run's lowering; fed the same lists, ours places them
    as torch's runtime does (``pipeline_order_with_comms``)."""
    obj = build_torch_schedule(name, 4, 8, 2, lowered=True)
    pre = [torch_sched._add_reduce_grad(torch_sched._add_unshard_reshard(obj.pipeline_order[r]), 8) for r in range(4)]
    given = tuple(tuple(parse_action(str(a)) for a in acts) for acts in pre)
    ours = add_send_recv(dataclasses.replace(torch_schedule(name, 4, 8, 2), device_actions=given))
    assert _texts(ours.device_actions) == _texts(obj.pipeline_order_with_comms)


@pytest.mark.parametrize(("name", "chunks"), OURS)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_our_generators_under_torch_rules(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                          microbatches: int) -> None:
    """Our generated orders go through torch's own lowering and dry run without deadlock, in as many steps as ours."""
    schedule = build(name, stages, microbatches, chunks=chunks)
    home = schedule.stage_to_device
    theirs = torch_sched._add_send_recv(_to_torch(torch_sched, schedule), lambda s: home[s], schedule.num_stages)
    assert _texts(add_send_recv(schedule).device_actions) == _texts(theirs)
    timeline = torch_sched._simulate_comms_compute(theirs, lambda s: home[s], schedule.num_stages)
    assert comm_steps(schedule) == _torch_steps(timeline)


def test_torch_also_deadlocks_on_the_crafted_schedule(torch_sched: ModuleType, capsys: pytest.CaptureFixture) -> None:
    """torch's dry run stalls on the same hand-lowered program (it prints its partial timeline, then raises)."""
    crafted = _schedule(CRAFTED, (0, 1), microbatches=2)
    with pytest.raises(ValueError, match="not progressing"):
        torch_sched._simulate_comms_compute(_to_torch(torch_sched, crafted), lambda s: s, 2)
    printed = capsys.readouterr().out
    assert "next action= 0RECV_B1" in printed and "next action= 1RECV_F1" in printed
