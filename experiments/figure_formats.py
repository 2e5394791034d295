"""The figure file formats, apart from the plotting modules so that building the CLI's parser (``plot --format``)
does not load matplotlib (0.4 s of every command's start-up)."""

from __future__ import annotations

FORMATS = ("png", "svg", "pdf")


def format_of(path: str, default: str = "png") -> str:
    """The figure format a file name asks for by its suffix (any case), else ``default``."""
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else ""
    return suffix if suffix in FORMATS else default
