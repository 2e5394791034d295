"""Send/recv lowering (simulator/lowering.py, docs/schedules.md section 8), torch's dry-run step counts and
collectives.

``add_send_recv`` is compared with torch's own ``_add_send_recv`` action for action, for every well-formed torch
schedule and for our own generators. torch's unit-time dry-run step counts come from torch itself
(``dry_run_steps``: torch's ``_add_send_recv`` then ``_simulate_comms_compute``); those tests skip without torch.
The pure tests (hand-checked lowerings, the engine's lockstep count, a hand-built program with a collective) run
without torch.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest

from pipescope.calibration.torch_schedules import (
    WELL_FORMED,
    build_torch_schedule,
    dry_run_steps,
    expand_overlaps,
    to_torch_order,
    torch_dry_run,
    torch_pipeline_order,
    torch_schedule,
)
from pipescope.simulator.check import check
from pipescope.simulator.costs import UniformCosts
from pipescope.simulator.readers.csvio import read_csv
from pipescope.simulator.ir import Action, ActionKind, Collective, ProgramAction, Schedule, ScheduleError, parse_action
from pipescope.simulator.lowering import add_fsdp_actions, add_send_recv, comm_pair, lower
from pipescope.simulator.network import RING_STEPS, FifoLinks
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate
from goldens import golden_path

OURS = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("v-half", 2)]
SIZES = [(2, 4), (3, 6), (4, 8)]



def _schedule(rows: list[list[str]], placement: tuple[int, ...], microbatches: int = 1) -> Schedule:
    """A schedule from per-device action texts ("" is an idle step)."""
    actions = tuple(tuple(parse_action(t) if t else None for t in row) for row in rows)
    return Schedule("hand", len(rows), microbatches, placement, actions)


def _texts(lists: Any) -> list[list[str]]:
    """Per device (a list of lists, or torch's rank -> list dict), each entry as text, "" for a wait."""
    rows = [lists[r] for r in sorted(lists)] if isinstance(lists, dict) else list(lists)
    return [["" if a is None else str(a) for a in row] for row in rows]


def _torch_steps(timeline: dict[int, list[Any]]) -> int:
    """torch's dry-run step count: the longest rank timeline (waits included) ``_simulate_comms_compute`` returns."""
    return max(len(actions) for actions in timeline.values())


# A compute-only 2-device pipeline, one microbatch; lowered and replayed by hand below.
TINY = [["0F0", "0B0"], ["1F0", "1B0"]]
# Hand-lowered: microbatch 0 as add_send_recv places it, then each device receives microbatch 1 before it
# sends its own part. torch's dry run blocks on a RECV until its SEND has run, so both wait on a SEND queued
# behind the other's RECV; torch's runtime posts receives without blocking (irecv), as our engine does.
CRAFTED = [["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0RECV_B1", "0F1", "0SEND_F1", "0B1"],
           ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]]


def test_tiny_lowering_by_hand() -> None:
    """Round 1: 0F0 + its SEND, 1RECV_F0 lands on device 1, then 1F0 (same round); 0B0 waits a round for 1B0's RECV."""
    lowered = add_send_recv(_schedule([["0F0", "", "0B0"], ["1F0", "1B0"]], (0, 1)))
    assert _texts(lowered.device_actions) == [["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
                                              ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]


def test_tiny_lockstep_by_hand() -> None:
    """The engine's unit-time count: 0F0 | 1F0 | 1B0 | 0B0 = 4 steps, lowered or not (transfers are free)."""
    schedule = _schedule(TINY, (0, 1))
    assert check(schedule) == 4
    assert check(add_send_recv(schedule)) == 4


def test_tiny_dry_run_by_hand(torch_sched: ModuleType) -> None:
    """torch's dry run, step 1: 1RECV_F0 runs right after 0SEND_F0 (lower rank first); step 4: its second pass lets
    0RECV_B0 follow 1SEND_B0 in the same step. 6 steps, where the compute-only lockstep takes 4."""
    schedule = _schedule(TINY, (0, 1))
    lowered = add_send_recv(schedule)
    timeline = torch_sched._simulate_comms_compute(to_torch_order(lowered), lambda s: s, 2)
    assert _texts(timeline) == [["0F0", "0SEND_F0", "", "", "0RECV_B0", "0B0"],
                                ["", "1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert dry_run_steps(schedule) == dry_run_steps(lowered) == (6, "")
    assert check(schedule) == 4


def test_no_comms_between_stages_on_one_device() -> None:
    """V placement puts stages p-1 and p on one device: no send/recv between them; one device needs none at all."""
    home = (0, 1, 1, 0)
    assert comm_pair(Action(1, ActionKind.F, 0), home) is None
    assert comm_pair(Action(2, ActionKind.B, 0), home) is None
    assert comm_pair(Action(2, ActionKind.F, 3), home) == (Action(2, ActionKind.SEND_F, 3),
                                                           Action(3, ActionKind.RECV_F, 3))
    assert comm_pair(Action(1, ActionKind.I, 2), home) == (Action(1, ActionKind.SEND_B, 2),
                                                           Action(0, ActionKind.RECV_B, 2))
    assert comm_pair(Action(0, ActionKind.W, 0), home) is None
    single = build("gpipe", 1, 4)
    assert add_send_recv(single).device_actions == (tuple(single.compute_actions(0)),)
    assert check(single) == 8


def test_one_device_dry_run_equals_lockstep(torch_sched: ModuleType) -> None:
    """Without comms torch's dry run and our lockstep count the same steps."""
    single = build("gpipe", 1, 4)
    assert dry_run_steps(single) == (check(single), "") == (8, "")


def test_crafted_program_runs_on_the_engine_but_stalls_torch_dry_run(torch_sched: ModuleType) -> None:
    """The engine posts RECVs without blocking (torch's runtime irecv), so CRAFTED runs: 8 unit steps. torch's dry
    run blocks a rank on a RECV until the matching SEND ran, so it stalls there: dry_run_steps says why."""
    crafted = _schedule(CRAFTED, (0, 1), microbatches=2)
    assert crafted.is_lowered
    assert check(crafted) == 8
    steps, reason = dry_run_steps(crafted)
    assert steps is None
    assert "not progressing" in reason


def test_crafted_program_runs_without_torch() -> None:
    """The engine half of the above, without torch: the hand-lowered program is taken as is and does not deadlock."""
    crafted = _schedule(CRAFTED, (0, 1), microbatches=2)
    assert lower(crafted) is crafted
    assert check(crafted) == 8


def test_malformed_order_cannot_be_lowered() -> None:
    """torch 2.13's 1F1B (golden): the last rank's 3F8 has no sender, so lowering stops, naming every stuck op."""
    schedule = read_csv(golden_path("1F1B", 4, 8), 8)
    with pytest.raises(ScheduleError, match="deadlock: cannot place sends/recvs: device 3 position 14: 3F8 waits for "
                                            "3RECV_F8 or 2F8") as err:
        add_send_recv(schedule)
    assert "device 0 position 15: 0B7 waits for 0RECV_B7 or 1I7 or 1B7" in str(err.value)


def test_malformed_order_torch_refuses_too(torch_sched: ModuleType) -> None:
    """torch's own lowering refuses the same golden: dry_run_steps gives no count and torch's reason."""
    schedule = read_csv(golden_path("1F1B", 4, 8), 8)
    steps, reason = dry_run_steps(schedule)
    assert steps is None
    assert "Malformed compute schedule" in reason


def test_lowered_input_is_taken_as_is() -> None:
    """add_send_recv refuses a lowered schedule; lower() and the checker take it unchanged."""
    schedule = _schedule(TINY, (0, 1))
    lowered = add_send_recv(schedule)
    with pytest.raises(ValueError, match="already has comm action"):
        add_send_recv(lowered)
    assert lower(schedule) == lowered
    assert lower(lowered) is lowered
    assert check(lowered) == check(schedule) == 4


def test_lowered_input_dry_runs_as_is(torch_sched: ModuleType) -> None:
    """dry_run_steps replays a lowered schedule with torch's ``_simulate_comms_compute`` directly."""
    assert dry_run_steps(add_send_recv(_schedule(TINY, (0, 1)))) == (6, "")


@pytest.mark.parametrize(("name", "steps"), [("GPipe", 56), ("ZBVZeroBubble", 133)])
def test_goldens_dry_run_steps(torch_sched: ModuleType, name: str, steps: int) -> None:
    """torch's dry-run counts of the golden CSVs (hand-checked for torch 2.13; see the parity tests)."""
    schedule = read_csv(golden_path(name, 4, 8), 8)
    assert dry_run_steps(schedule) == (steps, "")
    assert steps >= check(schedule)


@pytest.mark.parametrize(("name", "chunks"), OURS)
def test_our_generators_lower_without_deadlock(name: str, chunks: int) -> None:
    """Our generators lower without deadlock, keep each device's compute order, and the engine's lockstep count is
    the same for the compute-only and the lowered program (transfers are free)."""
    schedule = build(name, 4, 8, chunks=chunks)
    lowered = add_send_recv(schedule)
    assert [lowered.compute_actions(d) for d in range(4)] == [schedule.compute_actions(d) for d in range(4)]
    assert check(lowered) == check(schedule) > 0


@pytest.mark.parametrize(("name", "chunks"), WELL_FORMED)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_torch_schedules_match_torch_dry_run(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                             microbatches: int) -> None:
    """Our lowering is torch's ``_add_send_recv`` action for action, and dry_run_steps is torch_dry_run's step
    count, never below our lockstep count. DualPipeV's OVERLAP_F_B is expanded to its sub-actions (torch's dry run
    rejects it), as our IR holds it."""
    schedule = torch_schedule(name, stages, microbatches, chunks)
    order = expand_overlaps(torch_pipeline_order(name, stages, microbatches, chunks))
    compute = {rank: [a for a in acts if a is not None and a.is_compute_op] for rank, acts in order.items()}
    home = schedule.stage_to_device
    theirs = torch_sched._add_send_recv(compute, lambda s: home[s], schedule.num_stages)
    lowered = add_send_recv(schedule)
    assert _texts(lowered.device_actions) == _texts(theirs)
    steps = _torch_steps(torch_dry_run(order, lambda s: home[s], schedule.num_stages))
    assert dry_run_steps(schedule) == dry_run_steps(lowered) == (steps, "")
    assert steps >= check(schedule)


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


@pytest.mark.parametrize(("name", "chunks"), OURS + [("interleaved", 4), ("dualpipev", 2)])
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_fsdp_actions_are_placed_as_torchs_runtime_places_them(torch_sched: ModuleType, name: str, chunks: int,
                                                               stages: int, microbatches: int) -> None:
    """``add_fsdp_actions`` puts UNSHARD, RESHARD and REDUCE_GRAD where torch's ``_add_unshard_reshard`` and
    ``_add_reduce_grad`` do, on every device of our generators' orders (four chunks a device make it evict)."""
    schedule = build(name, stages, max(microbatches, 2 * stages), chunks=chunks)
    order = to_torch_order(schedule)
    theirs = [torch_sched._add_reduce_grad(torch_sched._add_unshard_reshard(order[d]), schedule.num_microbatches)
              for d in range(stages)]
    assert _texts(add_fsdp_actions(schedule).device_actions) == _texts(theirs)


@pytest.mark.parametrize(("name", "chunks"), OURS)
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_our_generators_under_torch_rules(torch_sched: ModuleType, name: str, chunks: int, stages: int,
                                          microbatches: int) -> None:
    """Our generated orders go through torch's own lowering (the same as ours, action for action) and dry run
    without deadlock; dry_run_steps is that dry run's step count, never below our lockstep count."""
    schedule = build(name, stages, microbatches, chunks=chunks)
    home = schedule.stage_to_device
    theirs = torch_sched._add_send_recv(to_torch_order(schedule), lambda s: home[s], schedule.num_stages)
    assert _texts(add_send_recv(schedule).device_actions) == _texts(theirs)
    timeline = torch_sched._simulate_comms_compute(theirs, lambda s: home[s], schedule.num_stages)
    assert dry_run_steps(schedule) == (_torch_steps(timeline), "")
    assert _torch_steps(timeline) >= check(schedule)


def test_torch_also_deadlocks_on_the_crafted_schedule(torch_sched: ModuleType, capsys: pytest.CaptureFixture) -> None:
    """torch's dry run stalls on the hand-lowered program (it prints its partial timeline, then raises), naming
    both RECVs it is stuck on."""
    crafted = _schedule(CRAFTED, (0, 1), microbatches=2)
    with pytest.raises(ValueError, match="not progressing"):
        torch_sched._simulate_comms_compute(to_torch_order(crafted), lambda s: s, 2)
    printed = capsys.readouterr().out
    assert "next action= 0RECV_B1" in printed and "next action= 1RECV_F1" in printed


# A hand-lowered 2-device program ending in a gradient all-reduce between both devices.
ALL_REDUCE = Collective(-1, ActionKind.ALL_REDUCE, -1, (0, 1), 1024)
WITH_COLLECTIVE = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
DELAY_NS = 500


def _program(rows: list[list[str]], tails: list[list[Collective]]) -> Schedule:
    """A lowered 2-stage schedule on 2 devices from action texts, each device's list followed by ``tails``."""
    actions: tuple[tuple[ProgramAction, ...], ...] = tuple(
        tuple(parse_action(t) for t in row) + tuple(tail) for row, tail in zip(rows, tails))
    return Schedule("hand", 2, 1, (0, 1), actions)


def test_collective_starts_when_the_last_member_joins() -> None:
    """Device 1 reaches the all-reduce after 1SEND_B0, device 0 only after 0B0: both members' rows start when
    device 0 joins and last a 2-device ring all-reduce, 2 steps of the fixed delay."""
    schedule = _program(WITH_COLLECTIVE, [[ALL_REDUCE], [ALL_REDUCE]])
    assert schedule.is_lowered
    frame = simulate(schedule, UniformCosts(1e-6, 1e-6, 1e-6), FifoLinks.fixed_delay(DELAY_NS)).timeline
    rows = frame[frame["stream"] == "collective"]
    assert sorted(rows["device"]) == [0, 1]
    b0_end = int(frame.loc[frame["action"] == "0B0", "end_ns"].iloc[0])
    sent = int(frame.loc[frame["action"] == "1SEND_B0", "start_ns"].iloc[0])
    assert sent < b0_end  # device 1 joined first and waited for device 0
    assert set(rows["start_ns"]) == {b0_end}
    assert RING_STEPS[ActionKind.ALL_REDUCE](2) == 2
    assert set(rows["end_ns"]) == {b0_end + 2 * DELAY_NS}
    assert set(rows["bytes"]) == {1024}


def test_collective_member_that_never_joins_is_a_deadlock() -> None:
    """Device 1's list lacks the all-reduce: device 0 waits for it for ever, reported as a deadlock naming the
    waiting device and the collective with its group."""
    schedule = _program(WITH_COLLECTIVE, [[ALL_REDUCE], []])
    with pytest.raises(ScheduleError) as err:
        simulate(schedule, UniformCosts(1e-6, 1e-6, 1e-6), FifoLinks.fixed_delay(DELAY_NS))
    assert err.value.problems == [f"deadlock: device 0 op 2: {ALL_REDUCE} waits for 2 members (1 joined)"]
    assert str(ALL_REDUCE) == "-1ALL_REDUCE-1[0+1:1024B]"
