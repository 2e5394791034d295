"""``pipescope calibrate-gemms``: time a grid of matmul shapes on this device and write a GEMM table
(``gemms.json`` and ``gemms.parquet``/``.csv``, docs/costs.md "Measured GEMMs"), which ``costs.gemms`` puts in
place of the GPU's published large-GEMM rate.

Each shape is ``torch.matmul`` of an (m x k) by a (k x n) matrix at the profile's precision, timed by the calibration
``Timer`` (CUDA events with L2 flushed between repetitions on a GPU; perf_counter on a CPU). Values are checked
before torch is imported; the table is written atomically, the metadata last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pipescope.calibration.args import (
    UsageError,
    add_timing_args,
    int_list,
    thread_count,
    timing_config,
    usage_error,
)
from pipescope.calibration.presets import PRECISIONS
from pipescope.simulator.readers.profile_schema import MAX_GEMM_SHAPES

# Rows (tokens), columns and inner sizes of a transformer's matmuls, from a short microbatch to a large model's
# hidden size times 4: 6^3 = 216 shapes, about a minute on an H100 with --budget-s 0.25. A CPU thread takes
# seconds where a GPU takes milliseconds: its default stops at 1024.
DEFAULT_SIZES = "512,1024,2048,4096,8192,16384"
CPU_SIZES = "128,256,512,1024"
MAX_SIZE = 65_536  # beyond any model's hidden x 4; with 3 operands at that size in fp32, 48 GiB


@dataclass(frozen=True)
class GemmSweepConfig:
    sizes: tuple[int, ...]
    precision: str
    device: str
    out: Path
    threads: int | None
    timing: object  # calibration.timing.TimingConfig (torch is imported only once the flags are good)
    command: str


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate-gemms`` to a CLI's subparsers."""
    parser = subparsers.add_parser(
        "calibrate-gemms", help="time a grid of matmul shapes on this device (a GEMM table for costs.gemms)",
        description="Time torch.matmul of (m x k) by (k x n) for every m, n, k in --sizes and write gemms.json "
        "with a gemms table to --out. A config's costs.gemms: OUT then prices each matmul of the analytic model at "
        "the measured rate of the nearest shape (docs/costs.md, 'Measured GEMMs').")
    parser.add_argument("--sizes", help=f"m, n and k values, comma-separated; every combination is timed "
                        f"(default {DEFAULT_SIZES} on cuda, {CPU_SIZES} on cpu)")
    parser.add_argument("--precision", help="bf16, fp16 or fp32 (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default cuda when available)")
    parser.add_argument("--out", help="folder to write (created if missing)")
    parser.add_argument("--threads", help="CPU threads torch measures with: N, or auto (default: 1 on cpu)")
    add_timing_args(parser, budget=0.25)
    parser.set_defaults(func=gemms_command)


def sweep_config(args: argparse.Namespace, argv: list[str] | None = None) -> GemmSweepConfig:
    """Validate the flags; UsageError on the first bad one, before torch allocates anything."""
    from pipescope.calibration.commands import check_target_flags, check_writable, device_memory, resolve_target

    if args.sizes is not None:
        _sizes(args.sizes)
    check_target_flags(args, "the GEMM table")
    threads = thread_count(args.threads, os.cpu_count() or 1)
    timing = timing_config(args, command="calibrate-gemms")  # last of the flags: it needs torch
    import torch

    from pipescope.calibration.env import command_line

    device, precision = resolve_target(args, torch)
    sizes = _sizes(args.sizes or (DEFAULT_SIZES if device.startswith("cuda") else CPU_SIZES))
    _check_fits(sizes[-1], precision, device, device_memory(torch, device))
    check_writable(args.out)
    return GemmSweepConfig(sizes, precision, device, Path(args.out), threads, timing, command_line(argv))


def _sizes(text: str) -> tuple[int, ...]:
    sizes = int_list("--sizes", text, "1024,4096", high=MAX_SIZE)
    if len(sizes) ** 3 > MAX_GEMM_SHAPES:
        raise UsageError(f"--sizes: got {len(sizes)} sizes ({len(sizes) ** 3} shapes), expected at most "
                         f"{round(MAX_GEMM_SHAPES ** (1 / 3))} sizes")
    return sizes


def _check_fits(size: int, precision: str, device: str, memory: int | None) -> None:
    """UsageError when the largest shape's operands (and the fp32 matrix each input is drawn as) exceed the
    device's memory."""
    need = 3 * size * size * PRECISIONS[precision].activation_bytes + size * size * 4
    if memory is not None and need > memory:
        raise UsageError(f"--sizes: got {size}, expected sizes whose largest matmul fits: {need / 2**30:.4g} GiB "
                         f"needed, {device} has {memory / 2**30:.4g} GiB")


def gemms_command(args: argparse.Namespace) -> int:
    """Entry point of ``pipescope calibrate-gemms``: 0 on success, 2 on a bad argument."""
    try:
        config = sweep_config(args, getattr(args, "argv", None))
    except UsageError as exc:
        return usage_error(str(exc))
    run(config)
    return 0


def run(config: GemmSweepConfig) -> Path:
    """Time every shape (threads pinned as ``calibrate`` pins them) and write the table, then the metadata."""
    import torch

    from pipescope.calibration import env
    from pipescope.calibration.calibrate import DTYPES, measuring_threads, pinned_threads
    from pipescope.calibration.profile_io import write_json, write_table
    from pipescope.calibration.timing import Bench, make_timer
    from pipescope.simulator.readers.profile_schema import GEMMS_META, SCHEMA_VERSION

    device = torch.device(config.device)
    with pinned_threads(measuring_threads(config.threads, device)):
        timer = make_timer(device, config.timing)
        rows = []
        shapes = list(itertools.product(config.sizes, repeat=3))
        for index, (m, n, k) in enumerate(shapes, 1):
            a = torch.randn(m, k, device=device).to(DTYPES[config.precision])
            b = torch.randn(k, n, device=device).to(DTYPES[config.precision])
            stats = timer.measure(Bench(run=lambda pair: torch.matmul(*pair), setup=lambda a=a, b=b: (a, b)))
            rows.append({"m": m, "n": n, "k": k, **asdict(stats), "tflops": 2 * m * n * k / stats.median_ns / 1e3})
            print(f"calibrate-gemms: {index}/{len(shapes)} {m} x {n} x {k}: {rows[-1]['tflops']:.3g} TFLOP/s",
                  file=sys.stderr, flush=True)
            del a, b
        threads = torch.get_num_threads()
    tables = {"gemms": write_table(config.out, "gemms", rows)}
    write_json(config.out / GEMMS_META, {
        "schema_version": SCHEMA_VERSION, "kind": "gemms", "created_utc": env.now_utc(), "command": config.command,
        "precision": config.precision, "device": env.device_info(device), "versions": env.versions(),
        "timing": {**asdict(config.timing), "method": timer.method, "threads": threads,
                   "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)},
        "tables": tables})
    print(f"calibrate-gemms: wrote {config.out / GEMMS_META}", file=sys.stderr, flush=True)
    return config.out
