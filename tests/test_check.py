"""The checker: malformed schedules and deadlocks are reported with device, step and actions."""

import pytest

from pipescope.simulator.check import check, unit_steps
from pipescope.simulator.readers.csvio import from_csv_text, write_csv
from pipescope.simulator.ir import Action, ActionKind, Schedule, ScheduleError, parse_action
from pipescope.simulator.lowering import add_send_recv
from pipescope.simulator.schedules import build

K = ActionKind


def _lowered(rows: list[list[str]], microbatches: int) -> Schedule:
    """A hand-lowered 2-stage schedule on 2 devices (it holds SEND/RECV actions, so it is taken as is)."""
    return Schedule("hand", 2, microbatches, (0, 1), tuple(tuple(parse_action(t) for t in row) for row in rows))


def test_generated_schedules_pass() -> None:
    """GPipe and 1F1B pass; GPipe p=4 m=8 takes m+p-1 forward steps and as many backward steps."""
    assert check(build("gpipe", 4, 8)) == 2 * (8 + 4 - 1)
    assert check(build("1f1b", 4, 8)) > 0


def test_crafted_deadlock_names_the_stuck_actions() -> None:
    """Device 0 runs B0 before F1 while device 1 waits for F1 first: the send/recv lowering cannot place either,
    and names both with their positions and what would let them go."""
    text = "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n"
    with pytest.raises(ScheduleError) as err:
        check(from_csv_text(text))
    assert err.value.problems == [
        "deadlock: cannot place sends/recvs: device 0 position 1: 0B0 waits for 0RECV_B0 or 1I0 or 1B0",
        "deadlock: cannot place sends/recvs: device 1 position 0: 1F1 waits for 1RECV_F1 or 0F1",
    ]


def test_lowered_deadlock_names_the_stuck_actions() -> None:
    """The same cycle in a hand-lowered program is found by the engine: each device's stuck op (counted among that
    device's compute ops) and the cross-device input it waits for, named by its producer."""
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0F1", "0SEND_F1", "0RECV_B1", "0B1"],
            ["1RECV_F0", "1RECV_F1", "1F1", "1F0", "1B0", "1SEND_B0", "1B1", "1SEND_B1"]]
    with pytest.raises(ScheduleError) as err:
        check(_lowered(rows, 2))
    assert err.value.problems == ["deadlock: device 0 op 1: 0B0 waits for 1B0 (transfer)",
                                  "deadlock: device 1 op 0: 1F1 waits for 0F1 (transfer)"]


def test_consumer_before_its_recv_is_a_deadlock() -> None:
    """A lowered program whose op comes before the RECV it needs on the same device can never run."""
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1F0", "1RECV_F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleError, match=r"deadlock: device 1: 1F0 waits for 1RECV_F0, which device 1 only posts "
                                            r"after it"):
        check(_lowered(rows, 1))


def test_missing_microbatch_is_named() -> None:
    """Dropping microbatch 2's forward on stage 1 is reported as exactly that."""
    text = "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1F1,1B0,1B1,1B2\n"
    with pytest.raises(ScheduleError, match=r"stage 1 microbatch 2: missing F \(1F2\)"):
        check(from_csv_text(text, num_microbatches=3))


def test_duplicate_action_is_named() -> None:
    """An action listed twice is reported with both positions."""
    text = "0F0,0F0,0B0\n1F0,1B0\n"
    with pytest.raises(ScheduleError, match=r"0F0 appears 2 times \(device 0 step 0, device 0 step 1\)"):
        check(from_csv_text(text))


@pytest.mark.parametrize(("count", "last"), [(12, "p11"), (13, "p12"), (14, "... and 2 more"),
                                             (1_000_000, "... and 999988 more")])
def test_schedule_error_lists_twelve_findings_and_counts_the_rest(count: int, last: str) -> None:
    """The CLI prints every line of ``problems``, so the error keeps at most 12 and ``... and N more`` (never
    "... and 1 more": that line is shown); capping what the checker already capped changes nothing."""
    err = ScheduleError([f"p{i}" for i in range(count)])
    assert err.problems[-1] == last and len(err.problems) == min(count, 13)
    assert str(err) == "; ".join(err.problems)
    assert ScheduleError(err.problems).problems == err.problems


def test_w_before_its_i() -> None:
    """A weight-grad scheduled before its input-grad on the same device is rejected."""
    text = "0F0,0I0,0W0\n1F0,1W0,1I0\n"
    with pytest.raises(ScheduleError, match=r"device 1 step 1: 1W0 comes before its 1I0 \(step 2\)"):
        check(from_csv_text(text))


def test_stage_on_two_devices() -> None:
    """Stage 0's backward on device 1 is a stage on two devices."""
    text = "0F0\n1F0,1B0,0B0\n"
    with pytest.raises(ScheduleError, match="a stage on two devices"):
        check(from_csv_text(text))


def test_microbatch_out_of_range_and_missing_both_reported() -> None:
    """torch 2.13's 1F1B bug shape (forwards 1..m on the last rank) yields both findings."""
    text = "0F0,0F1,0B0,0B1\n1F1,1F2,1B0,1B1\n"
    with pytest.raises(ScheduleError) as err:
        check(from_csv_text(text, num_microbatches=2))
    assert "1F2 has microbatch outside 0..1" in str(err.value)
    assert "missing F (1F0)" in str(err.value)


def test_check_counts_unit_steps() -> None:
    """1F1B p=2 m=2: 0F0 | 0F1 1F0 | 1B0 | 0B0 1F1 | 1B1 | 0B1 = 6 steps."""
    schedule = build("1f1b", 2, 2)
    assert check(schedule) == unit_steps(schedule) == 6


def _hand(rows: list[list[str | Action]], microbatches: int = 1) -> Schedule:
    """2 stages on 2 devices, actions given as text or as Action (for indices no text can hold)."""
    return Schedule("hand", 2, microbatches, (0, 1),
                    tuple(tuple(parse_action(a) if isinstance(a, str) else a for a in row) for row in rows))


@pytest.mark.parametrize(("rows", "problem"), [
    ([["0F0", "0B0", "7UNSHARD"], ["1F0", "1B0"]], "device 0 step 2: 7UNSHARD has stage outside 0..1"),
    ([["0F0", Action(-1, K.RECV_F, 0), "0B0"], ["1F0", "1B0"]], "device 0 step 1: -1RECV_F0 has stage outside 0..1"),
    ([["0F0", "0B0", "1UNSHARD"], ["1F0", "1B0"]],
     "device 0 step 2: 1UNSHARD but stage 1 is on device 1, expected it there"),
    ([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "0SEND_F0"]],
     "device 1 step 4: 0SEND_F0 but stage 0 is on device 0, expected it there"),
    ([["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0SEND_F5"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
     "device 0 step 4: 0SEND_F5 has microbatch outside 0..0"),
    ([["0F0", "0SEND_F0", "0RECV_B0", "0B0", Action(0, K.SEND_F, 10**30)], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
     f"device 0 step 4: 0SEND_F{10**30} has microbatch outside 0..0"),
    ([["0F0", "0B0", Action(0, K.F, 10**30)], ["1F0", "1B0"]],
     f"device 0 step 2: 0F{10**30} has microbatch outside 0..0"),
    ([["0F0", "0B0"], ["1F0", "1B0", Action(10**30, K.F, 0)]], f"device 1 step 2: {10**30}F0 has stage outside 0..1"),
])
def test_sends_receives_and_stage_actions_name_a_stage_on_its_device(rows, problem: str) -> None:
    """A send, receive or per-stage action naming a stage that does not exist, or sitting on another stage's device,
    or a microbatch out of range (even beyond int64) is a finding naming device and step; these were accepted or
    crashed with OverflowError before."""
    with pytest.raises(ScheduleError) as err:
        check(_hand(rows))
    assert problem in err.value.problems


def _round_robin_lowering(schedule: Schedule) -> list[list[Action]]:
    """The placement rule of ``add_send_recv`` done the plain way (every unfinished device visited every round, in
    rank order, as torch does): the oracle for the lowering that visits only devices that may be ready."""
    lists = [[a for a in acts if a is not None] for acts in schedule.device_actions]
    out, placed, cursor = [[] for _ in lists], [set() for _ in lists], [0] * len(lists)
    home, last = schedule.stage_to_device, schedule.num_stages - 1
    while any(cursor[d] < len(lists[d]) for d in range(len(lists))):
        progress = False
        for d in [d for d in range(len(lists)) if cursor[d] < len(lists[d])]:
            s, kind, mb = a = lists[d][cursor[d]]
            needs = ([(s, K.RECV_F), (s - 1, K.F)] if kind is K.F and s > 0 else
                     [(s, K.RECV_B), (s + 1, K.I), (s + 1, K.B)] if kind in (K.I, K.B) and s < last else [])
            if needs and not any(Action(st, kd, mb) in placed[d] for st, kd in needs):
                continue
            progress = True
            cursor[d] += 1
            out[d].append(a)
            placed[d].add(a)
            peer = s + 1 if kind is K.F else s - 1 if kind in (K.I, K.B) else None
            if peer is not None and 0 <= peer <= last and home[peer] != home[s]:
                out[d].append(Action(s, K.SEND_F if kind is K.F else K.SEND_B, mb))
                recv = Action(peer, K.RECV_F if kind is K.F else K.RECV_B, mb)
                out[home[peer]].append(recv)
                placed[home[peer]].add(recv)
        assert progress
    return out


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_check_at_many_devices_gives_the_same_result(name: str) -> None:
    """Where the lowering used to visit every device every round (quadratic in p), the lowered program at p = 1,000
    is the round-robin one action for action, and at p = 2,000 the step counts are those the checker gave before
    (m + p - 1 forward steps and as many backward ones: 4,006)."""
    schedule = build(name, 1000, 4)
    assert [list(acts) for acts in add_send_recv(schedule).device_actions] == _round_robin_lowering(schedule)
    assert check(build(name, 2000, 4)) == 2 * (4 + 2000 - 1)


def test_check_cli_at_2000_devices(tmp_path, cli) -> None:
    """The CLI checks a 2,000-rank CSV with the same counts, and says it skips torch's dry run (quadratic: ~40 s)."""
    path = tmp_path / "wide.csv"
    write_csv(build("1f1b", 2000, 4), str(path))
    code, out, err = cli(["check", str(path)])
    assert (code, err) == (0, "")
    assert f"{path}: ok: 2,000 devices, 2,000 stages, 4 microbatches, 16,000 ops, 4,006 unit-time steps (torch's dry " \
           f"run skipped: 2,000 devices x 4,006 steps, over its limits of 250,000 device-steps and 10,000 steps)" in out


def test_a_stray_action_is_named_not_its_stage_and_a_full_list_says_no_more() -> None:
    """A stage lived where it first appeared, so one stray 1B1 on device 0 made device 1's own 1F0, 1B0 and 1F1 the
    strays; and eight missing microbatches were followed by 'further microbatches not listed' with none left."""
    with pytest.raises(ScheduleError) as stray:
        check(from_csv_text("0F0,0F1,0B0,1B1\n1F0,1B0,1F1,0B1\n"))
    assert stray.value.problems == ["device 0 step 3: 1B1 but stage 1 is on device 1 (a stage on two devices)",
                                    "device 1 step 3: 0B1 but stage 0 is on device 0 (a stage on two devices)"]
    with pytest.raises(ScheduleError) as gaps:
        check(from_csv_text("0F0,0F9,0B0,0B9\n1F0,1B0,1F9,1B9\n"))
    stage0 = [p for p in gaps.value.problems if p.startswith("stage 0")]
    assert stage0 == [f"stage 0 microbatch {mb}: missing F (0F{mb})" for mb in range(1, 9)]


def test_a_send_before_its_backward_names_both_ops_that_could_feed_it() -> None:
    """The message said 'has no I before it' to a file written with B."""
    with pytest.raises(ScheduleError, match=r"device 1: 1SEND_B0 has no I or B before it to send"):
        check(from_csv_text("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1SEND_B0,1B0\n"))


def test_the_count_of_hidden_findings_says_it_counts_lines() -> None:
    """Past the first 12, '... and N more' counted a stage's 'further microbatches not listed' note as if it were a
    problem; it now says it counts lines."""
    with pytest.raises(ScheduleError) as gaps:
        check(from_csv_text("0F0,0F40,0B0,0B40\n1F0,1B0,1F40,1B40\n"))
    problems = gaps.value.problems
    assert len(problems) == 13 and problems[-1].endswith(" more lines"), problems[-3:]
    assert "stage 0: further microbatches not listed" in problems  # a note, among the lines counted
