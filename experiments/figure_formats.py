"""The figure file formats, apart from the plotting modules so that building the CLI's parser (``plot --format``)
does not load matplotlib (0.4 s of every command's start-up)."""

from __future__ import annotations

import os

FORMATS = ("png", "svg", "pdf")


def format_of(path: str, fmt: str | None = None, name: str = "path") -> str:
    """The figure format of a file name: its suffix (any case), which ``fmt``, when given, must equal.

    Raises:
        ValueError: naming ``name`` (the argument or flag) when the suffix is no figure format, or not ``fmt``.
    """
    suffix = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if suffix not in FORMATS:
        raise ValueError(f"{name}: got {path[:200]!r}, expected a file name ending in .png, .svg or .pdf")
    if fmt is not None and fmt != suffix:
        raise ValueError(f"{name}: got {path[:200]!r}, but the format asked for is {fmt}; expected a .{fmt} name")
    return suffix
