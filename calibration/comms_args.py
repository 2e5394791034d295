"""Arguments of ``calibrate-comms`` and their validation (no torch here, so a bad value fails fast)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipescope.calibration.args import UsageError, add_timing_args, integer, size_arg, timing_config
from pipescope.simulator.readers.profile_schema import COLLECTIVES

LAUNCH_HINT = "torchrun --nproc-per-node N -m pipescope.calibration.comms --out DIR"
MAX_RANGE_EDGES = 16  # one least-squares fit per range; more ranges than sizes measured fit nothing


@dataclass(frozen=True)
class CommsConfig:
    """One comms calibration: where to write, which sizes and collectives, which backend, how to time."""

    out: Path
    min_bytes: int
    max_bytes: int
    collectives: tuple[str, ...]
    backend: str | None
    timing: Any
    command: str = ""
    range_edges: tuple[int, ...] = (1 << 20, 64 << 20)


def add_comms_args(parser: argparse.ArgumentParser) -> None:
    """``calibrate-comms``'s flags, timing flags included (shared by the main CLI and ``-m ...calibration.comms``)."""
    parser.add_argument("--out", help="profile folder (the compute profile's, to use both in one simulation)")
    parser.add_argument("--min-bytes", default="32KiB", help="smallest message (default 32KiB)")
    parser.add_argument("--max-bytes", default="1GiB", help="largest message, capped by free memory (default 1GiB)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help=f"comma-separated subset of {','.join(COLLECTIVES)}")
    parser.add_argument("--backend", help="nccl or gloo (default nccl when CUDA is available, else gloo)")
    parser.add_argument("--range-edges", default="1MiB,64MiB",
                        help="sizes where a new latency/bandwidth fit starts (default 1MiB,64MiB)")
    add_timing_args(parser, budget=1.0)


def comms_config(args: argparse.Namespace, argv: list[str] | None) -> CommsConfig:
    """Validate ``calibrate-comms`` arguments, timing flags included; UsageError naming the first bad one.

    ``argv`` is the command as given in-process (None: this process's sys.argv), recorded in the profile.
    """
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        if key not in os.environ:
            raise UsageError(f"{key}: unset, expected a launch under torchrun, e.g. {LAUNCH_HINT}")
    world = integer("WORLD_SIZE", os.environ["WORLD_SIZE"])
    integer("RANK", os.environ["RANK"], 0, world - 1)
    if not args.out:
        raise UsageError("--out: missing, expected a folder to write the comms profile to")
    low = size_arg("--min-bytes", args.min_bytes, low=4)
    high = size_arg("--max-bytes", args.max_bytes, low=4)
    if low > high:
        raise UsageError(f"--min-bytes: got {args.min_bytes!r}, expected at least 4 bytes and at most --max-bytes")
    wanted = tuple(c.strip() for c in args.collectives.split(",") if c.strip())
    unknown = [c for c in wanted if c not in COLLECTIVES]
    if unknown or not wanted:
        raise UsageError(f"--collectives: got {args.collectives!r}, expected a subset of {','.join(COLLECTIVES)}")
    if args.backend not in (None, "nccl", "gloo"):
        raise UsageError(f"--backend: got {args.backend!r}, expected nccl or gloo")
    texts = [e for e in args.range_edges.split(",") if e.strip()]
    if not texts or len(texts) > MAX_RANGE_EDGES:
        raise UsageError(f"--range-edges: got {args.range_edges!r}, expected 1 to {MAX_RANGE_EDGES} positive sizes "
                         "such as 1MiB,64MiB")
    edges = tuple(size_arg("--range-edges", e) for e in texts)
    timing = timing_config(args, flush_l2=False, command="calibrate-comms")  # last of the flags: it imports torch
    from pipescope.calibration.env import command_line
    from pipescope.calibration.profile_io import ensure_writable

    if os.environ["RANK"] == "0":
        try:
            ensure_writable(args.out)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return CommsConfig(out=Path(args.out), min_bytes=low, max_bytes=high, collectives=wanted, backend=args.backend,
                       timing=timing, command=command_line(argv), range_edges=tuple(sorted(edges)))
