"""``pipescope calibrate``: time a model's pieces on this machine and write a profile folder."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipescope.calibration import env, ops
from pipescope.calibration.model import Block, Embedding, OutputLayer
from pipescope.calibration.presets import Shape
from pipescope.calibration.profile_io import ensure_writable, write_json, write_table
from pipescope.simulator.profile_schema import COMPUTE_META, SCHEMA_VERSION
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
        vocab_shards: time the vocabulary-parallel S/T passes for 1..this many shards.
        threads: CPU threads (None keeps torch's default); recorded either way.
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


def run(config: CalibrationConfig) -> Path:
    """Measure everything, write the tables and then the metadata; return the profile folder."""
    out = ensure_writable(config.out)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
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
    tables = {"timings": write_table(out, "timings", timings), "memory": write_table(out, "memory", memory)}
    write_json(out / COMPUTE_META, metadata(config, timer, tables))
    log(f"wrote {out / COMPUTE_META}")
    return out


def metadata(config: CalibrationConfig, timer: Timer, tables: dict[str, str]) -> dict:
    """The profile's JSON metadata: schema version, model, precision, device, versions, timing policy."""
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
                   "flush_l2": bool(getattr(timer, "flush_bytes", 0)),
                   "l2_flush_bytes": getattr(timer, "flush_bytes", 0),
                   "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)},
        "optimizer": {"name": "AdamW", "lr": 1e-4, "master_dtype": "fp32", "defaults": "torch's (foreach on CUDA)"},
        "tables": tables,
    }
