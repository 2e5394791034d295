"""Hostile schedule CSVs: every bad file is a one-line error naming the file, the row and what was expected (exit 2
for ``pipescope check`` and ``pipescope simulate --schedule csv:FILE``), never a traceback, a hang or gigabytes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipescope.simulator.readers import csvio
from pipescope.simulator.check import check
from pipescope.simulator.readers.csvio import MAX_CSV_BYTES, from_csv_text, read_csv, to_csv_text
from pipescope.simulator.ir import ScheduleError
from pipescope.simulator.lowering import add_send_recv
from pipescope.simulator.schedules import build


def _one_line_error(cli, path: Path, *needles: str) -> str:
    """``check FILE`` and ``simulate --schedule csv:FILE`` both exit 2 with one stderr line naming the file and
    ``needles``; returns check's line."""
    lines = []
    for args in (["check", str(path)], ["simulate", "--schedule", f"csv:{path}", "--set", "costs.kind=uniform"]):
        code, out, err = cli(args)
        assert (code, out) == (2, ""), (args, code, err)
        assert err.count("\n") == 1 and err.startswith("pipescope: error: "), err
        assert str(path) in err, err
        for needle in needles:
            assert needle in err, (needle, err)
        lines.append(err)
    return lines[0]


def test_cell_over_the_csv_field_limit(tmp_path, cli) -> None:
    """A 200,000-character cell (csv's limit is 131,072) is an error naming the row, not csv.Error's traceback."""
    path = tmp_path / "wide.csv"
    path.write_text("0F0,0B0\n1F0," + "x" * 200_000 + "\n")
    _one_line_error(cli, path, "row 1 (line 2): field larger than field limit")


def test_quoted_cell_over_the_limit_and_other_csv_errors(tmp_path, cli) -> None:
    """An unterminated quote swallowing the rest of a big file hits the same limit: still one line."""
    path = tmp_path / "quote.csv"
    path.write_text('0F0,"0B0\n' + "1F0,1B0\n" * 20_000)
    _one_line_error(cli, path, "row 0 (line", "field larger than field limit")


def test_undecodable_bytes(tmp_path, cli) -> None:
    """Latin-1 bytes: the error says where and that UTF-8 was expected."""
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"0F0,0B0\n1F0,\xe91B0\n")
    _one_line_error(cli, path, "line 2: byte 0xe9 at offset 12 is not UTF-8, expected a UTF-8 text file")


def test_nul_bytes(tmp_path, cli) -> None:
    path = tmp_path / "nul.csv"
    path.write_bytes(b"0F0,0B0\n1F0,\x00,1B0\n")
    _one_line_error(cli, path, "line 2 holds a NUL byte")


def test_enormous_file_is_refused_before_it_is_read(tmp_path, cli) -> None:
    """A 16 GiB (sparse) file: only MAX_CSV_BYTES + 1 bytes are read, the limit is named, quickly."""
    path = tmp_path / "enormous.csv"
    with open(path, "wb") as handle:
        handle.write(b"0F0,0B0\n")
        handle.truncate(16 << 30)
    start = time.perf_counter()
    _one_line_error(cli, path, f"larger than {MAX_CSV_BYTES} bytes (64 MiB, MAX_CSV_BYTES)")
    assert time.perf_counter() - start < 10


def test_too_many_cells_or_actions(tmp_path, monkeypatch, cli) -> None:
    """The cell and action bounds (made small here) are errors that name them."""
    monkeypatch.setattr(csvio, "MAX_CSV_CELLS", 100)
    path = tmp_path / "commas.csv"
    path.write_text("0F0,0B0\n1F0,1B0" + "," * 200 + "\n")
    _one_line_error(cli, path, "about 205 cells, expected at most 100 (MAX_CSV_CELLS)")
    monkeypatch.setattr(csvio, "MAX_CSV_ACTIONS", 3)
    path.write_text("0F0,0B0\n1F0,1B0\n")  # refused before parsing: 4 cells start an action
    _one_line_error(cli, path, "4 cells hold actions, expected at most 3 (MAX_CSV_ACTIONS)")
    path.write_text('0F0,"0B0"\n1F0,"1B0"\n')  # quoted cells escape the pre-count; the parser counts them
    _one_line_error(cli, path, "row 1: more than 3 actions (MAX_CSV_ACTIONS)")


def test_text_over_the_byte_bound(monkeypatch) -> None:
    """from_csv_text (the API) holds text to the same bound as read_csv does files."""
    monkeypatch.setattr(csvio, "MAX_CSV_BYTES", 10)
    with pytest.raises(ValueError, match=r"16 characters, expected at most 10"):
        from_csv_text("0F0,0B0\n1F0,1B0\n")


def test_a_folder_is_not_a_csv(tmp_path, cli) -> None:
    code, _, err = cli(["simulate", "--schedule", f"csv:{tmp_path}", "--set", "costs.kind=uniform"])
    assert code == 2 and err.count("\n") == 1 and "not a regular file" in err


@pytest.mark.parametrize(("text", "needle"), [
    # a send/recv/per-stage cell naming a stage that does not exist (torch's dry run crashed on these; simulate ran)
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,3RECV_B1\n",
     "row 1 cell 4: '3RECV_B1' names stage 3, expected a stage in 0..1"),
    ("0F0,0SEND_F0,0RECV_B0,0B0,7UNSHARD\n1RECV_F0,1F0,1B0,1SEND_B0\n",
     "row 0 cell 4: '7UNSHARD' names stage 7, expected a stage in 0..1"),
    ("0F0,0B0,9SEND_F5\n1F0,1B0\n", "row 0 cell 2: '9SEND_F5' names stage 9, expected a stage in 0..1"),
    # indices far beyond any pipeline
    ("0F0,0B0\n1F0,1B" + "1" + "0" * 30 + "\n", "row 1 cell 1: action '1B1000"),
    ("0F0,0B0\n1F0,1B0,1" + "0" * 30 + "RECV_F0\n", "has stage 100000000000... (31 digits), expected at most"),
    ("0F0,0B0\n1F0,1B0," + "9" * 5000 + "UNSHARD\n", "(5000 digits), expected at most 999999999"),
    # a rank with no compute action, stages with a gap
    ("0F0,0B0\n0UNSHARD\n1F0,1B0\n", "row 1 has no compute action (F, I, W or B)"),
    ("0F0,0B0\n1SEND_F0\n", "row 1 has no compute action"),
    ("0F0,0B0\n5F0,5B0\n", "row 1 cell 0: '5F0' uses stage 5 but the file has no compute action for stage(s) [1, 2"),
    ("0F0,0B0\n\n1F0,1B0\n", "row 1 is blank"),
    # quotes: one left open runs to the end of the file, one closed mid-cell leaves text after it
    ('0F0,"0B0\n', "row 0 (line 1): unexpected end of data, expected short comma-separated cells such as 0F0"),
    ('0F0,"0B0"x\n1F0,1B0\n', "row 0 (line 1): ',' expected after '\"'"),
])
def test_bad_cells_are_named_by_row_and_cell(tmp_path, cli, text: str, needle: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    line = _one_line_error(cli, path, needle)
    assert len(line) < 400  # a 5,000-digit cell is cut short in the message


def test_microbatch_beyond_the_given_count_is_a_finding(tmp_path, cli) -> None:
    """A microbatch far beyond --microbatches is a finding of the checker (exit 1), naming device, step and range."""
    path = tmp_path / "far.csv"
    path.write_text("0F0,0B0,0F999999\n1F0,1B0\n")
    code, out, err = cli(["check", str(path), "--microbatches", "1"])
    assert code == 1 and out == ""
    assert err.splitlines() == [f"{path}: invalid schedule", "  device 0 step 2: 0F999999 has microbatch outside 0..0"]
    code, _, err = cli(["simulate", "--schedule", f"csv:{path}", "--microbatches", "1", "--set", "costs.kind=uniform"])
    assert code == 1 and err.count("\n") == 1 and "0F999999 has microbatch outside 0..0" in err
    for bad in ("0", "-1", "1_0"):  # the flag is at fault, not the file
        code, _, err = cli(["check", str(path), "--microbatches", bad])
        assert code == 2 and err.startswith(f"pipescope: error: --microbatches: got '{bad}', expected an integer "
                                            "from 1 to 500,000"), err


def test_a_file_that_reads_as_two_pipelines_of_a_billion_microbatches_is_checked_at_once(tmp_path, cli) -> None:
    """Stage 0 runs microbatch 0, stage 1 microbatch 999,999,999: two pipelines (``from_csv_text``) of 10^9
    microbatches, each stage missing nearly all of its half. The checker walks each stage's own microbatches and
    stops after a few findings (it scanned all 10^9 of the other pipeline's and hung)."""
    path = tmp_path / "far.csv"
    path.write_text("0F0,0B0\n1F999999999,1B999999999\n")
    code, out, err = cli(["check", str(path)])
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[1] == "  stage 0 microbatch 1: missing F (0F1)" and len(lines) == 14, lines[:3]
    assert "  stage 1 microbatch 500000000: missing F (1F500000000)" in lines


def test_a_million_findings_print_a_few_lines(tmp_path, cli) -> None:
    """``0F0,0B0`` on every row puts stage 0 on every device: 2 findings a row (and 0F0 and 0B0 each appear once a
    row). check lists the first 12 and counts the rest, as simulate's one line does; it printed every one (2,000,003
    lines, 203 MB, for an 8 MB file)."""
    path = tmp_path / "rows.csv"
    path.write_text("0F0,0B0\n" * 2000)
    code, out, err = cli(["check", str(path)])
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == f"{path}: invalid schedule" and len(lines) == 14, lines[:3]
    assert lines[1] == "  device 1 step 0: 0F0 but stage 0 is on device 0 (a stage on two devices)"
    assert lines[-1] == "  ... and 3988 more lines"  # 2 x 1,999 misplaced ops and 2 repeated ones, less the 12 shown


def test_an_op_repeated_on_one_row_is_one_short_line(tmp_path, cli) -> None:
    """One row of ``0F0,0B0`` 5,000 times: each repeated op lists its first 12 places and counts the rest (it listed
    all of them: a 40 MB line at 900,000), for check and for simulate."""
    path = tmp_path / "row.csv"
    path.write_text(",".join(["0F0,0B0"] * 5000) + "\n")
    code, _, err = cli(["check", str(path)])
    assert code == 1 and len(err) < 1000, len(err)
    assert "  0F0 appears 5000 times (device 0 step 0, device 0 step 2, " in err
    assert "device 0 step 22, ... and 4988 more)" in err
    code, _, err = cli(["simulate", "--schedule", f"csv:{path}", "--set", "costs.kind=uniform"])
    assert code == 1 and err.count("\n") == 1 and len(err) < 1000, len(err)
    assert "0B0 appears 5000 times (device 0 step 1, " in err and "... and 4988 more)" in err
    assert err.startswith(f"pipescope: invalid schedule csv:{path}: ")  # which file, as check names it


def test_good_files_still_read(tmp_path) -> None:
    """A BOM, CRLF line ends, trailing blank lines and idle cells are fine."""
    path = tmp_path / "ok.csv"
    path.write_bytes(b"\xef\xbb\xbf0F0,,0B0\r\n1F0,1B0\r\n\r\n\r\n")
    schedule = read_csv(str(path))
    assert schedule.num_devices == 2 and check(schedule) == 4


# ---- property: any text either reads and checks, or fails with ValueError/ScheduleError on one line ----

CELLS = st.one_of(
    st.sampled_from(["0F0", "1F0", "0B0", "1B0", "0F1", "1F1", "0B1", "1B1", "1I2", "2W1", "2F0", "2B0", "0I0", "0W0",
                     "1I0", "1W0", "0B3", "1SEND_F0", "0SEND_F0", "1RECV_F0", "2RECV_B1", "1SEND_B0", "0RECV_B0",
                     "0UNSHARD", "1RESHARD", "2REDUCE_GRAD", "(0F1;1B0)OVERLAP_F_B", "", " ", "", ""]),
    st.builds(lambda s, k, m: f"{s}{k}{m}", st.integers(0, 10**40), st.sampled_from(["F", "B", "I", "W", "SEND_F",
                                                                                   "RECV_B", "UNSHARD"]),
              st.integers(-3, 10**40)),
    st.text(alphabet='0123456789FIBW_SENDRCV,"\n\r;() \x00\ufeff\u00e9', max_size=12),
)
ROWS = st.lists(st.lists(CELLS, min_size=0, max_size=8), min_size=0, max_size=6)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=ROWS, quoted=st.booleans(), microbatches=st.one_of(st.none(), st.integers(-1, 5), st.just(10**30)))
def test_random_csv_reads_or_fails_on_one_line(rows: list[list[str]], quoted: bool,
                                               microbatches: int | None) -> None:
    text = "\n".join(",".join(f'"{c}"' if quoted and '"' not in c else c for c in row) for row in rows) + "\n"
    start = time.perf_counter()
    try:
        schedule = from_csv_text(text, microbatches)
        steps = check(schedule)
    except ScheduleError as err:  # a finding: every problem one line
        event("ScheduleError")
        assert err.problems and all(line and "\n" not in line for line in err.problems)
        assert "\n" not in str(err)
    except ValueError as err:  # a usage error: one line
        event("ValueError")
        assert str(err) and "\n" not in str(err) and "\r" not in str(err)
    else:
        event("ok")
        assert steps >= 1 and schedule.num_devices == len(schedule.device_actions)
    assert time.perf_counter() - start < 5


def _base_rows(name: str, p: int, m: int, lowered: bool) -> list[list[str]]:
    schedule = build(name, p, m)
    text = to_csv_text(add_send_recv(schedule) if lowered else schedule, compute_only=not lowered)
    return [line.split(",") for line in text.splitlines()]


MUTATION = st.tuples(st.sampled_from(["swap", "drop", "set", "insert", "dup_row", "drop_row"]),
                     st.integers(0, 63), st.integers(0, 63), CELLS)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]), p=st.integers(1, 4),
       lowered=st.booleans(), mutations=st.lists(MUTATION, max_size=4),
       microbatches=st.one_of(st.none(), st.integers(1, 6)))
def test_mutated_schedule_reads_or_fails_on_one_line(name: str, p: int, lowered: bool,
                                                     mutations: list[tuple[str, int, int, str]],
                                                     microbatches: int | None) -> None:
    """Real schedules (compute-only or lowered) with a few cells swapped, dropped, replaced or inserted, or rows
    repeated or dropped: they get through the reader and checker (lowering, compile, engine) or fail on one line."""
    try:
        rows = _base_rows(name, p, 4, lowered)
    except ValueError:  # a size the generator refuses
        return
    for op, i, j, cell in mutations:
        row = rows[i % len(rows)]
        k = j % max(1, len(row))
        if op == "swap" and len(row) > 1:
            row[k], row[(k + 1) % len(row)] = row[(k + 1) % len(row)], row[k]
        elif op == "drop" and row:
            del row[k]
        elif op == "set" and row:
            row[k] = cell
        elif op == "insert":
            row.insert(k, cell)
        elif op == "dup_row":
            rows.insert(i % len(rows), list(row))
        elif op == "drop_row" and len(rows) > 1:
            del rows[i % len(rows)]
    text = "\n".join(",".join(row) for row in rows) + "\n"
    start = time.perf_counter()
    try:
        steps = check(from_csv_text(text, microbatches))
    except ScheduleError as err:
        event("ScheduleError")
        assert err.problems and all(line and "\n" not in line for line in err.problems)
    except ValueError as err:
        event("ValueError")
        assert str(err) and "\n" not in str(err) and "\r" not in str(err)
    else:
        event("ok")
        assert steps >= 1
    assert time.perf_counter() - start < 5
