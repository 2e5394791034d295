"""Sizes with units (simulator/readers/units.py): one parser for config files and the calibration command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipescope.calibration import commands
from pipescope.calibration.args import UsageError, size_arg
from pipescope.simulator.readers.units import parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("1gib", 2**30), ("1GiB", 2**30), ("1TiB", 2**40), ("1tb", 10**12), ("1PiB", 2**50), ("2pb", 2 * 10**15),
    ("1e3", 1000), ("512MB", 512 * 10**6),
    ("32KiB", 32 * 1024), ("1.5KiB", 1536), ("0.1KB", 100), (" 4 kb ", 4000), ("0", 0), (4096, 4096), (2.0**30, 2**30),
])
def test_sizes_are_exact_and_units_any_case(text: object, expected: int) -> None:
    """Units in any case; exponents and fractions are fine when the bytes come out whole (exact arithmetic)."""
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("1XB", "got '1XB': unknown unit 'XB', expected one of B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB (any case)"),
    ("1Gbit", "got '1Gbit': unknown unit 'Gbit', expected one of"),
    ("abc", "got 'abc', expected a size such as '16GiB' or '512MB'"),
    ("-1GB", "got '-1GB', expected a non-negative size"),
    (-3, "got -3, expected a non-negative size"),
    ("1.5B", "got '1.5B', expected a whole number of bytes"),
    (0.5, "got 0.5, expected a whole number of bytes"),
    (float("inf"), "got inf, expected a finite size"),
    (True, "got True, expected a size"),
])
def test_bad_sizes_are_one_line_errors(text: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_calibration_flags_use_the_same_parser() -> None:
    """size_arg is parse_size with the flag in front of the message."""
    for text in ("1gib", "1TiB", "1e3", "512MB", "32KiB"):
        assert size_arg("--min-bytes", text) == parse_size(text)
    with pytest.raises(UsageError, match=r"^--max-bytes: got '1XB': unknown unit 'XB', expected one of B, KB"):
        size_arg("--max-bytes", "1XB")


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--min-bytes", "1.5B", "--min-bytes: got '1.5B', expected a whole number of bytes"),
    ("--max-bytes", "-1GiB", "--max-bytes: got '-1GiB', expected a non-negative size"),
    ("--range-edges", "1MiB,2furlongs", "--range-edges: got '2furlongs': unknown unit 'furlongs', expected one of B"),
])
def test_calibrate_comms_size_flags_report_the_flag(flag: str, value: str, message: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """A bad size on ``calibrate-comms`` exits 2 with one line naming the flag (checked before torch is needed)."""
    for key, env_value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, env_value)
    code = commands.main(["calibrate-comms", "--out", str(tmp_path), "--min-bytes", "32kib", "--max-bytes", "1gib",
                          f"{flag}={value}"])  # '=': argparse would take "-1GiB" for an option
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"pipescope: error: {message}")


def test_times_print_in_the_unit_that_reads_best() -> None:
    """The plan table's iteration column: 47.189 s, not 47189.4ms; down to nanoseconds."""
    from pipescope.simulator.readers.units import format_time

    assert [format_time(t) for t in (203418.5, 3599.0, 47.1894, 1.0, 0.0776, 12e-6, 5e-8)] == [
        "56.505 h", "3599.000 s", "47.189 s", "1.000 s", "77.600 ms", "12.000 us", "50 ns"]
