"""The schedule IR: torch's action text and CSV, round trips through golden files."""

import os

import pytest

from pipescope.simulator.readers.csvio import from_csv_text, read_csv, to_csv_text, write_csv
from pipescope.simulator.ir import Action, ActionKind, parse_action, parse_cell
from pipescope.simulator.schedules import build
from goldens import GOLDEN


K = ActionKind


def test_action_text_round_trip() -> None:
    """``2F0`` parses to stage 2, forward, microbatch 0 and prints back the same."""
    for text in ("2F0", "0I3", "1W3", "12B107", "3SEND_F1", "0RECV_B2"):
        assert str(parse_action(text)) == text
    assert parse_action("2F0") == Action(2, K.F, 0)


def test_stage_actions_and_overlap_cells() -> None:
    """torch's stage-level actions and OVERLAP_F_B cells parse."""
    assert parse_action("0UNSHARD") == Action(0, K.UNSHARD, -1)
    assert str(parse_action("7REDUCE_GRAD")) == "7REDUCE_GRAD"
    assert parse_cell("(0F5;1B3)OVERLAP_F_B") == [Action(0, K.F, 5), Action(1, K.B, 3)]
    assert parse_cell("  ") == []


@pytest.mark.parametrize("bad", ["F0", "2X0", "2F", "a2F0", "2F0x"])
def test_malformed_action_text(bad: str) -> None:
    """Malformed action text raises ValueError quoting the text."""
    with pytest.raises(ValueError, match=repr(bad).replace("'", "")[:1] or "action"):
        parse_action(bad)


@pytest.mark.parametrize(("name", "p", "m"), [("1f1b", 4, 8), ("gpipe", 3, 4)])
def test_golden_csv_round_trip(name: str, p: int, m: int, tmp_path) -> None:
    """The golden file equals what the generator writes, and reading then writing it changes nothing."""
    path = os.path.join(GOLDEN, f"pipescope_{name}_p{p}_m{m}.csv")
    with open(path, encoding="utf-8") as handle:
        golden = handle.read()
    assert to_csv_text(build(name, p, m)) == golden
    loaded = read_csv(path)
    assert loaded.device_actions == build(name, p, m).device_actions
    assert loaded.stage_to_device == tuple(range(p))
    out = tmp_path / "again.csv"
    write_csv(loaded, str(out))
    assert out.read_text() == golden


def test_csv_idle_steps_are_kept() -> None:
    """An empty cell is an idle step (None) and survives the round trip."""
    text = "0F0,,0B0\n,1F0,1B0\n"
    schedule = from_csv_text(text)
    assert schedule.device_actions[0] == (Action(0, K.F, 0), None, Action(0, K.B, 0))
    assert to_csv_text(schedule) == text


def test_csv_blank_lines_bom_and_digits() -> None:
    """Trailing blank lines are not ranks, a blank rank in the middle is an error, a BOM is ignored,
    and only ASCII digits count as stage or microbatch numbers."""
    assert from_csv_text("0F0,0B0\n1F0,1B0\n\n\n").num_devices == 2
    assert from_csv_text("\ufeff0F0,0B0\n1F0,1B0\n").device_actions[0][0] == Action(0, K.F, 0)
    with pytest.raises(ValueError, match="row 1 is blank"):
        from_csv_text("0F0,0B0\n\n1F0,1B0\n")
    with pytest.raises(ValueError, match="is not of the form"):
        parse_action("\u0660F\u0660")
