"""``pipescope calibrate``: time a model's pieces on this machine and write a profile folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipescope.calibration import env, ops
from pipescope.calibration.model import Block, Embedding, OutputLayer
from pipescope.calibration.presets import Shape
from pipescope.calibration.profile_io import ensure_writable, write_json, write_table
from pipescope.simulator.readers.profile_schema import COMPUTE_META, SCHEMA_VERSION
from pipescope.calibration.timing import Timer, TimingConfig, make_timer

# Keyed like simulator.models.PRECISIONS (the byte counts live there); a test checks the keys agree.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class CalibrationConfig:
    """Everything one calibration run needs (already validated by the CLI).

    Attributes:
        shape: the model; ``shape.seq`` is the largest of ``seqs``.
        seqs: sequence lengths to measure at.
        microbatch_sizes: microbatch sizes to measure at.
        precision: ``bf16``, ``fp16`` or ``fp32`` (parameters and activations).
        device: ``cuda``, ``cuda:N`` or ``cpu``.
        out: the profile folder.
        vocab_shards: time the vocabulary-parallel S, T, S2, T2 passes for 1..this many shards.
        threads: CPU threads torch measures with: None pins 1 on CPU and leaves CUDA runs at torch's default, 0
            keeps torch's default, N pins N (``measuring_threads``); recorded either way.
        optimizer_layers: blocks in the largest optimizer-step group.
        timing: repetition policy.
        command: the command line, stored verbatim in the metadata.
    """

    shape: Shape
    seqs: tuple[int, ...]
    microbatch_sizes: tuple[int, ...]
    precision: str
    device: str
    out: Path
    vocab_shards: int = 1
    threads: int | None = None
    optimizer_layers: int = 2
    timing: TimingConfig = field(default_factory=TimingConfig)
    command: str = ""


def log(message: str) -> None:
    print(f"pipescope calibrate: {message}", file=sys.stderr, flush=True)


def measuring_threads(threads: int | None, device: torch.device) -> int | None:
    """How many threads to pin torch to while measuring (None: leave torch's default).

    By default 1 on CPU: torch otherwise starts one thread per core, and when another process holds one of the
    cores every parallel op waits for the thread that is not running, so times explode (a layer recorded at
    64 ms instead of 0.31 ms on a 2-core machine); one thread is slower on an idle machine but stays put on a
    busy one. CUDA runs are left alone: their times are the GPU's. ``threads`` 0 keeps torch's default, N
    pins N.
    """
    if threads is None:
        return 1 if device.type == "cpu" else None
    return threads or None


@contextmanager
def pinned_threads(count: int | None) -> Iterator[None]:
    """torch pinned to ``count`` threads (None: unchanged) inside, its previous count restored after."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(config: CalibrationConfig) -> Path:
    """Measure everything (threads pinned), write the tables and then the metadata; return the profile folder."""
    out = ensure_writable(config.out)
    with pinned_threads(measuring_threads(config.threads, torch.device(config.device))):
        return measure_and_write(config, out)


def measure_and_write(config: CalibrationConfig, out: Path) -> Path:
    """Time every component at every point, warn about rows that stayed noisy, write the profile."""
    device = torch.device(config.device)
    dtype = DTYPES[config.precision]
    torch.manual_seed(0)
    timer = make_timer(device, config.timing)
    shape = config.shape
    count = min(shape.layers, config.optimizer_layers)
    blocks = [Block(shape.hidden, shape.heads).to(device, dtype) for _ in range(count)]
    embedding = Embedding(shape.vocab, shape.hidden, max(config.seqs)).to(device, dtype)
    output = OutputLayer(shape.hidden, shape.vocab).to(device, dtype)
    timings, memory = [], []
    for seq in config.seqs:
        for mb in config.microbatch_sizes:
            log(f"seq {seq} microbatch {mb}")
            for measure, module in ((ops.layer_rows, blocks[0]), (ops.embedding_rows, embedding),
                                    (ops.output_rows, output)):
                rows, mem = measure(timer, module, mb, seq)
                timings += rows
                memory.append(mem)
            timings += ops.shard_rows(timer, output, mb, seq, config.vocab_shards)
    log("optimizer step")
    timings += ops.optimizer_rows(timer, ops.optimizer_groups(blocks, embedding, output))
    noisy = ops.noisy_rows(timings, config.timing.max_spread)
    if noisy:
        warn_noisy(noisy, len(timings), config.timing)
    tables = {"timings": write_table(out, "timings", timings), "memory": write_table(out, "memory", memory)}
    write_json(out / COMPUTE_META, metadata(config, timer, tables, timings))
    log(f"wrote {out / COMPUTE_META}")
    return out


def warn_noisy(noisy: list[ops.Row], total: int, timing: TimingConfig, shown: int = 5) -> None:
    """One stderr line naming the rows (the first ``shown`` of them) that stayed noisy after re-measuring."""
    names = [f"{r['component']} {r['op']} mb {r['microbatch_size']} seq {r['seq']}"
             + (f" shards {r['shards']}" if r["shards"] != 1 else "") + f" ({r['spread']:.2f}x)" for r in noisy]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    log(f"warning: {len(noisy)} of {total} timing rows stayed noisy (p90/median above {timing.max_spread:g} after "
        f"up to {timing.retries} re-measurements): {', '.join(names[:shown])}{more}; is another process using "
        "this machine? Their times may be too high; listed under noisy_rows in profile.json")


def metadata(config: CalibrationConfig, timer: Timer, tables: dict[str, str], timings: list[ops.Row]) -> dict:
    """The profile's JSON metadata: schema version, model, precision, device, versions, timing policy (threads,
    rows re-measured), the timing rows that stayed noisy."""
    device = torch.device(config.device)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "compute",
        "created_utc": env.now_utc(),
        "command": config.command,
        "model": asdict(config.shape),
        "seqs": list(config.seqs),
        "microbatch_sizes": list(config.microbatch_sizes),
        "precision": config.precision,
        "vocab_shards": config.vocab_shards,
        "device": env.device_info(device),
        "versions": env.versions(),
        "timing": {**asdict(config.timing), "method": timer.method, "threads": torch.get_num_threads(),
                   "threads_pinned": measuring_threads(config.threads, device) is not None,
                   "flush_l2": bool(getattr(timer, "flush_bytes", 0)),
                   "l2_flush_bytes": getattr(timer, "flush_bytes", 0),
                   "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                   "remeasured_rows": sum(row["attempts"] > 1 for row in timings)},
        "noisy_rows": ops.noisy_rows(timings, config.timing.max_spread),
        "optimizer": {"name": "AdamW", "lr": 1e-4, "master_dtype": "fp32", "defaults": "torch's (foreach on CUDA)"},
        "tables": tables,
    }
