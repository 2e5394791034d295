"""Transformer model shapes, their FLOPs and activation bytes (SCHEDULES.md sections 5 and 7),
and datasheet specs of the GPUs the analytic cost model knows."""

from __future__ import annotations

from dataclasses import dataclass, replace

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder: ``layers`` transformer blocks plus input embedding and output layer."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def layer_params(self) -> int:
        """Parameters of one transformer block: QKV/out/MLP weights plus biases and layer norms."""
        h = self.hidden
        return 12 * h * h + 13 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq * self.hidden

    def output_params(self) -> int:
        """The output projection (tied in GPT-2, counted here since pipelines hold a copy)."""
        return self.vocab * self.hidden

    def total_params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()


# Shapes chosen so the parameter counts match the names (GPT-2 style, vocab 50257, seq 1024).
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", layers=4, hidden=64, heads=4, seq=32, vocab=512),
    "gpt-355m": ModelSpec("gpt-355m", layers=24, hidden=1024, heads=16, seq=1024, vocab=50257),
    "gpt-1.3b": ModelSpec("gpt-1.3b", layers=24, hidden=2048, heads=16, seq=1024, vocab=50257),
    "gpt-2.2b": ModelSpec("gpt-2.2b", layers=28, hidden=2560, heads=20, seq=1024, vocab=50257),
    "gpt-3.8b": ModelSpec("gpt-3.8b", layers=32, hidden=3072, heads=24, seq=1024, vocab=50257),
}


def preset(name: str, **overrides: int) -> ModelSpec:
    """A preset, optionally with some fields replaced; KeyError naming the choices if unknown."""
    if name not in PRESETS:
        raise KeyError(f"model.preset(={name!r}) is not one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class LayerWork:
    """FLOPs and activation bytes of one transformer block for one microbatch (ZB paper, Table 1)."""

    forward_flops: float
    input_grad_flops: float
    weight_grad_flops: float
    activation_bytes: int  # M_B: what F stashes until the backward
    weight_grad_bytes: int  # M_W: what a deferred W still needs after I
    boundary_bytes: int  # the block's input/output tensor (what a stage sends on)


def layer_work(model: ModelSpec, microbatch_size: int, precision: str) -> LayerWork:
    s, b, h, a = model.seq, microbatch_size, model.hidden, model.heads
    width = PRECISION_BYTES[precision]
    # The ZB paper's byte counts assume 2-byte activations; scale for fp32.
    scale = width / 2
    return LayerWork(
        forward_flops=s * b * h * (24 * h + 4 * s),
        input_grad_flops=s * b * h * (24 * h + 8 * s),
        weight_grad_flops=24 * s * b * h * h,
        activation_bytes=int(s * b * (34 * h + 5 * a * s) * scale),
        weight_grad_bytes=int(32 * s * b * h * scale),
        boundary_bytes=s * b * h * width,
    )


def output_layer_flops(model: ModelSpec, microbatch_size: int) -> tuple[float, float, float]:
    """(F, I, W) FLOPs of logits + softmax + cross-entropy: 6bshV in all (SCHEDULES.md section 7)."""
    part = 2.0 * microbatch_size * model.seq * model.hidden * model.vocab
    return part, part, part


def output_activation_bytes(model: ModelSpec, microbatch_size: int, precision: str) -> int:
    """What the output layer stashes: the logits in the model's precision plus fp32 softmax for cross-entropy."""
    return microbatch_size * model.seq * model.vocab * (PRECISION_BYTES[precision] + 4)


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet numbers: dense tensor-core peak per precision (FLOP/s), HBM bandwidth and size."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int


GiB = 1 << 30
DEVICES: dict[str, DeviceSpec] = {
    "v100": DeviceSpec("V100-SXM2-32GB", {"fp16": 125e12, "bf16": 125e12, "fp32": 15.7e12}, 900e9, 32 * GiB),
    "a100": DeviceSpec("A100-SXM4-80GB", {"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12}, 2039e9, 80 * GiB),
    "h100": DeviceSpec("H100-SXM5-80GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 3350e9, 80 * GiB),
    "h200": DeviceSpec("H200-SXM-141GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 4800e9, 141 * 10**9),
}
