"""The ``calibrate`` and ``calibrate-comms`` subcommands (and ``calibrate-gemms``, registered from ``gemms``).

The main CLI calls ``register(subparsers)``; on a GPU box without the rest of pipescope,
``python -m pipescope.calibration.commands calibrate ...`` does the same. Values are checked here rather than by
argparse so a bad one gives a single line ``pipescope: error: <key>: <value>, expected ...`` and exit 2.
torch is imported only once the arguments are known to be good.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from pipescope.calibration.args import (
    UsageError,
    add_spread_args,
    add_timing_args,
    int_list,
    integer,
    optional_int,
    thread_count,
    timing_config,
    usage_error,
)
from pipescope.calibration import gemms
from pipescope.calibration.comms_args import add_comms_args, comms_config
from pipescope.calibration.presets import HARNESS_PRESETS, PRECISIONS, harness_bytes, resolve

MAX_VOCAB_SHARDS = 1024  # S and T are timed for every count from 1 up: beyond a pipeline's depth it is only time
UNKNOWN_MEMORY_BYTES = 1 << 50  # the bound when the machine's memory cannot be read


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate``, ``calibrate-comms`` and ``calibrate-gemms`` to a CLI's subparsers."""
    cal = subparsers.add_parser("calibrate", help="time a model's layers on this machine and write a profile",
                                description="Time F, I, W, B and recompute per transformer layer, the embedding, "
                                "the output layer (and its vocabulary shards) and the optimizer step; count "
                                "activation bytes. See calibration/README.md.")
    cal.add_argument("--model", help=f"preset: {', '.join(HARNESS_PRESETS)} (fields below override it)")
    for name in ("layers", "hidden", "heads", "vocab"):
        cal.add_argument(f"--{name}", help=f"model {name} (integer)")
    cal.add_argument("--seq", help="sequence length(s), comma-separated to interpolate between them")
    cal.add_argument("--microbatch-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    cal.add_argument("--precision", help="bf16, fp16 or fp32 (default bf16 on cuda, fp32 on cpu)")
    cal.add_argument("--device", help="cuda, cuda:N or cpu (default cuda when available)")
    cal.add_argument("--out", help="profile folder to write (created if missing)")
    cal.add_argument("--vocab-shards", default="8", help="time vocab-parallel S/T/S2/T2 for 1..P shards (default 8)")
    cal.add_argument("--threads", help="CPU threads torch measures with: N, or auto for torch's choice (default: 1 "
                     "on cpu, torch's choice on cuda); recorded in the profile")
    add_timing_args(cal, budget=2.0)
    add_spread_args(cal)
    cal.set_defaults(func=calibrate_command)
    comms = subparsers.add_parser("calibrate-comms", help="time collectives and p2p under torchrun",
                                  description="Run under torchrun: torchrun --nproc-per-node N "
                                  "-m pipescope.calibration.comms --out DIR (or the pipescope executable with "
                                  "calibrate-comms).")
    add_comms_args(comms)
    comms.set_defaults(func=comms_command)
    gemms.register(subparsers)


def calibration_config(args: argparse.Namespace, argv: list[str] | None = None):
    """Validate ``calibrate``'s arguments into a CalibrationConfig; UsageError on the first bad one."""
    seqs = int_list("--seq", args.seq, "1024,2048") if args.seq else None
    overrides = {k: optional_int(f"--{k}", getattr(args, k)) for k in ("layers", "hidden", "heads", "vocab")}
    try:
        shape = resolve(args.model, seq=max(seqs) if seqs else None, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    microbatches = int_list("--microbatch-sizes", args.microbatch_sizes)
    check_target_flags(args, "the profile")
    shards = integer("--vocab-shards", args.vocab_shards, 1, MAX_VOCAB_SHARDS)
    threads = thread_count(args.threads, os.cpu_count() or 1)
    timing = timing_config(args, remeasure=True)  # last of the flags: it needs torch
    import torch

    device, precision = resolve_target(args, torch)
    check_fits(shape, max(microbatches), shape.seq, precision, device, device_memory(torch, device))
    check_writable(args.out)
    from pipescope.calibration.calibrate import CalibrationConfig
    from pipescope.calibration.env import command_line

    return CalibrationConfig(shape=shape, seqs=seqs or (shape.seq,), microbatch_sizes=microbatches,
                             precision=precision, device=device, out=Path(args.out), vocab_shards=shards,
                             threads=threads, timing=timing, command=command_line(argv))


def check_target_flags(args: argparse.Namespace, what: str) -> None:
    """``--precision``, ``--device`` and ``--out`` (which must be given: a folder for ``what``), before torch loads."""
    if args.precision is not None and args.precision not in PRECISIONS:
        raise UsageError(f"--precision: got {args.precision!r}, expected one of {', '.join(PRECISIONS)}")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", args.device):
        raise UsageError(f"--device: got {args.device!r}, expected cuda, cuda:N or cpu")
    if not args.out:
        raise UsageError(f"--out: missing, expected a folder to write {what} to")


def resolve_target(args: argparse.Namespace, torch) -> tuple[str, str]:  # noqa: ANN001 (torch, imported lazily)
    """The device (cuda when torch sees one) and precision (bf16 on cuda, fp32 on cpu) unless given, checked
    against the devices torch sees."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device: got {device!r}, expected cpu (torch sees no CUDA device here)")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise UsageError(f"--device: got {device!r}, expected cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device, args.precision or ("bf16" if device.startswith("cuda") else "fp32")


def check_writable(out: str) -> None:
    """``--out`` made and proved writable, the last check before anything is measured."""
    from pipescope.calibration.profile_io import ensure_writable

    try:
        ensure_writable(out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def device_memory(torch, device: str) -> int | None:  # noqa: ANN001 (the torch module, imported lazily)
    """Bytes of memory ``device`` has (a GPU's total, or the machine's physical memory); None if unknown."""
    try:
        if device.startswith("cuda"):
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None


def check_fits(shape, microbatch: int, seq: int, precision: str, device: str,  # noqa: ANN001 (a Shape)
               memory: int | None) -> None:
    """UsageError, naming the flag that drives it most, when the harness would need more memory than ``device``
    has (``harness_bytes``, a lower bound): refused before torch allocates anything."""
    need = harness_bytes(shape, microbatch, seq, precision)
    total, limit = sum(need.values()), memory or UNKNOWN_MEMORY_BYTES
    if total <= limit:
        return
    flag = max(need, key=need.get)
    value = {"--hidden": shape.hidden, "--vocab": shape.vocab, "--microbatch-sizes": microbatch}[flag]
    raise UsageError(f"{flag}: got {value}, expected a model that fits: hidden {shape.hidden}, vocab {shape.vocab}, "
                     f"microbatch {microbatch}, seq {seq} in {precision} need at least {total / 2**30:.4g} GiB, "
                     f"{device} has {limit / 2**30:.4g} GiB")


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
    try:
        config = comms_config(args, getattr(args, "argv", None))
        from pipescope.calibration.comms import run

        run(config)  # may still refuse the backend once torch shows what the machine has
    except UsageError as exc:
        return usage_error(str(exc))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipescope", description="pipescope calibration (standalone)")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m pipescope.calibration.commands calibrate|calibrate-comms|calibrate-gemms ...``; the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
