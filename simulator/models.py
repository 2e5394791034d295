"""Transformer model shapes, their FLOPs and activation bytes (docs/schedules.md sections 5 and 7), the kernels of
each pass with their FLOPs and bytes moved (the analytic roofline's input, docs/costs.md), the precision table, and
``ModelConfig``, the model section of the config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipescope.simulator.units import short_repr


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


# Kernels: the analytic cost model's roofline input (docs/costs.md) -----------------------------------------------

PASSES = ("F", "I", "W", "optimizer")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a pass for one microbatch (the optimizer's: once per iteration).

    ``flops`` are model FLOPs, the MFU convention's: the matmuls' (the s x s ones included). Element-wise,
    normalisation and softmax passes carry 0: their few FLOPs are not counted there, and they are bound by
    memory anyway. ``nbytes`` is what the kernel reads plus what it writes.
    """

    name: str
    op: str  # one of PASSES
    flops: float
    nbytes: float


@dataclass(frozen=True)
class _Shape:
    """The sizes every kernel formula reads: tokens t = s*b, element widths, the score matrix's elements."""

    tokens: int
    hidden: int
    seq: int
    heads: int
    vocab: int
    act: int  # bytes per activation element
    weight: int  # bytes per weight element
    grad: int  # bytes per gradient element
    tensor: int = 1  # tensor-parallel GPUs the block is split over (simulator/parallel.py)
    sequence: bool = False  # sequence parallelism over them

    @classmethod
    def of(cls, model: ModelSpec, microbatch_size: int, precision: str, tensor: int = 1,
           sequence: bool = False) -> _Shape:
        p = PRECISIONS[precision]
        return cls(model.seq * microbatch_size, model.hidden, model.seq, model.heads, model.vocab,
                   p.activation_bytes, p.weight_bytes, p.grad_bytes, tensor, sequence)

    def split(self) -> _Shape:
        """What one of t GPUs holds of a Megatron-split block: hidden, heads and vocabulary over t (ceil)."""
        t = self.tensor
        return replace(self, hidden=self.hidden // t, heads=self.heads // t, vocab=-(-self.vocab // t), tensor=1)

    def whole(self) -> _Shape:
        """What Megatron keeps whole on each GPU (layer norms, dropouts, residuals), unless sequence parallelism
        splits their tokens over t."""
        return replace(self, tokens=self.tokens // self.tensor) if self.sequence else self

    @property
    def sbh(self) -> int:
        """Bytes of one activation of the block's width (t x h)."""
        return self.tokens * self.hidden * self.act

    @property
    def scores(self) -> int:
        """Elements of one s x s matrix per head: b * a * s^2."""
        return self.tokens * self.heads * self.seq

    @property
    def stats(self) -> int:
        """Bytes of flash attention's per-row, per-head fp32 statistics."""
        return FLASH_STATS_BYTES * self.tokens * self.heads


def _matmul(name: str, op: str, x: _Shape, k: int, n: int, rows: int | None = None) -> Kernel:
    """A Linear of k inputs and n outputs over ``rows`` tokens (default all). F: y = x W^T; I: dx = dy W (the same
    sizes mirrored); W: dW += dy^T x, the gradient read and written in the gradient's precision."""
    t = x.tokens if rows is None else rows
    activations = (t * k + t * n) * x.act
    weights = 2 * k * n * x.grad if op == "W" else k * n * x.weight
    return Kernel(name, op, 2.0 * t * k * n, activations + weights)


def _attention(x: _Shape, op: str, attention: str) -> list[Kernel]:
    """The attention core of F or I: 2*t*s*h FLOPs per s x s matmul, two in F and four in I."""
    core = 2.0 * x.tokens * x.seq * x.hidden
    sbh, scores = x.sbh, x.scores * x.act
    mask = x.scores  # the attention dropout's 1-byte mask
    if attention == "flash":  # one fused kernel: Q, K, V in, O out (I: dO, O in; dQ, dK, dV out); stats only
        if op == "F":
            return [Kernel("flash attention", "F", 2 * core, 4 * sbh + x.stats)]
        return [Kernel("flash attention", "I", 4 * core, 8 * sbh + 2 * x.stats)]
    if op == "F":
        return [Kernel("attention scores", "F", core, 2 * sbh + scores),
                Kernel("softmax", "F", 0, 2 * scores),
                Kernel("attention dropout", "F", 0, 2 * scores + mask),
                Kernel("attention times V", "F", core, scores + 2 * sbh)]
    return [Kernel("attention times V", "I", 2 * core, 3 * sbh + 2 * scores),
            Kernel("attention dropout", "I", 0, 2 * scores + mask),
            Kernel("softmax", "I", 0, 3 * scores),
            Kernel("attention scores", "I", 2 * core, scores + 4 * sbh)]


def _layer_forward(x: _Shape, attention: str) -> list[Kernel]:
    h, c, e = x.hidden, x.split(), x.whole()  # c: a GPU's split part; e: what it keeps whole
    sbh, mask = e.sbh, e.tokens * e.hidden
    return [Kernel("layer norm 1", "F", 0, 2 * sbh),
            _matmul("QKV", "F", x, h, 3 * c.hidden),
            *_attention(c, "F", attention),
            _matmul("out projection", "F", x, c.hidden, h),
            Kernel("dropout (attention)", "F", 0, 2 * sbh + mask),
            Kernel("residual add 1", "F", 0, 3 * sbh),
            Kernel("layer norm 2", "F", 0, 2 * sbh),
            _matmul("MLP up", "F", x, h, 4 * c.hidden),
            Kernel("GeLU", "F", 0, 2 * 4 * c.sbh),
            _matmul("MLP down", "F", x, 4 * c.hidden, h),
            Kernel("dropout (MLP)", "F", 0, 2 * sbh + mask),
            Kernel("residual add 2", "F", 0, 3 * sbh)]


def _layer_input_grad(x: _Shape, attention: str) -> list[Kernel]:
    """The backward to the block's input, last kernel first. A residual add's backward is the sum of the two
    gradients at its fork; a layer norm's reads the gradient and its input; GeLU's its gradient and its input."""
    h, c, e = x.hidden, x.split(), x.whole()
    sbh, mask = e.sbh, e.tokens * e.hidden
    return [Kernel("residual add 2", "I", 0, 3 * sbh),
            Kernel("dropout (MLP)", "I", 0, 2 * sbh + mask),
            _matmul("MLP down", "I", x, 4 * c.hidden, h),
            Kernel("GeLU", "I", 0, 3 * 4 * c.sbh),
            _matmul("MLP up", "I", x, h, 4 * c.hidden),
            Kernel("layer norm 2", "I", 0, 3 * sbh),
            Kernel("residual add 1", "I", 0, 3 * sbh),
            Kernel("dropout (attention)", "I", 0, 2 * sbh + mask),
            _matmul("out projection", "I", x, c.hidden, h),
            *_attention(c, "I", attention),
            _matmul("QKV", "I", x, h, 3 * c.hidden),
            Kernel("layer norm 1", "I", 0, 3 * sbh)]


def _layer_weight_grad(x: _Shape) -> list[Kernel]:
    h, c = x.hidden, x.split()
    return [_matmul("QKV", "W", x, h, 3 * c.hidden), _matmul("out projection", "W", x, c.hidden, h),
            _matmul("MLP up", "W", x, h, 4 * c.hidden), _matmul("MLP down", "W", x, 4 * c.hidden, h)]


def layer_kernels(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash",
                  tensor: int = 1, sequence: bool = False) -> list[Kernel]:
    """The kernels of one transformer block's F, I and W (pre-LN, as calibration/model.py's Block, plus the
    dropouts the ZB paper's M_B counts). Their FLOPs add up to ``layer_work``'s per pass. With ``tensor`` t, one
    GPU's share: matmuls, the attention core and GeLU over t; layer norms, dropouts and residuals whole unless
    ``sequence`` (docs/costs.md, "Tensor parallelism")."""
    check_attention(attention)
    x = _Shape.of(model, microbatch_size, precision, tensor, sequence)
    return [*_layer_forward(x, attention), *_layer_input_grad(x, attention), *_layer_weight_grad(x)]


def attention_core_kernels(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash",
                           tensor: int = 1) -> list[Kernel]:
    """The attention core's forward kernels on one of t GPUs: what selective recompute re-runs in the backward."""
    check_attention(attention)
    return _attention(_Shape.of(model, microbatch_size, precision, tensor).split(), "F", attention)


def output_kernels(model: ModelSpec, microbatch_size: int, precision: str, tensor: int = 1,
                   sequence: bool = False) -> list[Kernel]:
    """The output layer's kernels: final layer norm, logits, softmax (kept in fp32 for cross-entropy, as the
    ledger counts), cross-entropy (F: each token's target probability; I: d logits = softmax - one-hot, fused).
    Their FLOPs add up to ``output_layer_flops``; with ``tensor`` t, one GPU's vocabulary slice."""
    x = _Shape.of(model, microbatch_size, precision, tensor, sequence)
    h, v, sbh = x.hidden, x.split().vocab, x.whole().sbh
    logits, targets = x.tokens * v, 8 * x.tokens  # int64 targets
    return [Kernel("final layer norm", "F", 0, 2 * sbh),
            _matmul("logits", "F", x, h, v),
            Kernel("softmax", "F", 0, logits * (x.act + 4)),
            Kernel("cross-entropy", "F", 0, 4 * x.tokens + targets),
            Kernel("cross-entropy", "I", 0, logits * (4 + x.act) + targets),
            _matmul("logits", "I", x, h, v),
            Kernel("final layer norm", "I", 0, 3 * sbh),
            _matmul("logits", "W", x, h, v)]


def optimizer_kernels(params: int, precision: str) -> list[Kernel]:
    """One optimizer step over ``params`` parameters, each pass reading and writing every parameter's bytes once
    (fused kernels): the gradient norm reads the gradients, clipping scales them in place, and AdamW reads the
    gradient, its fp32 state (master copy where mixed precision keeps one, else the weights themselves) and
    writes the state and the weights the next forward reads."""
    p = PRECISIONS[precision]
    read = p.grad_bytes + p.optimizer_bytes + (p.weight_bytes if p.master_bytes == 0 else 0)
    write = p.optimizer_bytes + p.weight_bytes
    return [Kernel("gradient norm", "optimizer", 0, params * p.grad_bytes),
            Kernel("gradient clipping", "optimizer", 0, 2 * params * p.grad_bytes),
            Kernel("AdamW", "optimizer", 0, params * (read + write))]


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
        """``gpt-1.3b``; ``gpt-1.3b with layers=4`` where dimensions differ from the preset's; ``custom with ...``
        when every dimension is given and no preset is named."""
        given = {key: getattr(self, key) for key in SHAPE_KEYS if getattr(self, key) is not None}
        name = self.preset or ("custom" if len(given) == len(SHAPE_KEYS) else DEFAULT_PRESET)
        base = PRESETS.get(name)
        changed = [f"{key}={value}" for key, value in given.items() if base is None or getattr(base, key) != value]
        return f"{name} with {', '.join(changed)}" if changed else name
