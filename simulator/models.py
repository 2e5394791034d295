"""Transformer model shapes, their FLOPs and activation bytes (docs/schedules.md sections 5 and 7), the precision
table, and ``ModelConfig``, the model section of the config. The kernels of each pass are in
``simulator/kernels.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipescope.simulator.units import did_you_mean, short_repr


@dataclass(frozen=True)
class Precision:
    """Bytes per element or parameter of one training precision (Adam; ZeRO paper's accounting).

    Mixed precision (bf16/fp16) keeps 2-byte activations, weights and gradients plus 12 bytes of optimizer
    state per parameter (fp32 master copy, momentum, variance); fp32 needs no master copy, so 8.
    """

    name: str
    activation_bytes: int
    weight_bytes: int  # per stashed weight version
    grad_bytes: int
    optimizer_bytes: int

    @property
    def master_bytes(self) -> int:
        """The fp32 master copy inside ``optimizer_bytes`` (4 in mixed precision; 0 in fp32, where the weights are
        the master): what is left beside Adam's two fp32 moments."""
        return self.optimizer_bytes - 2 * ADAM_MOMENT_BYTES


ADAM_MOMENT_BYTES = 4  # momentum and variance are fp32 in every precision

# The one precision table: the analytic cost model, the memory ledger, calibration and config choices read it.
PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", activation_bytes=2, weight_bytes=2, grad_bytes=2, optimizer_bytes=12),
    "fp16": Precision("fp16", activation_bytes=2, weight_bytes=2, grad_bytes=2, optimizer_bytes=12),
    "fp32": Precision("fp32", activation_bytes=4, weight_bytes=4, grad_bytes=4, optimizer_bytes=8),
}


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
    # tiny at hidden 512: on a CPU its ops (2.6 ms a layer's forward) outweigh the interpreter's and gloo's
    # per-op overheads, which tiny's (0.1-0.4 ms) do not; validate's default (docs/validation.md)
    "tiny-512": ModelSpec("tiny-512", layers=4, hidden=512, heads=4, seq=32, vocab=512),
    "gpt-355m": ModelSpec("gpt-355m", layers=24, hidden=1024, heads=16, seq=1024, vocab=50257),
    "gpt-1.3b": ModelSpec("gpt-1.3b", layers=24, hidden=2048, heads=16, seq=1024, vocab=50257),
    "gpt-2.2b": ModelSpec("gpt-2.2b", layers=28, hidden=2560, heads=20, seq=1024, vocab=50257),
    "gpt-3.8b": ModelSpec("gpt-3.8b", layers=32, hidden=3072, heads=24, seq=1024, vocab=50257),
}


def preset(name: str, **overrides: int) -> ModelSpec:
    """A preset, optionally with some fields replaced; KeyError naming the choices if unknown."""
    if name not in PRESETS:
        raise KeyError(f"model.preset(={name!r}) is not one of {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


LAYERS_PER_STAGE = "model.layers_per_stage"


def stage_layers(layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """Transformer blocks on each stage, in stage order (with v chunks per device, one entry per chunk-stage of
    the schedule). Every cost model, the memory ledger (through them) and the real executor read the split here.

    ``layers_per_stage`` unset: equal slices, the remainder on the earliest stages. Given (Megatron-style uneven
    splits, e.g. fewer layers beside the embedding and the output layer): checked and returned as a list.

    Raises:
        ValueError: one line naming ``model.layers_per_stage``: a length other than ``num_stages``, an entry that
            is not an integer of at least 1, or a sum other than ``layers``.
    """
    if layers_per_stage is None:
        base, extra = divmod(layers, num_stages)
        return [base + (1 if s < extra else 0) for s in range(num_stages)]
    split = list(layers_per_stage)
    if len(split) != num_stages:
        raise ValueError(f"{LAYERS_PER_STAGE}: got {short_repr(split)}, expected {num_stages} entries "
                         f"(one per stage: schedule.stages x chunks)")
    for index, count in enumerate(split):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{LAYERS_PER_STAGE}: got {short_repr(count)} at entry {index + 1}, "
                             f"expected an integer of at least 1")
    if sum(split) != layers:
        raise ValueError(f"{LAYERS_PER_STAGE}: {short_repr(split)} sums to {sum(split)}, "
                         f"expected model.layers = {layers}")
    return split


@dataclass(frozen=True)
class LayerWork:
    """FLOPs and activation bytes of one transformer block for one microbatch (ZB paper, Table 1)."""

    forward_flops: float
    input_grad_flops: float
    weight_grad_flops: float
    activation_bytes: int  # M_B: what F stashes until the backward
    weight_grad_bytes: int  # M_W: what a deferred W still needs after I
    boundary_bytes: int  # the block's input/output tensor (what a stage sends on)


ATTENTIONS = ("flash", "eager")  # model.attention; docs/costs.md, "Attention"
FLASH_STATS_BYTES = 4  # flash attention keeps one fp32 log-sum-exp per row and head for its backward


def check_attention(attention: str) -> None:
    """ValueError naming ``model.attention`` unless it is one of ``ATTENTIONS``."""
    if attention not in ATTENTIONS:
        raise ValueError(f"model.attention: got {short_repr(attention)}, expected one of {', '.join(ATTENTIONS)}")


def layer_work(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash") -> LayerWork:
    """FLOPs (the MFU convention, the same for both attentions) and bytes of one transformer block.

    ``M_B`` follows the attention: eager stashes the s x s scores, softmax and dropout mask of every head (the ZB
    paper's ``sb(34h + 5as)``); flash stashes none of them, only a fp32 log-sum-exp per row and head
    (``34sbh + 4abs`` bytes).
    """
    check_attention(attention)
    s, b, h, a = model.seq, microbatch_size, model.hidden, model.heads
    width = PRECISIONS[precision].activation_bytes
    # The ZB paper's byte counts assume 2-byte activations; scale for fp32.
    scale = width / 2
    if attention == "eager":
        stash = int(s * b * (34 * h + 5 * a * s) * scale)
    else:
        stash = int(34 * s * b * h * scale) + FLASH_STATS_BYTES * a * s * b
    return LayerWork(
        forward_flops=s * b * h * (24 * h + 4 * s),
        input_grad_flops=s * b * h * (24 * h + 8 * s),
        weight_grad_flops=24 * s * b * h * h,
        activation_bytes=stash,
        weight_grad_bytes=int(32 * s * b * h * scale),
        boundary_bytes=s * b * h * width,
    )


def output_layer_flops(model: ModelSpec, microbatch_size: int) -> tuple[float, float, float]:
    """(F, I, W) FLOPs of logits + softmax + cross-entropy: 6bshV in all (docs/schedules.md section 7)."""
    part = 2.0 * microbatch_size * model.seq * model.hidden * model.vocab
    return part, part, part


def output_activation_bytes(model: ModelSpec, microbatch_size: int, precision: str) -> int:
    """What the output layer stashes: the logits in the model's precision plus fp32 softmax for cross-entropy."""
    return microbatch_size * model.seq * model.vocab * (PRECISIONS[precision].activation_bytes + 4)


DEFAULT_PRESET = "gpt-1.3b"
SHAPE_KEYS = ("layers", "hidden", "heads", "seq", "vocab")


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` section: a preset, optionally with some dimensions replaced, the microbatch and precision,
    optionally the transformer blocks of each stage (``layers_per_stage``, checked by ``stage_layers``), and the
    attention implementation (``flash`` or ``eager``; analytic costs read it).

    ``preset`` unset means ``DEFAULT_PRESET``, except under profiled costs, where the profile's model is the run's.
    """

    preset: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq: int | None = None
    vocab: int | None = None
    microbatch_size: int = 1
    precision: str | None = None  # None: the GPU's own (bf16, or fp16 on GPUs without bf16 such as V100)
    layers_per_stage: tuple[int, ...] | None = None  # None: the equal split (``stage_layers``)
    attention: str = "flash"  # one of ATTENTIONS: what the analytic model stashes and times (docs/costs.md)

    def spec(self) -> ModelSpec:
        """The model's shape; ValueError naming the key when the preset is unknown or heads do not divide hidden."""
        try:
            spec = preset(self.preset or DEFAULT_PRESET, **{key: getattr(self, key) for key in SHAPE_KEYS})
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        if spec.hidden % spec.heads:
            raise ValueError(f"model.heads: got {spec.heads}, expected a divisor of model.hidden (={spec.hidden})")
        return spec

    @property
    def label(self) -> str:
        """``gpt-1.3b`` when the shape is the preset's; else the shape by its dimensions, those left unset named as
        the preset's (``GPT layers=96, hidden=12288 (heads=16, seq=2048, vocab=50257 from gpt-1.3b)``), so a custom
        shape never reads as a preset."""
        given = {key: getattr(self, key) for key in SHAPE_KEYS if getattr(self, key) is not None}
        name = self.preset or DEFAULT_PRESET
        base = PRESETS.get(name)
        if base is None or all(getattr(base, key) == value for key, value in given.items()):
            return name
        shape = ", ".join(f"{key}={value}" for key, value in given.items())
        unset = [f"{key}={getattr(base, key)}" for key in SHAPE_KEYS if key not in given]
        return f"GPT {shape}" + (f" ({', '.join(unset)} from {name})" if unset else "")
