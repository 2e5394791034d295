"""Parse times, sizes and bandwidths written with units: ``18.5ms``, ``16GiB``, ``100Gbit/s``.

A bare number is taken in the base unit (seconds, bytes, bytes per second). Errors say what
was given and what is accepted; callers prefix the config key.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from fractions import Fraction

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")

# Signed, so a negative size gets "expected a non-negative size" rather than "expected a size such as ...".
_SIGNED_NUMBER = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

_EXPONENT = re.compile(r"[eE][-+]?0*[0-9]{3,}")
TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_SIZE_UNITS_FOLDED = {unit.lower(): scale for unit, scale in SIZE_UNITS.items()}
BANDWIDTH_UNITS = {"": 1.0, "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
                   "Kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
                   "Gbps": 1e9 / 8, "GiB/s": 2.0**30}
COUNT_UNITS = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}  # B: billion, as tokens go
FLOPS_UNITS = {"": 1.0, "FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15,
               "GFLOPS": 1e9, "TFLOPS": 1e12, "PFLOPS": 1e15}


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages: a hostile value may be megabytes long (the one
    helper for this; csv, profile and calibration messages use it too)."""
    try:
        text = repr(value)
    except ValueError:  # an int over Python's 4,300-digit conversion limit
        text = f"<{type(value).__name__} too long to show>"
    return text if len(text) <= limit else text[:limit] + "..."


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """`` (did you mean zb-v?)`` when ``value`` is close to one of ``choices`` (ignoring case), else ``''``: the end
    of an error message that lists the choices (the one helper for this)."""
    by_folded = {str(choice).lower(): str(choice) for choice in choices}
    close = difflib.get_close_matches(str(value).lower()[:100], list(by_folded), n=1, cutoff=0.6)
    return f" (did you mean {by_folded[close[0]]}?)" if close else ""


def _number_and_unit(value: object, what: str, example: str, pattern: re.Pattern, number: type) -> tuple:
    """(the number as ``number``, the unit text) of a bare number or a string such as ``'18.5ms'``."""
    if isinstance(value, bool):
        raise ValueError(f"got {short_repr(value)}, expected a {what}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"got {short_repr(value)}, expected a finite {what}")
        text, unit = str(value), ""
    else:
        match = pattern.match(str(value)) if len(str(value)) <= 100 else None
        if match is None:
            raise ValueError(f"got {short_repr(value)}, expected a {what} such as {example}")
        text, unit = match.groups()
    try:
        return number(text), unit
    except OverflowError:
        raise ValueError(f"got {short_repr(value)}, expected a finite {what}") from None


def _parse(value: object, units: dict, what: str, example: str) -> float:
    number, unit = _number_and_unit(value, what, example, _NUMBER, float)
    if not math.isfinite(number):
        raise ValueError(f"got {short_repr(value)}, expected a finite {what}")
    if unit not in units:
        known = ", ".join(u for u in units if u)
        raise ValueError(f"got {short_repr(value)}: unknown unit {unit!r}, expected one of {known}")
    if number < 0:
        raise ValueError(f"got {short_repr(value)}, expected a non-negative {what}")
    return number * units[unit]


def parse_time(value: object) -> float:
    """Seconds from ``2``, ``'2s'``, ``'18.5ms'``, ``'600us'``."""
    return _parse(value, TIME_UNITS, "time", "'18.5ms' or 0.5")


def parse_size(value: object) -> int:
    """Bytes from ``'16GiB'``, ``'512MB'``, ``'1e3'`` or a plain number.

    Units are case-insensitive (``'1gib'`` == ``'1GiB'``; there are no bit units, so ``'1Gb'`` is a gigabyte):
    B, KB, MB, GB, TB, PB (powers of 10) and KiB, MiB, GiB, TiB, PiB (powers of 2). The number may be fractional or in
    exponent form as long as the result is a whole number of bytes: ``'1.5KiB'`` is 1536, ``'1.5B'`` is refused.
    The arithmetic is exact (no float rounding), so ``'0.1KB'`` is 100.

    Raises:
        ValueError: one line naming the value and what was expected (a non-negative size with a known unit,
            a whole number of bytes). Callers prefix the key or flag.
    """
    if _EXPONENT.search(str(value)):  # Fraction('1e999999999') would build a billion-digit integer
        raise ValueError(f"got {short_repr(value)}, expected an exponent of at most 2 digits")
    number, unit = _number_and_unit(value, "size", "'16GiB' or '512MB'", _SIGNED_NUMBER, Fraction)
    if unit.lower() not in _SIZE_UNITS_FOLDED:
        known = ", ".join(u for u in SIZE_UNITS if u)
        raise ValueError(f"got {short_repr(value)}: unknown unit {unit!r}, expected one of {known} (any case)")
    if number < 0:
        raise ValueError(f"got {short_repr(value)}, expected a non-negative size")
    size = number * _SIZE_UNITS_FOLDED[unit.lower()]
    if size.denominator != 1:
        raise ValueError(f"got {short_repr(value)}, expected a whole number of bytes")
    return int(size)


def parse_flops(value: object) -> float:
    """FLOP/s from ``'989TFLOP/s'``, ``'2.25PFLOPS'`` or a plain number."""
    return _parse(value, FLOPS_UNITS, "compute rate", "'989TFLOP/s' or '2.25PFLOPS'")


def parse_bandwidth(value: object) -> float:
    """Bytes per second from ``'25GB/s'``, ``'100Gbit/s'`` or a plain number."""
    return _parse(value, BANDWIDTH_UNITS, "bandwidth", "'25GB/s' or '100Gbit/s'")


def parse_count(value: object) -> float:
    """A count written the field's way: ``'1T'`` (10^12), ``'300B'`` (10^9, billion), ``'2.5M'``, ``'15k'``,
    ``2e12``."""
    return _parse(value, COUNT_UNITS, "count", "'1T', '300B' or 2e12")


def format_rate(n: float, suffix: str) -> str:
    """``1 MB/s``, ``1 PB/s``, ``989 TFLOP/s``: a rate with its SI prefix (decimal, as datasheets write rates)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:g} {prefix}{suffix}"
    return f"{n:g} {suffix}"


def format_count(n: float) -> str:
    """``1.23 T``, ``456.7 B``, ``89.0 M``, ``12.3 k``: a count in the unit that reads best (B for billion)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def format_duration(seconds: float) -> str:
    """A long time in the unit that reads best: ``3.2 days``, ``5.1 h``, ``12.0 min``; shorter ones as
    ``format_time``."""
    for unit, scale in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if abs(seconds) >= 2 * scale:
            return f"{seconds / scale:.1f} {unit}"
    return format_time(seconds)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 device``, ``4 devices``: a count with its noun in the number it takes (``plural``: noun + s if None)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def format_bytes(n: float) -> str:
    """``1.50 GiB`` style, for tables and error messages."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_time(seconds: float) -> str:
    """``47.189 s``, ``77.600 ms``, ``12.000 us``: the unit in which the time reads at least 1 (hours from an hour:
    ``56.505 h``, not ``203418.500 s``)."""
    for unit, scale in (("h", 3600.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3f} {unit}"
    return f"{seconds * 1e9:.0f} ns"
