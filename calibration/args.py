"""Command-line value checks shared by ``calibrate`` and ``calibrate-comms``: the one-line UsageError, number,
list and size arguments, and the timing flags. Imports no other calibration module but ``timing`` (lazily), so
``commands``, ``comms_args`` and ``comms`` can all import it without a cycle. No torch at import time."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipescope.simulator.units import parse_size


class UsageError(ValueError):
    """A bad command-line value; the message reads ``<key>: <value>, expected ...``."""


def usage_error(message: str) -> int:
    """Print ``pipescope: error: <message>`` to stderr and return exit code 2."""
    print(f"pipescope: error: {message}", file=sys.stderr)
    return 2


def int_list(key: str, text: str, example: str = "1,2,4,8") -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), each positive, in ascending order without repeats."""
    expected = f"expected comma-separated positive integers, e.g. {example}"
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{key}: {text!r}, {expected}") from None
    bad = [v for v in values if v <= 0]
    if not values or bad:
        raise UsageError(f"{key}: {bad[0] if bad else repr(text)}, {expected}")
    return tuple(sorted(set(values)))


def positive(key: str, value: float | None, allow_none: bool = True) -> None:
    """UsageError unless ``value`` is positive (or None, when that is allowed)."""
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise UsageError(f"{key}: {value}, expected a positive number")


def optional_int(key: str, text: str | None) -> int | None:
    """``text`` as an integer, None passed through."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{key}: {text!r}, expected an integer") from None


def number(key: str, text: str) -> float:
    """``text`` as a float."""
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{key}: {text!r}, expected a number") from None


def size_arg(key: str, text: str) -> int:
    """Bytes from ``"32KiB"``, ``"1GiB"``, ``"512MB"``, ``"1e3"``: the simulator's ``parse_size``, so a size means
    the same in a config file and on the calibration command line. The error names the flag."""
    try:
        return parse_size(text)
    except ValueError as exc:
        # parse_size says "got <value>, expected ..."; calibration's messages read "<key>: <value>, expected ...".
        raise UsageError(f"{key}: {str(exc).removeprefix('got ')}") from None


def add_timing_args(parser: argparse.ArgumentParser, budget: float) -> None:
    """The flags every measuring subcommand shares (checked by ``timing_config``, not argparse)."""
    group = parser.add_argument_group("timing")
    group.add_argument("--warmup", type=str, default="3", help="untimed runs first (default 3)")
    group.add_argument("--min-reps", type=str, default="7", help="at least this many timed runs (default 7)")
    group.add_argument("--max-reps", type=str, default="200", help="at most this many timed runs (default 200)")
    group.add_argument("--rel-tol", type=str, default="0.02",
                       help="stop once the median's standard error is below this fraction of it (default 0.02)")
    group.add_argument("--budget-s", type=str, default=str(budget),
                       help=f"wall-time budget per measured op in seconds (default {budget})")


def timing_config(args: argparse.Namespace, flush_l2: bool = True) -> Any:
    """TimingConfig from the shared timing flags (imported lazily: it pulls in torch)."""
    values = {"warmup": optional_int("--warmup", args.warmup), "min_reps": optional_int("--min-reps", args.min_reps),
              "max_reps": optional_int("--max-reps", args.max_reps), "rel_tol": number("--rel-tol", args.rel_tol),
              "budget_s": number("--budget-s", args.budget_s)}
    if values["warmup"] < 0:
        raise UsageError(f"--warmup: {values['warmup']}, expected 0 or more")
    for key in ("min_reps", "max_reps", "rel_tol", "budget_s"):
        positive("--" + key.replace("_", "-"), values[key], allow_none=False)
    if values["max_reps"] < values["min_reps"]:
        raise UsageError(f"--max-reps: {values['max_reps']}, expected at least --min-reps {values['min_reps']}")
    from pipescope.calibration.timing import TimingConfig

    return TimingConfig(flush_l2=flush_l2, **values)
