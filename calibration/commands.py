"""The ``calibrate`` and ``calibrate-comms`` subcommands.

The main CLI calls ``register(subparsers)``; on a GPU box without the rest of pipescope,
``python -m pipescope.calibration.commands calibrate ...`` does the same. Values are checked here rather than by
argparse so a bad one gives a single line ``pipescope: error: <key>: <value>, expected ...`` and exit 2.
torch is imported only once the arguments are known to be good.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pipescope.calibration.presets import PRECISIONS, PRESETS, resolve

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


class UsageError(ValueError):
    """A bad command-line value; the message reads ``<key>: <value>, expected ...``."""


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
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise UsageError(f"{key}: {value}, expected a positive number")


def size_bytes(key: str, text: str) -> int:
    """``"32KiB"``, ``"1GiB"``, ``"512MB"`` or plain bytes -> int bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise UsageError(f"{key}: {text!r}, expected a size such as 32KiB, 64MiB, 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def add_timing_args(parser: argparse.ArgumentParser, budget: float) -> None:
    group = parser.add_argument_group("timing")
    group.add_argument("--warmup", type=str, default="3", help="untimed runs first (default 3)")
    group.add_argument("--min-reps", type=str, default="7", help="at least this many timed runs (default 7)")
    group.add_argument("--max-reps", type=str, default="200", help="at most this many timed runs (default 200)")
    group.add_argument("--rel-tol", type=str, default="0.02",
                       help="stop once the median's standard error is below this fraction of it (default 0.02)")
    group.add_argument("--budget-s", type=str, default=str(budget),
                       help=f"wall-time budget per measured op in seconds (default {budget})")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` and ``calibrate-comms`` to a CLI's subparsers."""
    cal = subparsers.add_parser("calibrate", help="time a model's layers on this machine and write a profile",
                                description="Time F, I, W, B and recompute per transformer layer, the embedding, "
                                "the output layer (and its vocabulary shards) and the optimizer step; count "
                                "activation bytes. See calibration/README.md.")
    cal.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (fields below override it)")
    for name in ("layers", "hidden", "heads", "vocab"):
        cal.add_argument(f"--{name}", help=f"model {name} (integer)")
    cal.add_argument("--seq", help="sequence length(s), comma-separated to interpolate between them")
    cal.add_argument("--microbatch-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    cal.add_argument("--precision", help="bf16, fp16 or fp32 (default bf16 on cuda, fp32 on cpu)")
    cal.add_argument("--device", help="cuda, cuda:N or cpu (default cuda when available)")
    cal.add_argument("--out", help="profile folder to write (created if missing)")
    cal.add_argument("--vocab-shards", default="8", help="time vocabulary-parallel S/T for 1..P shards (default 8)")
    cal.add_argument("--threads", help="CPU threads for torch (default: torch's choice); recorded in the profile")
    add_timing_args(cal, budget=2.0)
    cal.set_defaults(func=calibrate_command)
    comms = subparsers.add_parser("calibrate-comms", help="time collectives and p2p under torchrun",
                                  description="Run under torchrun: torchrun --nproc-per-node N "
                                  "-m pipescope.calibration.comms --out DIR (or the pipescope executable with "
                                  "calibrate-comms).")
    from pipescope.calibration.comms_args import add_comms_args

    add_comms_args(comms)
    add_timing_args(comms, budget=1.0)
    comms.set_defaults(func=comms_command)


def _int(key: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{key}: {text!r}, expected an integer") from None


def _float(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{key}: {text!r}, expected a number") from None


def timing_config(args: argparse.Namespace, flush_l2: bool = True):
    """TimingConfig from the shared timing flags (imported lazily: it pulls in torch)."""
    values = {"warmup": _int("--warmup", args.warmup), "min_reps": _int("--min-reps", args.min_reps),
              "max_reps": _int("--max-reps", args.max_reps), "rel_tol": _float("--rel-tol", args.rel_tol),
              "budget_s": _float("--budget-s", args.budget_s)}
    if values["warmup"] < 0:
        raise UsageError(f"--warmup: {values['warmup']}, expected 0 or more")
    for key in ("min_reps", "max_reps", "rel_tol", "budget_s"):
        positive("--" + key.replace("_", "-"), values[key], allow_none=False)
    if values["max_reps"] < values["min_reps"]:
        raise UsageError(f"--max-reps: {values['max_reps']}, expected at least --min-reps {values['min_reps']}")
    from pipescope.calibration.timing import TimingConfig

    return TimingConfig(flush_l2=flush_l2, **values)


def calibration_config(args: argparse.Namespace, argv: list[str] | None = None):
    """Validate ``calibrate``'s arguments into a CalibrationConfig; UsageError on the first bad one."""
    seqs = int_list("--seq", args.seq, "1024,2048") if args.seq else None
    overrides = {k: _int(f"--{k}", getattr(args, k)) for k in ("layers", "hidden", "heads", "vocab")}
    try:
        shape = resolve(args.model, seq=max(seqs) if seqs else None, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    microbatches = int_list("--microbatch-sizes", args.microbatch_sizes)
    if args.precision is not None and args.precision not in PRECISIONS:
        raise UsageError(f"--precision: {args.precision!r}, expected one of {', '.join(PRECISIONS)}")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device: {args.device!r}, expected cuda, cuda:N or cpu")
    if not args.out:
        raise UsageError("--out: missing, expected a folder to write the profile to")
    shards, threads = _int("--vocab-shards", args.vocab_shards), _int("--threads", args.threads)
    positive("--vocab-shards", shards)
    positive("--threads", threads)
    timing = timing_config(args)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device: {device!r}, expected cpu (torch sees no CUDA device here)")
    from pipescope.calibration.calibrate import CalibrationConfig
    from pipescope.calibration.env import command_line
    from pipescope.calibration.profile_io import ensure_writable

    precision = args.precision or ("bf16" if device.startswith("cuda") else "fp32")
    try:
        ensure_writable(args.out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return CalibrationConfig(shape=shape, seqs=seqs or (shape.seq,), microbatch_sizes=microbatches,
                             precision=precision, device=device, out=Path(args.out), vocab_shards=shards,
                             threads=threads, timing=timing, command=command_line(argv))


def usage_error(message: str) -> int:
    print(f"pipescope: error: {message}", file=sys.stderr)
    return 2


def calibrate_command(args: argparse.Namespace) -> int:
    """Entry point of ``pipescope calibrate``: 0 on success, 2 on a bad argument."""
    try:
        config = calibration_config(args, getattr(args, "argv", None))
    except UsageError as exc:
        return usage_error(str(exc))
    from pipescope.calibration.calibrate import run

    run(config)
    return 0


def comms_command(args: argparse.Namespace) -> int:
    """Entry point of ``pipescope calibrate-comms`` (under torchrun): 0 on success, 2 on a bad argument."""
    from pipescope.calibration.comms_args import comms_config

    try:
        config = comms_config(args, timing_config(args, flush_l2=False), getattr(args, "argv", None))
    except UsageError as exc:
        return usage_error(str(exc))
    from pipescope.calibration.comms import run

    run(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipescope", description="pipescope calibration (standalone)")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m pipescope.calibration.commands calibrate|calibrate-comms ...``; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
