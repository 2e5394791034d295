"""``calibrate-comms``: time all-reduce, all-gather, reduce-scatter and p2p send/recv under torchrun.

Launch: ``torchrun --nproc-per-node N -m pipescope.calibration.comms --out DIR`` (nccl on GPUs, gloo on CPU). Sizes
double from ``--min-bytes`` to ``--max-bytes``, capped by free memory. Each size is warmed up, then repeated
(a barrier before each repetition, outside the timed window); a repetition's time is the mean over ranks, as
nccl-tests reports by default. p2p is a ping-pong between ranks 0 and 1, half the round trip. Rank 0 writes
the ``comms`` and ``comms_fit`` tables and ``comms.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

try:
    import torch
    import torch.distributed as dist
except ImportError:  # `python -m pipescope.calibration.comms` without torch: the one-line error, not a traceback
    if __name__ == "__main__":
        print("pipescope: error: calibrate-comms needs torch: pip install 'pipescope[calibration]'", file=sys.stderr)
        sys.exit(2)
    raise

from pipescope.calibration import env
from pipescope.calibration.commfit import bandwidths, fit_rows
from pipescope.calibration.args import UsageError, usage_error
from pipescope.calibration.comms_args import CommsConfig, add_comms_args, comms_config
from pipescope.calibration.profile_io import write_json, write_table
from pipescope.simulator.readers.profile_schema import COMMS_META, SCHEMA_VERSION
from pipescope.calibration.timing import stats

# torch >= 2.13 renamed the tensor collectives; keep working on the older names too.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def setup(backend: str | None) -> torch.device:
    """Join the torchrun group; returns the device this rank times on."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend: got 'nccl', expected gloo on a machine without CUDA (nccl needs a GPU)")
    use_nccl = backend == "nccl" or (backend is None and torch.cuda.is_available())
    if use_nccl:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def memory_cap(device: torch.device) -> int:
    """Largest message all ranks can afford: a third of free memory (an all-gather holds about 1 + 1/n buffers)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // local
    return int(agree(float(free // 3), dist.ReduceOp.MIN, device))


def agree(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    """All ranks' ``value`` reduced with ``op`` (so every rank takes the same decision)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def sizes(low: int, high: int, world: int) -> list[int]:
    """Doubling sizes from ``low`` to ``high``, each a multiple of 4 * world bytes (float32, split n ways)."""
    unit = 4 * world
    out, size = [], low
    while size <= high:
        out.append(max(unit, size // unit * unit))
        size *= 2
    return sorted(set(out))


def make_op(collective: str, nbytes: int, device: torch.device) -> Callable[[], None] | None:
    """The work of one repetition on this rank (None: this rank sits the op out)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = nbytes // 4
    buf = torch.ones(n, dtype=torch.float32, device=device)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(buf)
    if collective == "all_gather":
        part = torch.ones(n // world, dtype=torch.float32, device=device)
        return lambda: _ALL_GATHER(buf, part)
    if collective == "reduce_scatter":
        part = torch.empty(n // world, dtype=torch.float32, device=device)
        return lambda: _REDUCE_SCATTER(part, buf)
    if rank == 0:
        return lambda: (dist.send(buf, 1), dist.recv(buf, 1))
    if rank == 1:
        return lambda: (dist.recv(buf, 0), dist.send(buf, 0))
    return None


def time_once(op: Callable[[], None] | None, device: torch.device) -> float:
    """Nanoseconds of one repetition on this rank, after a barrier (CUDA events on the current stream)."""
    dist.barrier()
    if op is None:
        return 0.0
    if device.type != "cuda":
        start = time.perf_counter_ns()
        op()
        return float(time.perf_counter_ns() - start)
    stream = torch.cuda.current_stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    op()
    end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end) * 1e6


def measure(collective: str, nbytes: int, device: torch.device, config: CommsConfig) -> dict:
    """Median and spread of one (collective, size); every rank returns the same row."""
    op = make_op(collective, nbytes, device)
    for _ in range(config.timing.warmup):
        time_once(op, device)
    probe = agree(time_once(op, device), dist.ReduceOp.MAX, device)
    reps = int(min(config.timing.max_reps, max(config.timing.min_reps, config.timing.budget_s * 1e9 / max(probe, 1))))
    mine = torch.tensor([time_once(op, device) for _ in range(reps)], dtype=torch.float64, device=device)
    if collective == "p2p":
        dist.broadcast(mine, src=0)  # only rank 0 timed the round trip
        samples = [t / 2 for t in mine.tolist()]
    else:
        dist.all_reduce(mine)
        samples = [t / dist.get_world_size() for t in mine.tolist()]
    st = stats(samples)
    algbw, busbw = bandwidths(collective, dist.get_world_size(), nbytes, st.median_ns)
    return {"collective": collective, "world_size": dist.get_world_size(), "nbytes": nbytes,
            "median_ns": st.median_ns, "p10_ns": st.p10_ns, "p90_ns": st.p90_ns, "reps": st.reps,
            "algbw_gbps": algbw, "busbw_gbps": busbw}


def report(row: dict) -> None:
    """One nccl-tests-like line on rank 0's stdout."""
    print(f"{row['collective']:>15} {row['nbytes']:>12} {row['median_ns'] / 1e3:>12.1f} us "
          f"{row['algbw_gbps']:>8.2f} {row['busbw_gbps']:>8.2f} GB/s", flush=True)


def run(config: CommsConfig) -> None:
    """Measure on every rank; rank 0 writes the tables and then comms.json."""
    device = setup(config.backend)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        high = min(config.max_bytes, memory_cap(device))
        wanted = [c for c in config.collectives if c != "p2p" or world > 1]
        rows = []
        if rank == 0:
            print(f"{'collective':>15} {'bytes':>12} {'time':>15} {'algbw':>8} {'busbw':>8}", flush=True)
        for collective in wanted:
            for nbytes in sizes(config.min_bytes, high, world):
                rows.append(measure(collective, nbytes, device, config))
                if rank == 0:
                    report(rows[-1])
        if rank == 0:
            write_profile(config, rows, dist.get_backend(), device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_profile(config: CommsConfig, rows: list[dict], backend: str, device: torch.device) -> None:
    out = config.out
    tables = {"comms": write_table(out, "comms", rows),
              "comms_fit": write_table(out, "comms_fit", fit_rows(rows, config.range_edges))}
    write_json(out / COMMS_META, {
        "schema_version": SCHEMA_VERSION, "kind": "comms", "created_utc": env.now_utc(), "command": config.command,
        "backend": backend, "world_size": dist.get_world_size(), "p2p_ranks": [0, 1],
        "device": env.device_info(device), "versions": env.versions(), "timing": asdict(config.timing),
        "tables": tables,
        "conventions": "nccl-tests: algbw = bytes / time, busbw = algbw * bus factor; GB/s = 1e9 bytes/s; "
                       "fits: time_ns = latency_ns + nbytes * 1e9 / bandwidth (bytes/s) per size range",
    })
    print(f"pipescope calibrate-comms: wrote {out / COMMS_META}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m pipescope.calibration.comms [args]``: the calibrate-comms subcommand on its own.

    Builds its own parser from ``comms_args`` rather than the main CLI's, so this module never imports
    ``commands`` (which imports this one to run): the calibration imports stay a tree.
    """
    parser = argparse.ArgumentParser(prog="pipescope calibrate-comms", description="time collectives and p2p")
    add_comms_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(comms_config(args, None if argv is None else ["calibrate-comms", *argv]))  # None: sys.argv
    except UsageError as exc:
        return usage_error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
