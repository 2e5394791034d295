"""Hostile input to calibration: corrupt profiles (metadata, tables, comms fits), bad calibrate and
calibrate-comms flags, and a machine without torch. Each gives one line naming the file or flag, the value and
what was expected; never a traceback, a hang or a silently wrong result. None of these tests needs torch."""

from __future__ import annotations

import copy

import json
import math
import re
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_profiled_costs import MODEL, add_comms, make_profile, memory_rows, timing_rows

from pipescope.calibration import commands
from pipescope.calibration.args import MAX_INT
from pipescope.calibration.presets import HARNESS_PRESETS, resolve
from pipescope.calibration.profile_io import write_json, write_table
from pipescope.simulator.costs import MAX_BYTES, MAX_OP_SECONDS
from pipescope.simulator.network import link_transfer_ns
from pipescope.simulator.readers.profile_schema import SCHEMA_VERSION, ProfileError
from pipescope.simulator.profiled import ProfiledCosts

# ---------------------------------------------------------------- helpers: one corruption of a good profile


def csv_profile(folder: Path, mbs: tuple[int, ...] = (2, 4), comms: bool = True) -> Path:
    """A good profile written as CSV (easy to corrupt cell by cell), with a comms fit."""
    make_profile(folder, mbs=mbs, parquet=False)
    if comms:
        add_comms(folder)
    return folder


def set_meta(folder: Path, text: str | None = None, name: str = "profile.json", **changes: object) -> None:
    """Replace keys of the metadata (``None`` removes one), or its whole text."""
    path = folder / name
    if text is None:
        meta = json.loads(path.read_text())
        meta.update(changes)
        text = json.dumps({k: v for k, v in meta.items() if v is not None})
    path.write_text(text)


def set_cell(folder: Path, table: str, column: str, value: object, row: int = 0) -> None:
    """Write ``value`` into one cell of a CSV table (the comms fit is Parquet: rewritten as such)."""
    path = next(folder.glob(f"{table}.*"))
    frame = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
    frame[column] = frame[column].astype(str if isinstance(value, str) else object)  # Parquet: one type a column
    frame.loc[row, column] = value
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)


def load_error(folder: Path, microbatch_size: int = 2, **kwargs: object) -> str:
    """The one-line ProfileError message loading ``folder`` gives (the test fails if it loads)."""
    with pytest.raises(ProfileError) as info:
        ProfiledCosts.load(folder, microbatch_size, **kwargs)
    message = str(info.value)
    assert "\n" not in message and str(folder) in message
    return message


# ---------------------------------------------------------------- metadata


@pytest.mark.parametrize(("changes", "expected"), [
    ({"model": "gpt"}, r"profile.json: model='gpt'; expected a mapping"),
    ({"model": {"layers": "5"}}, r"model.layers='5'; expected an integer from 1 to"),
    ({"model": {"layers": 2.5}}, r"model.layers=2.5; expected an integer"),
    ({"model": {"layers": -3}}, r"model.layers=-3; expected an integer"),
    ({"model": {"layers": True}}, r"model.layers=True; expected an integer"),
    ({"model": {"layers": 10**400}}, r"model.layers=1000.*\.\.\.; expected an integer from 1 to 9,007,199,254,740,992"),
    ({"seqs": [128, "256"]}, r"seqs=\[128, '256'\]; expected a non-empty list of integers"),
    ({"seqs": [0]}, r"seqs=\[0\]; expected a non-empty list"),
    ({"seqs": 128}, r"seqs=128; expected a non-empty list"),
    ({"tables": ["timings.csv"]}, r"tables=\['timings.csv'\]; expected a mapping of table names"),
    ({"tables": {"timings": 3, "memory": "memory.csv"}}, r"tables.timings=3; expected a file name"),
    ({"tables": {"timings": "../timings.csv", "memory": "memory.csv"}}, r"tables.timings='../timings.csv'"),
    ({"tables": {"timings": "/etc/passwd", "memory": "memory.csv"}}, r"tables.timings='/etc/passwd'"),
    ({"precision": 16}, r"precision=16; expected one of bf16, fp16, fp32"),
    ({"schema_version": True}, r"schema_version=True; expected 1"),
])
def test_malformed_metadata_names_the_key(tmp_path: Path, changes: dict, expected: str) -> None:
    """A wrong type, a missing part or an out-of-range value in profile.json is refused at load, naming the key."""
    folder = csv_profile(tmp_path)
    set_meta(folder, **changes)
    assert re.search(expected, load_error(folder))


@pytest.mark.parametrize(("text", "expected"), [
    ("[1, 2]", "a JSON list; expected a JSON object"),
    ('{"schema_version": NaN}', "number NaN is not a finite float"),
    ('{"schema_version": 1, "model": {"layers": 1e400}}', "number 1e400 is not a finite float"),
    ("[" * 100_000 + "]" * 100_000, "unreadable (RecursionError"),
    ('{"schema_version": 1' + "0" * 5000 + "}", "unreadable (ValueError: Exceeds the limit"),
    ("{", "unreadable (JSONDecodeError"),
])
def test_metadata_that_is_not_a_json_object_is_one_line(tmp_path: Path, text: str, expected: str) -> None:
    folder = csv_profile(tmp_path)
    set_meta(folder, text)
    assert expected in load_error(folder)


def test_undecodable_metadata_names_the_file(tmp_path: Path) -> None:
    folder = csv_profile(tmp_path)
    (folder / "profile.json").write_bytes(b"\xff\xfe{\x00")
    assert "profile.json: unreadable (UnicodeDecodeError" in load_error(folder)


def test_malformed_comms_metadata_is_refused(tmp_path: Path) -> None:
    folder = csv_profile(tmp_path)
    set_meta(folder, name="comms.json", tables="comms_fit.parquet")
    assert "comms.json: tables='comms_fit.parquet'; expected a mapping" in load_error(folder)


# ---------------------------------------------------------------- table cells


@pytest.mark.parametrize(("table", "column", "value", "expected"), [
    ("timings", "median_ns", "nan", "column 'median_ns' row 1: nan; expected a time in ns from 0 to 1e+15"),
    ("timings", "median_ns", "inf", "column 'median_ns' row 1: inf"),
    ("timings", "median_ns", "abc", "column 'median_ns' row 1: 'abc'"),
    ("timings", "median_ns", -5, "column 'median_ns' row 1: -5"),
    ("timings", "median_ns", 1e300, "column 'median_ns' row 1: 1e+300"),
    ("timings", "p90_ns", "", "column 'p90_ns' row 1: nan"),
    ("timings", "microbatch_size", 0, "column 'microbatch_size' row 1: 0; expected a measured size"),
    ("timings", "seq", -128, "column 'seq' row 1: -128"),
    ("timings", "seq", 128.5, "column 'seq' row 1: 128.5"),
    ("timings", "shards", 0, "column 'shards' row 1: 0; expected a whole number from 1"),
    ("timings", "params", "9" * 400, "column 'params' row 1: 999"),
    ("timings", "op", "X", "column 'op' row 1: 'X'; expected one of F, I, W, B, R, S, T, S2, T2, step"),
    ("timings", "component", "", "column 'component' row 1: nan; expected one of layer"),
    ("memory", "activation_bytes", "nan", "column 'activation_bytes' row 1: nan; expected a number of bytes"),
    ("memory", "boundary_bytes", -1, "column 'boundary_bytes' row 1: -1"),
    ("memory", "microbatch_size", 0, "column 'microbatch_size' row 1: 0"),
    ("memory", "params", "True", "column 'params' row 1: 'True'"),
])
def test_bad_cell_names_file_column_row_and_value(tmp_path: Path, table: str, column: str, value: object,
                                                  expected: str) -> None:
    """Non-numbers, NaN, infinity, negatives, fractions where a count is read, and out-of-range values."""
    folder = csv_profile(tmp_path)
    set_cell(folder, table, column, value)
    message = load_error(folder)
    assert f"{table}.csv: {expected}" in message


def test_nan_median_is_refused_not_zero_time(tmp_path: Path) -> None:
    """Every layer F median NaN used to make the op 0 ns (and the run 100% bubble); now the load fails."""
    folder = csv_profile(tmp_path)
    path = folder / "timings.csv"
    frame = pd.read_csv(path)
    frame.loc[frame["op"] == "F", "median_ns"] = float("nan")
    frame.to_csv(path, index=False)
    assert "column 'median_ns' row 1: nan" in load_error(folder)


def test_single_measured_size_of_zero_is_refused(tmp_path: Path) -> None:
    """One measured microbatch size of 0 divided by zero in interp1's proportional case."""
    folder = csv_profile(tmp_path, mbs=(2,))
    path = folder / "timings.csv"
    frame = pd.read_csv(path)
    frame.loc[frame["component"] != "optimizer", "microbatch_size"] = 0
    frame.to_csv(path, index=False)
    assert "column 'microbatch_size' row 1: 0" in load_error(folder)


def test_op_times_beyond_the_cost_bound_are_refused_at_load(tmp_path: Path) -> None:
    """Each cell is in range (1e5 s), but 20 layers of it exceed MAX_OP_SECONDS: refused at load, not in the run."""
    folder = csv_profile(tmp_path)
    path = folder / "timings.csv"
    frame = pd.read_csv(path)
    frame.loc[frame["component"] == "layer", "median_ns"] = 1e14
    frame.to_csv(path, index=False)
    message = load_error(folder, layers=20)
    assert "timings.csv: the forward of stage 0 of 1 would take 2e+06 s (20 layers" in message
    assert f"expected at most {MAX_OP_SECONDS:g} s per op" in message


def test_extrapolation_beyond_the_cost_bound_is_refused_at_load(tmp_path: Path) -> None:
    """A microbatch size far beyond the measured ones extrapolates past MAX_OP_SECONDS: refused at load."""
    assert "would take" in load_error(csv_profile(tmp_path), microbatch_size=2**50)


def test_huge_byte_counts_are_refused_at_load(tmp_path: Path) -> None:
    """Activation bytes that would overflow the memory ledger's int64 sums name the memory table."""
    folder = csv_profile(tmp_path)
    path = folder / "memory.csv"
    frame = pd.read_csv(path)
    frame["activation_bytes"] = MAX_BYTES
    frame.to_csv(path, index=False)
    assert "memory.csv: activation_bytes of the whole model would be" in load_error(folder)


def test_missing_op_is_refused_at_load_not_mid_run(tmp_path: Path) -> None:
    folder = csv_profile(tmp_path)
    path = folder / "timings.csv"
    frame = pd.read_csv(path)
    frame[~((frame["component"] == "layer") & (frame["op"] == "R"))].to_csv(path, index=False)
    assert "timings.csv: no row with component='layer' op='R' shards=1" in load_error(folder)


def test_sub_nanosecond_times_are_kept_at_the_clock_resolution(tmp_path: Path) -> None:
    """A measured time under 0.5 ns is kept, and costs.seconds_to_ns makes it 1 ns (profiles/README.md)."""
    folder = csv_profile(tmp_path)
    path = folder / "timings.csv"
    frame = pd.read_csv(path)
    frame["median_ns"] = 0.1
    frame.to_csv(path, index=False)
    assert ProfiledCosts.load(folder, 2, layers=1).stage_cost(0, 1, 1).forward_ns == 1


# ---------------------------------------------------------------- comms fit


@pytest.mark.parametrize(("column", "value", "expected"), [
    ("bandwidth", 0.0, "column 'bandwidth' row 1: 0.0; expected a bandwidth in bytes/s above 0"),
    ("bandwidth", -1e9, "column 'bandwidth' row 1: -1000000000.0"),
    ("bandwidth", float("nan"), "column 'bandwidth' row 1: nan"),
    ("bandwidth", float("inf"), "column 'bandwidth' row 1: inf"),
    ("bandwidth", 1e-3, "row 1: p2p latency_ns=10000, bandwidth=0.001 would move 1073741824 bytes in"),
    ("latency_ns", 1e20, "column 'latency_ns' row 1: 1e+20"),
    ("latency_ns", -1.0, "column 'latency_ns' row 1: -1.0"),
    ("lo_bytes", "small", "column 'lo_bytes' row 1: 'small'"),
])
def test_bad_comms_fit_is_refused(tmp_path: Path, column: str, value: object, expected: str) -> None:
    """A zero, negative, non-finite or absurdly small bandwidth, or a bad latency, names the comms fit file."""
    folder = csv_profile(tmp_path)
    set_cell(folder, "comms_fit", column, value)
    assert f"comms_fit.parquet: {expected}" in load_error(folder)


def test_good_comms_fit_times_realistic_transfers(tmp_path: Path) -> None:
    costs = ProfiledCosts.load(csv_profile(tmp_path), 2)
    assert link_transfer_ns(1 << 30, costs.p2p_link(1 << 30)) == 50_000 + math.ceil((1 << 30) / 10)


# ---------------------------------------------------------------- files pandas cannot parse


def test_unparseable_csv_names_the_file(tmp_path: Path) -> None:
    folder = csv_profile(tmp_path)
    (folder / "timings.csv").write_bytes(b"component,op\n\xff\xfe\x00,\"unterminated\n")
    assert "timings.csv: unreadable as CSV (" in load_error(folder)


def test_empty_csv_names_the_file(tmp_path: Path) -> None:
    folder = csv_profile(tmp_path)
    (folder / "memory.csv").write_text("")
    assert "memory.csv: unreadable as CSV (EmptyDataError" in load_error(folder)


def test_file_that_is_not_parquet_names_the_file(tmp_path: Path) -> None:
    folder = make_profile(tmp_path, parquet=True)
    (folder / "timings.parquet").write_text("component,op\nlayer,F\n")
    assert "timings.parquet: unreadable as Parquet (" in load_error(folder)


def test_oversized_table_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipescope.simulator.readers import profile_schema
    monkeypatch.setattr(profile_schema, "MAX_TABLE_BYTES", 100)
    assert "bytes; expected a 'timings' table of at most 100 bytes" in load_error(csv_profile(tmp_path))


# ---------------------------------------------------------------- tables that cost far more than their bytes


def with_column(folder: Path, name: str, column: pa.Array, **write: object) -> None:
    """Put ``column`` in place of (or beside) ``name`` in the timings Parquet. store_schema=False: the reader is
    not told that a dictionary column was one, as a file written by another tool would not say."""
    path = folder / "timings.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index(name)
    table = table.set_column(index, name, column) if index >= 0 else table.append_column(name, column)
    pq.write_table(table, path, store_schema=False, **write)


def repeated(word: str, rows: int) -> pa.DictionaryArray:
    """``word`` in every row, as Parquet stores it: once, and an index a row."""
    return pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([word]))


def peak_arrow_bytes(code: str) -> int:
    """The most memory pyarrow held while a fresh interpreter ran ``code`` (its pool's peak, no other test's)."""
    script = f"{code}\nimport pyarrow\nprint(pyarrow.default_memory_pool().max_memory())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


def test_a_column_the_reader_ignores_is_never_unpacked(tmp_path: Path) -> None:
    """37 rows of a 50 MiB word in an extra column (10.8 KB of Parquet) made simulate take 4.6 GB: every column
    was read. Only the rule columns are read now, and the costs are the plain profile's."""
    folder = make_profile(tmp_path / "junk")
    word = 4 << 20
    with_column(folder, "junk", repeated("x" * word, len(timing_rows((2, 4), (128,)))), compression="zstd")
    assert (folder / "timings.parquet").stat().st_size < 10_000
    assert peak_arrow_bytes(f"from pipescope.simulator.profiled import ProfiledCosts\n"
                            f"ProfiledCosts.load({str(folder)!r}, 2)") < word  # was 35 rows x 4 MiB
    plain = ProfiledCosts.load(make_profile(tmp_path / "plain"), 2).stage_cost(0, 2, 1)
    assert ProfiledCosts.load(folder, 2).stage_cost(0, 2, 1) == plain


def test_a_long_word_in_every_row_of_a_rule_column_is_held_once(tmp_path: Path) -> None:
    """The same word in the component column: read dictionary-encoded and checked through its one copy, refused
    naming the cell, with Python holding about one copy of the word (not one a row)."""
    folder = make_profile(tmp_path)
    word = 4 << 20
    with_column(folder, "component", repeated("x" * word, len(timing_rows((2, 4), (128,)))), compression="zstd")
    tracemalloc.start()
    try:
        message = load_error(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "timings.parquet: column 'component' row 1: 'xxxx" in message and "expected one of layer" in message
    assert peak < 4 * word  # was 35 copies


@pytest.mark.parametrize(("column", "expected"), [
    (pa.array(["x" * 65536] * 35), "timings.parquet: it unpacks to 2,29"),  # plain: 35 x 64 KiB > 1 MiB
    (pa.array([[1.0]] * 35), "timings.parquet: column 'median_ns' holds 'list<element: double>'; expected a number"),
])
def test_a_parquet_table_is_bounded_from_its_footer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    column: pa.Array, expected: str) -> None:
    """Before a row is read: the rule columns' unpacked size from the footer (bounded at 1 MiB here), and no nested
    cells (their words would be decoded once a row: only flat columns are read dictionary-encoded)."""
    from pipescope.simulator.readers import profile_schema
    monkeypatch.setattr(profile_schema, "MAX_TABLE_UNPACKED_BYTES", 1 << 20)
    folder = make_profile(tmp_path)
    with_column(folder, "component" if pa.types.is_string(column.type) else "median_ns", column,
                compression="zstd", use_dictionary=False)
    assert expected in load_error(folder)


@pytest.mark.parametrize(("extra", "expected"), [
    ("".join(f",c{i}" for i in range(9_989)), "its header has 10,001 comma-separated names, expected at most 10,000 "
                                               "columns"),  # 12 of the profile's
    (',"a\nb"' + "".join(f",c{i}" for i in range(9_988)), "its header has 10,001 comma-separated names"),
    ("," + "x" * (1 << 20), "its header (the first line) is over 1,048,576 bytes, expected at most 10,000"),
])
def test_a_csv_header_is_bounded_before_pandas_reads_it(tmp_path: Path, extra: str, expected: str) -> None:
    """12.4 MB of header naming 1.5 million extra columns took 69 s and 7.6 GB before failing. The first record is
    bounded first, a quoted line break included (pandas reads the next line as part of the header)."""
    folder = csv_profile(tmp_path)
    path = folder / "timings.csv"
    header, rows = path.read_text().split("\n", 1)
    path.write_text(header + extra + "\n" + rows)
    assert f"timings.csv: {expected}" in load_error(folder)


# ---------------------------------------------------------------- property: any corruption, one line or a good run

GOOD_FIT = [{"collective": "p2p", "world_size": 2, "lo_bytes": 1 << 15, "hi_bytes": 1 << 19, "latency_ns": 10_000.0,
             "bandwidth": 1e9, "points": 5},
            {"collective": "p2p", "world_size": 2, "lo_bytes": 1 << 20, "hi_bytes": 1 << 30, "latency_ns": 5e4,
             "bandwidth": 1e10, "points": 10}]
HOSTILE = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), -1, 0, 1, 2, 10**400, 2**63, 2**53 + 1, 1e308,
                     -1e-300, 0.4, 1.5, "abc", "", "1e400", "nan", None, True, False, [], {}, [0], {"a": 1}]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
)
META_KEYS = [("model",), ("model", "layers"), ("model", "seq"), ("seqs",), ("microbatch_sizes",), ("precision",),
             ("tables",), ("tables", "timings"), ("tables", "memory"), ("schema_version",), ("vocab_shards",)]
TABLES = {"timings": timing_rows((2, 4), (128,)), "memory": memory_rows((2, 4), (128,)), "comms_fit": GOOD_FIT}


@st.composite
def corruptions(draw: st.DrawFn) -> list[tuple]:
    """A few edits: ("meta", key path, value or DELETE) or (table, row, column, value or DELETE)."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        value = draw(st.one_of(HOSTILE, st.just("<delete>")))
        if draw(st.booleans()):
            edits.append(("meta", draw(st.sampled_from(META_KEYS)), value))
        else:
            table = draw(st.sampled_from(sorted(TABLES)))
            row = draw(st.integers(0, len(TABLES[table]) - 1))
            column = draw(st.sampled_from(sorted(TABLES[table][0])))
            edits.append((table, row, column, value))
    return edits


def write_corrupted(folder: Path, edits: list[tuple]) -> None:
    tables = {name: [dict(row) for row in rows] for name, rows in TABLES.items()}
    meta = {"schema_version": SCHEMA_VERSION, "kind": "compute", "precision": "bf16",
            "model": dict(MODEL), "seqs": [128], "microbatch_sizes": [2, 4],
            "tables": {"timings": "timings.csv", "memory": "memory.csv"}}
    for edit in edits:
        if edit[0] == "meta":
            *parents, key = edit[1]
            node = meta
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                if edit[2] == "<delete>":
                    node.pop(key, None)
                else:  # a copy: hypothesis hands the same {} to two edits, which would nest it in itself
                    node[key] = copy.deepcopy(edit[2])
        else:
            table, row, column, value = edit
            if value == "<delete>":
                for r in tables[table]:
                    r.pop(column, None)
            else:
                tables[table][row][column] = copy.deepcopy(value)
    for name in ("timings", "memory"):
        write_table(folder, name, tables[name], parquet=False)
    (folder / "profile.json").write_text(json.dumps(meta, default=str))
    write_json(folder / "comms.json", {"schema_version": SCHEMA_VERSION, "kind": "comms",
                                       "tables": {"comms_fit": write_table(folder, "comms_fit", tables["comms_fit"],
                                                                           parquet=False)}})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=corruptions(), microbatch_size=st.sampled_from([1, 2, 3, 8]))
def test_any_corruption_loads_cleanly_or_fails_in_one_line(edits: list[tuple], microbatch_size: int) -> None:
    """Load, then every stage cost of several splits and the p2p link: int64-safe non-negative integers, or one
    ProfileError/ValueError line naming the profile; never another exception."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_corrupted(folder, edits)
        try:
            costs = ProfiledCosts.load(folder, microbatch_size)
            for stages in (1, 2, 3, 5):
                for stage in range(stages):
                    cost = costs.stage_cost(stage, stages, 1)
                    for name, value in vars(cost).items():
                        if value is None and name in ("backward_ns", "rebuilt_bytes"):  # unmeasured: I + W, M_B
                            continue
                        if name == "units":  # FSDP's units: analytic costs only
                            assert value == ()
                            continue
                        assert isinstance(value, int) and 0 <= value < 2**63, cost
            for nbytes in (0, 1, 4096, cost.boundary_bytes, 1 << 30):
                link = costs.p2p_link(nbytes)
                if link is not None:
                    assert 0 <= link_transfer_ns(nbytes, link) < 2**63
        except ValueError as exc:
            message = str(exc)
            assert "\n" not in message and str(folder) in message, message


# ---------------------------------------------------------------- calibrate and calibrate-comms flags


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, list[str]]:
    code = commands.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("flags", "expected"), [
    (["--rel-tol", "nan"], "--rel-tol: got 'nan', expected a number above 0 and at most 1"),
    (["--rel-tol", "0"], "--rel-tol: got 0.0, expected a number above 0"),
    (["--budget-s", "nan"], "--budget-s: got 'nan', expected a number above 0 and at most 86400"),
    (["--budget-s", "inf"], "--budget-s: got 'inf', expected a number"),
    (["--budget-s", "1e999"], "--budget-s: got '1e999', expected a number"),
    (["--budget-s", "1e9"], "--budget-s: got 1000000000.0, expected a number above 0 and at most 86400"),
    (["--budget-s", "1_0"], "--budget-s: got '1_0', expected a number"),
    (["--layers", "1_6"], "--layers: got '1_6', expected an integer from 1 to 2,147,483,647"),
    (["--hidden", " 8 "], "--hidden: got ' 8 ', expected an integer from 1 to 2,147,483,647"),
    (["--vocab", "0x4"], "--vocab: got '0x4', expected an integer"),
    (["--heads", "1e3"], "--heads: got '1e3', expected an integer"),
    (["--layers", "9" * 5000], "--layers: got '" + "9" * 39 + "..., expected an integer"),
    (["--layers", "4294967296"], "--layers: got 4294967296, expected an integer from 1 to 2,147,483,647"),
    (["--seq", "1_024"], "--seq: got '1_024', expected comma-separated positive integers"),
    (["--microbatch-sizes", "1, 2"], "--microbatch-sizes: got '1, 2', expected comma-separated positive integers"),
    (["--microbatch-sizes", "1,,2"], "--microbatch-sizes: got '1,,2', expected comma-separated positive integers"),
    (["--microbatch-sizes", "2,2"], "--microbatch-sizes: got '2,2', expected comma-separated positive integers"),
    (["--microbatch-sizes", "1,99999999999"], "--microbatch-sizes: got '1,99999999999', expected comma-separated"),
    (["--warmup", "-1"], "--warmup: got -1, expected an integer from 0 to 10,000"),
    (["--warmup", "100000000000000000000"], "--warmup: got '100000000000000000000', expected an integer from 0"),
    (["--min-reps", "1000000"], "--min-reps: got 1000000, expected an integer from 1 to 100,000"),
    (["--max-reps", "3", "--min-reps", "5"], "--max-reps: got 3, expected at least --min-reps 5"),
    (["--vocab-shards", "100000"], "--vocab-shards: got 100000, expected an integer from 1 to 1,024"),
    (["--vocab-shards", "0"], "--vocab-shards: got 0, expected an integer from 1 to 1,024"),
    (["--threads", "100000"], "--threads: got 100000, expected an integer from 1 to"),
    (["--device", "cuda:\u0663"], "--device: got 'cuda:\u0663', expected cuda, cuda:N or cpu"),
])
def test_bad_calibrate_flag_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                        expected: str) -> None:
    """NaN, infinity, non-decimal integers and values out of each flag's range exit 2 with one line."""
    code, err = run_cli(["calibrate", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path), *flags], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"pipescope: error: {expected}"), err


def test_model_too_big_for_the_machine_is_refused_before_allocating(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A hidden size needing terabytes is a one-line error naming --hidden, not a torch out-of-memory traceback."""
    pytest.importorskip("torch")
    code, err = run_cli(["calibrate", "--model", "tiny", "--hidden", "10000000", "--device", "cpu",
                         "--out", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("pipescope: error: --hidden: got 10000000, expected a model that fits: hidden 10000000")


def test_memory_bound_names_the_dominant_flag() -> None:
    """check_fits (no torch): weights name --hidden, the vocabulary --vocab, the logits --microbatch-sizes."""
    memory = 16 << 30
    for shape, microbatch, flag in ((resolve("tiny", hidden=100_000), 1, "--hidden"),
                                    (resolve("tiny", vocab=MAX_INT), 1, "--vocab"),
                                    (resolve("tiny", seq=1 << 20), 4096, "--microbatch-sizes")):
        with pytest.raises(commands.UsageError, match=f"^{flag}: "):
            commands.check_fits(shape, microbatch, shape.seq, "bf16", "cpu", memory)
    for preset in HARNESS_PRESETS.values():  # every preset the harness builds fits an 80 GB GPU at microbatch 8
        commands.check_fits(preset, 8, preset.seq, "bf16", "cuda", 80 << 30)


def test_impossible_shape_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(["calibrate", "--layers", "2", "--hidden", "64", "--heads", "3", "--seq", "8", "--vocab", "16",
                         "--out", str(tmp_path)], capsys)
    assert code == 2 and err == ["pipescope: error: --heads: got 3, expected a divisor of --hidden 64"]


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--min-bytes", "1e400"], "--min-bytes: got '1e400', expected a size from 4 to 1099511627776 bytes"),
    (["--max-bytes", "1e999999999"], "--max-bytes: got '1e999999999', expected a size from 4 to"),
    (["--min-bytes", "1e-999999999"], "--min-bytes: got '1e-999999999', expected a size from 4 to"),
    (["--min-bytes", "1" * 100], "--min-bytes: got '" + "1" * 39 + "..., expected a size from 4"),
    (["--max-bytes", "2TiB"], "--max-bytes: got '2TiB', expected a size from 4 to"),
    (["--min-bytes", "2"], "--min-bytes: got '2', expected a size from 4"),
    (["--min-bytes", "1MiB", "--max-bytes", "1KiB"], "--min-bytes: got '1MiB', expected at least 4 bytes and at most"),
    (["--min-bytes", "nan"], "--min-bytes: got 'nan', expected a size"),
    (["--range-edges", ","], "--range-edges: got ',', expected 1 to 16 positive sizes"),
    (["--range-edges", "0"], "--range-edges: got '0', expected a size from 1"),
    (["--rel-tol", "nan"], "--rel-tol: got 'nan', expected a number"),
    (["--budget-s", "inf"], "--budget-s: got 'inf', expected a number"),
    (["--min-reps", "0x4"], "--min-reps: got '0x4', expected an integer"),
])
def test_bad_calibrate_comms_flag_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, torchrun_env: None,
                                              flags: list[str], expected: str) -> None:
    code, err = run_cli(["calibrate-comms", "--out", str(tmp_path), *flags], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"pipescope: error: {expected}"), err


def test_bad_torchrun_environment_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, torchrun_env: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    code, err = run_cli(["calibrate-comms", "--out", str(tmp_path)], capsys)
    assert code == 2 and err == ["pipescope: error: RANK: got 2, expected an integer from 0 to 1"]


# ---------------------------------------------------------------- no torch


@pytest.mark.parametrize("entry", ["commands", "cli"])
def test_calibrate_without_torch_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch, entry: str) -> None:
    """With torch unimportable, calibrate (standalone or through the pipescope CLI) prints one line with the pip
    command instead of a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)
    argv = ["calibrate", "--model", "tiny", "--out", str(tmp_path)]
    if entry == "cli":
        from pipescope.experiments.cli import main
        code = main(argv)
    else:
        code = commands.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["pipescope: error: calibrate needs torch: pip install 'pipescope[calibration]'"]


def test_calibrate_comms_without_torch_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch, torchrun_env: None) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    code, err = run_cli(["calibrate-comms", "--out", str(tmp_path)], capsys)
    assert code == 2 and err == ["pipescope: error: calibrate-comms needs torch: pip install 'pipescope[calibration]'"]


def test_a_key_given_twice_in_profile_metadata_is_refused(tmp_path: Path) -> None:
    """json keeps the last of two equal keys silently; a profile's metadata must not change meaning that way."""
    from pipescope.simulator.readers.profile_schema import ProfileError, read_metadata
    (tmp_path / "profile.json").write_text('{"schema_version": 1, "precision": "fp32", "precision": "bf16"}')
    with pytest.raises(ProfileError, match="key 'precision' appears twice"):
        read_metadata(tmp_path)


@pytest.mark.parametrize(("change", "expected"), [
    ({"seqs": [64]}, r"timings.csv: no layer row with seq=64, which profile.json's seqs lists; expected the sequence "
                     r"lengths the tables hold \(\[128\]\)"),
    ({"kind": "comms"}, r"profile.json: kind='comms'; expected 'compute'"),
])
def test_metadata_that_contradicts_the_profile_is_refused(tmp_path: Path, change: dict, expected: str) -> None:
    folder = csv_profile(tmp_path)
    set_meta(folder, **change)
    assert re.search(expected, load_error(folder))


@pytest.mark.parametrize(("table", "row", "expected"), [
    ("timings", 1, r"timings.csv: row 2: component=layer, op=I, microbatch_size=2, seq=128, shards=1 is measured "
                   r"twice \(also row 1\); expected one row per point"),
    ("memory", 0, r"memory.csv: row 2: component=layer, microbatch_size=2, seq=128 is measured twice \(also row 1\)"),
])
def test_a_point_measured_twice_is_refused(tmp_path: Path, table: str, row: int, expected: str) -> None:
    """A second row for one point would be read instead of the first, silently: which one is the measurement?"""
    folder = csv_profile(tmp_path)
    path = folder / f"{table}.csv"
    frame = pd.read_csv(path)
    frame.loc[row - 1 if row else 1] = frame.loc[row]  # the row before (or after) becomes a copy of it
    frame.to_csv(path, index=False)
    assert re.search(expected, load_error(folder))


def edit_table(folder: Path, table: str, edit: object) -> None:
    """Rewrite a CSV table as ``edit(frame)`` returns it."""
    path = folder / f"{table}.csv"
    edit(pd.read_csv(path)).to_csv(path, index=False)


def second_row(frame: pd.DataFrame, where: pd.Series, **changes: object) -> pd.DataFrame:
    """``frame`` with the first row ``where`` selects appended again, with ``changes``."""
    return pd.concat([frame, frame[where].head(1).assign(**changes)], ignore_index=True)


@pytest.mark.parametrize(("select", "changes", "expected"), [
    (lambda f: (f["component"] == "layer") & (f["op"] == "F"), {"params": 1, "median_ns": 1e12},
     "timings.csv: row 36: component=layer, op=F, microbatch_size=2, seq=128, shards=1 is measured twice (also "
     "row 1); expected one row per point"),
    (lambda f: f["component"] == "output_shard", {"tensors": 5, "median_ns": 1e12},
     "row 36: component=output_shard, op=S, microbatch_size=2, seq=128, shards=1 is measured twice (also row 13)"),
    (lambda f: f["component"] == "optimizer", {"component": "layer", "microbatch_size": 2, "seq": 128},
     "row 36: op=step, params=100, tensors=2 is measured twice (also row 33)"),
])
def test_rows_a_lookup_would_average_are_refused(tmp_path: Path, select: object, changes: dict,
                                                  expected: str) -> None:
    """A second row for a lookup's point that differs elsewhere (params, tensors) was averaged in: a layer F of
    1e12 ns beside the measured one made the iteration 5500 s instead of 0.0076 s. A second optimizer step of the
    same parameters and tensors would be fitted twice, whatever its component."""
    folder = csv_profile(tmp_path)
    edit_table(folder, "timings", lambda frame: second_row(frame, select(frame), **changes))
    assert expected in load_error(folder)


@pytest.mark.parametrize("column", ["params", "tensors"])
def test_a_component_with_two_parameter_counts_is_refused(tmp_path: Path, column: str) -> None:
    """params_of and tensors_of read a component's first memory row: a contradicting later one was ignored."""
    folder = csv_profile(tmp_path)
    edit_table(folder, "memory", lambda frame: frame.assign(**{column: frame[column].mask(frame.index == 1, 10**15)}))
    first = {"params": 700, "tensors": 2}[column]  # memory_rows' layer
    assert (f"memory.csv: row 2: component=layer {column}=1e+15, but row 1 says {first}; expected one {column} "
            "count per component") in load_error(folder)


@pytest.mark.parametrize(("table", "column", "measured"), [
    ("timings", "median_ns", "timings.csv: component=layer op=F median_ns at seq 128 at microbatch size 8: the "
                             "line through the measured points (2: 1200, 4: 600) falls as the work grows, so the "
                             "nearest measurement is held"),
    ("memory", "activation_bytes", "memory.csv: component=layer activation_bytes at seq 128 at microbatch size 8: the "
                                   "line through the measured points (2: 256000, 4: 128000) falls as the work grows"),
])
def test_an_extrapolation_that_falls_is_held_at_the_nearest_point(tmp_path: Path, table: str, column: str,
                                                                      measured: str) -> None:
    """A microbatch-4 time (or stash) half the microbatch-2 one extrapolated to 0 at microbatch 8 and was clamped
    there, with only the general note: a free op. Now it is the microbatch-4 value, held, with a note naming the
    op; a value measured 0 at every size stays 0."""
    folder = csv_profile(tmp_path)
    layer_f = {"timings": lambda f: (f["component"] == "layer") & (f["op"] == "F"),
               "memory": lambda f: f["component"] == "layer"}[table]

    def halve(frame: pd.DataFrame) -> pd.DataFrame:  # microbatch 4's value: half of microbatch 2's
        rows = layer_f(frame)
        frame.loc[rows & (frame["microbatch_size"] == 4), column] = \
            frame.loc[rows & (frame["microbatch_size"] == 2), column].to_numpy() // 2
        return frame

    def value(costs: ProfiledCosts) -> float:
        return costs.time_ns("layer", "F") if table == "timings" else costs.bytes_of("layer", column)

    edit_table(folder, table, halve)
    costs = ProfiledCosts.load(folder, 8)
    at_4 = {"timings": 600, "memory": 128000}[table]
    assert value(costs) == at_4
    assert any(measured in note and "calibrate at microbatch size 8" in note for note in costs.notes())
    edit_table(folder, table, lambda frame: frame.assign(**{column: frame[column].mask(layer_f(frame), 0)}))
    zeros = ProfiledCosts.load(folder, 8)
    assert value(zeros) == 0 and not any("line through the measured points" in note for note in zeros.notes())


@pytest.mark.parametrize(("model", "expected"), [
    ({}, r"has no model.layers in its profile.json; expected the model the profile measured \(pipescope calibrate "
         r"writes it\), or set model.layers"),
    ({"layers": 5}, r"has no model.hidden in its profile.json"),
    ({**MODEL, "layers": 100_001}, r"measured model.layers=100001; expected 1 to 100,000"),
    ({**MODEL, "heads": 3}, r"model.heads: got 3, expected a divisor of model.hidden \(=2048\)"),
])
def test_a_profile_whose_model_the_run_would_guess_or_cannot_take_is_refused(tmp_path: Path, model: dict,
                                                                             expected: str) -> None:
    """The profile's model is the run's: without its shape the default preset's would stand in, silently; beyond
    the config's own limits, or with heads not dividing hidden, it is refused as a config key would be."""
    from pipescope import Config, ConfigError, ScheduleConfig, run
    from pipescope.simulator.profiled import ProfiledCostsConfig
    folder = csv_profile(tmp_path)
    set_meta(folder, model=model)
    config = Config(schedule=ScheduleConfig("1f1b", stages=1, microbatches=2),
                    costs=ProfiledCostsConfig(profile=str(folder)))
    with pytest.raises(ConfigError) as info:
        run(config)
    assert "\n" not in str(info.value) and re.search(expected, str(info.value)) and str(folder) in str(info.value)
