"""Command-line value checks shared by ``calibrate`` and ``calibrate-comms``: the one-line UsageError, number,
list and size arguments, and the timing flags. Imports no other calibration module but ``timing`` (lazily), so
``commands``, ``comms_args`` and ``comms`` can all import it without a cycle. No torch at import time.

Every value is checked before anything is measured or allocated. Integers are plain decimal (``16``, not
``1_6``, `` 16 ``, ``0x10`` or ``1e1``, which Python's ``int()`` and ``float()`` would accept), numbers are plain
decimals (no ``nan``, ``inf``, ``1_0``), and each flag has a range; the error names the flag, the value and the
range.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any

from pipescope.simulator.readers.units import parse_size, short_repr

INSTALL_HINT = "pip install 'pipescope[calibration]'"
MAX_INT = 2**31 - 1  # no count on these command lines needs more, and every product torch forms stays in int64
MAX_DIGITS = len(str(MAX_INT))
MAX_WARMUP = 10_000
MAX_REPS = 100_000  # min_reps is not bounded by --budget-s, so it needs a bound of its own
MAX_BUDGET_S = 86_400.0  # a day per measured op
MAX_MESSAGE_BYTES = 1 << 40  # calibrate-comms sizes: 1 TiB, beyond any device's memory
MAX_SPREAD = 1000.0  # p90 / median: beyond this no measurement is re-made, so a larger bound means nothing
MAX_RETRIES = 100

_INTEGER = re.compile(r"-?[0-9]+")
_LONG_EXPONENT = re.compile(r"[eE][-+]?[0-9]{3,}")  # 1e999999999 as an exact size would take minutes and gigabytes
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


class UsageError(ValueError):
    """A bad command-line value; the message reads ``<key>: <value>, expected ...``."""


def usage_error(message: str) -> int:
    """Print ``pipescope: error: <message>`` to stderr and return exit code 2."""
    print(f"pipescope: error: {message}", file=sys.stderr)
    return 2


def require_torch(command: str) -> None:
    """UsageError naming the extra to install when torch cannot be imported."""
    try:
        import torch  # noqa: F401 (only probing that it is there)
    except ImportError:
        raise UsageError(f"{command} needs torch: {INSTALL_HINT}") from None


def _plain_int(text: str) -> int | None:
    """``text`` as an int when it is plain decimal of at most MAX_DIGITS digits, else None."""
    if not isinstance(text, str) or not _INTEGER.fullmatch(text) or len(text.lstrip("-")) > MAX_DIGITS:
        return None
    return int(text)


def integer(key: str, text: str, low: int = 1, high: int = MAX_INT) -> int:
    """``text`` as a plain decimal integer from ``low`` to ``high``."""
    value = _plain_int(text)
    if value is None or not low <= value <= high:
        shown = short_repr(text, 40) if value is None else value
        raise UsageError(f"{key}: got {shown}, expected an integer from {low:,} to {high:,}")
    return value


def thread_count(text: str | None, cpus: int) -> int | None:
    """``--threads``: None when not given (calibrate's default: 1 on CPU), 0 for ``auto`` (torch's own choice),
    else an integer from 1 to ``cpus``."""
    if text is None:
        return None
    if text == "auto":
        return 0
    try:
        return integer("--threads", text, 1, cpus)
    except UsageError as exc:
        raise UsageError(f"{exc}, or auto") from None


def optional_int(key: str, text: str | None, low: int = 1, high: int = MAX_INT) -> int | None:
    """``integer``, None passed through."""
    return None if text is None else integer(key, text, low, high)


def int_list(key: str, text: str, example: str = "1,2,4,8", high: int = MAX_INT) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), each a plain decimal from 1 to ``high``, in ascending order; an empty item
    (``1,,2``) or a repeat is refused."""
    expected = f"expected comma-separated positive integers, e.g. {example}"
    values = [_plain_int(v) for v in text.split(",")]
    if not values or None in values or len(set(values)) < len(values):  # an empty item or a repeat is a typo
        raise UsageError(f"{key}: got {short_repr(text, 40)}, {expected}")
    bad = [v for v in values if not 1 <= v <= high]
    if bad:
        raise UsageError(f"{key}: got {bad[0]}, {expected}" + (f" (at most {high})" if bad[0] > 0 else ""))
    return tuple(sorted(set(values)))


def number(key: str, text: str, low: float, high: float) -> float:
    """``text`` as a plain decimal number in (``low``, ``high``]: finite, no ``nan``, ``inf`` or underscores."""
    value = float(text) if isinstance(text, str) and _DECIMAL.fullmatch(text) else None
    if value is None or not math.isfinite(value) or not low < value <= high:
        shown = short_repr(text, 40) if value is None or not math.isfinite(value) else value
        raise UsageError(f"{key}: got {shown}, expected a number above {low:g} and at most {high:g}")
    return value


def size_arg(key: str, text: str, low: int = 1, high: int = MAX_MESSAGE_BYTES) -> int:
    """Bytes from ``"32KiB"``, ``"1GiB"``, ``"512MB"``, ``"1e3"``: the simulator's ``parse_size``, so a size means
    the same in a config file and on the calibration command line; from ``low`` to ``high``. The error names the
    flag."""
    expected = f"expected a size from {low} to {high} bytes (1 TiB)"
    if _LONG_EXPONENT.search(text):
        raise UsageError(f"{key}: got {short_repr(text, 40)}, {expected}")
    try:
        size = parse_size(text)
    except ValueError as exc:  # parse_size says "got <value>, expected ...": the flag goes in front
        raise UsageError(f"{key}: {exc}") from None
    if not low <= size <= high:
        raise UsageError(f"{key}: got {short_repr(text, 40)}, {expected}")
    return size


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


def add_spread_args(parser: argparse.ArgumentParser) -> None:
    """``calibrate``'s flags for re-measuring noisy rows (checked by ``timing_config(..., remeasure=True)``)."""
    group = parser.add_argument_group("noisy machines")
    group.add_argument("--max-spread", type=str, default="2",
                       help="re-measure a row whose p90/median is above this, and warn if it stays so (default 2)")
    group.add_argument("--retries", type=str, default="2",
                       help="re-measurements at most per noisy row (default 2; 0: warn only)")


def spread_values(args: argparse.Namespace) -> dict[str, Any]:
    """``--max-spread`` (above 1, at most MAX_SPREAD) and ``--retries`` (0 to MAX_RETRIES)."""
    return {"max_spread": number("--max-spread", args.max_spread, 1.0, MAX_SPREAD),
            "retries": integer("--retries", args.retries, 0, MAX_RETRIES)}


def timing_config(args: argparse.Namespace, flush_l2: bool = True, command: str = "calibrate",
                  remeasure: bool = False) -> Any:
    """TimingConfig from the shared timing flags, and with ``remeasure`` the ``add_spread_args`` ones (without
    it nothing is re-measured: ``retries`` 0). Checked last of a command's flags: it needs torch (UsageError
    naming the extra to install, for ``command``, when torch is missing)."""
    values = {"warmup": integer("--warmup", args.warmup, 0, MAX_WARMUP),
              "min_reps": integer("--min-reps", args.min_reps, 1, MAX_REPS),
              "max_reps": integer("--max-reps", args.max_reps, 1, MAX_REPS),
              "rel_tol": number("--rel-tol", args.rel_tol, 0.0, 1.0),
              "budget_s": number("--budget-s", args.budget_s, 0.0, MAX_BUDGET_S)}
    if values["max_reps"] < values["min_reps"]:
        raise UsageError(f"--max-reps: got {values['max_reps']}, expected at least --min-reps {values['min_reps']}")
    values.update(spread_values(args) if remeasure else {"retries": 0})
    require_torch(command)
    from pipescope.calibration.timing import TimingConfig

    return TimingConfig(flush_l2=flush_l2, **values)
