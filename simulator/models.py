"""Transformer model shapes, their FLOPs and activation bytes (docs/schedules.md sections 5 and 7), the precision
table, and ``ModelConfig``, the model section of the config. The kernels of each pass are in
``simulator/kernels.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipescope.simulator.readers.units import did_you_mean, short_repr


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


FAMILIES = ("gpt", "llama")  # model.family; docs/costs.md, "The kernels" and "Llama"


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: ``layers`` transformer blocks plus input embedding and output layer.

    ``family`` ``gpt``: GPT-2/Megatron's block (layer norms, biases, a GeLU MLP of ``ffn_hidden`` = 4h, learned
    positions, the output layer tied to the embedding); ``embedding_norm`` adds BLOOM's layer norm after the
    embedding (its input kept for the backward on the first stage). ``llama``: RMSNorm, no biases, a SwiGLU MLP of
    its own ``ffn_hidden`` (gate, up and down), rotary positions, an untied output layer. Either may use
    grouped-query attention: ``kv_heads`` key/value heads (None: as many as ``heads``).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    family: str = "gpt"
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    embedding_norm: bool = False  # a layer norm on the embedding's output (BLOOM's ``--embed-layernorm``)

    @property
    def gated(self) -> bool:
        """SwiGLU's gate beside the up projection: three MLP matrices, not two."""
        return self.family == "llama"

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): kv heads x head dimension."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def ffn(self) -> int:
        """The MLP's inner width: ``ffn_hidden``, else GPT's 4h."""
        return self.ffn_hidden or 4 * self.hidden

    def matmul_params(self) -> int:
        """Weights of one block's matmuls: Q and out projection (h x h each), K and V (h x kv width each), the MLP
        (2 or, gated, 3 matrices of h x ffn). Its FLOPs are 2 per weight per token and pass."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * self.ffn

    def layer_params(self) -> int:
        """Parameters of one transformer block: the matmuls' weights, plus GPT's biases and layer norms (weight and
        bias) or Llama's two RMSNorm weights. GPT at 4h and full heads: 12h^2 + 13h."""
        h = self.hidden
        if self.family == "llama":
            return self.matmul_params() + 2 * h
        biases = (h + 2 * self.kv_width) + h + self.ffn + h  # QKV, out projection, MLP up, MLP down
        return self.matmul_params() + biases + 4 * h

    def position_params(self) -> int:
        """GPT's learned position embedding (Llama's rotary positions have none)."""
        return self.seq * self.hidden if self.family == "gpt" else 0

    def embedding_whole_params(self) -> int:
        """The embedding's parameters besides its token table, which tensor parallelism keeps whole on every GPU:
        GPT's positions and an embedding layer norm's weight and bias."""
        return self.position_params() + (2 * self.hidden if self.embedding_norm else 0)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.embedding_whole_params()

    def final_norm_params(self) -> int:
        """The norm before the output layer: GPT's layer norm (weight and bias), Llama's RMSNorm (weight)."""
        return self.hidden if self.family == "llama" else 2 * self.hidden

    def output_params(self) -> int:
        """The output projection (tied in GPT-2, counted here since pipelines hold a copy; Llama's is its own),
        plus the final norm."""
        return self.vocab * self.hidden + self.final_norm_params()

    def total_params(self) -> int:
        """The model's parameters, each once, as Hugging Face counts them: GPT's output layer is its embedding
        (tied), so only its final layer norm adds; Llama's output layer is its own."""
        tied = self.family == "gpt"
        return self.layers * self.layer_params() + self.embedding_params() + \
            (self.final_norm_params() if tied else self.output_params())


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
    # Llama 2 (Touvron et al. 2023, arXiv:2307.09288, Table 1: 4k context, GQA for 70B) and Llama 3 (Dubey et al.
    # 2024, arXiv:2407.21783, Table 3; 8k pre-training context), with the Hugging Face checkpoints' config.json
    # shapes (intermediate_size, num_key_value_heads, vocab_size); tests/test_llama.py checks their parameter counts
    "llama2-7b": ModelSpec("llama2-7b", layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, family="llama",
                           kv_heads=32, ffn_hidden=11008),
    "llama2-13b": ModelSpec("llama2-13b", layers=40, hidden=5120, heads=40, seq=4096, vocab=32000, family="llama",
                            kv_heads=40, ffn_hidden=13824),
    "llama2-70b": ModelSpec("llama2-70b", layers=80, hidden=8192, heads=64, seq=4096, vocab=32000, family="llama",
                            kv_heads=8, ffn_hidden=28672),
    "llama3-8b": ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, family="llama",
                           kv_heads=8, ffn_hidden=14336),
    "llama3-70b": ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, seq=8192, vocab=128256,
                            family="llama", kv_heads=8, ffn_hidden=28672),
    "llama3-405b": ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, seq=8192, vocab=128256,
                             family="llama", kv_heads=8, ffn_hidden=53248),
}


def preset(name: str, **overrides: int) -> ModelSpec:
    """A preset, optionally with some fields replaced; KeyError naming the choices if unknown."""
    if name not in PRESETS:
        raise KeyError(f"model.preset: got {name!r}, expected one of {', '.join(PRESETS)}{did_you_mean(name, PRESETS)}")
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


@dataclass(frozen=True)
class StashWidths:
    """Per token, the 2-byte-activation bytes one block keeps (docs/memory.md, "Activations per layer"): ``whole``
    what Megatron's tensor parallelism keeps whole on each GPU (layer-norm inputs, the column-parallel matmuls'
    inputs, GPT's dropout masks), ``split`` what it splits over t (Q, K, V, the attention output, the MLP's inner
    activations); ``weight_whole`` and ``weight_split`` the same for M_W (each matmul's input and output gradient);
    ``scores``: bytes per s x s element and head that eager attention keeps (GPT: softmax 2, dropout mask 1 and
    output 2; Llama, without dropout: softmax 2)."""

    whole: int
    split: int
    weight_whole: int
    weight_split: int
    scores: int


def stash_widths(model: ModelSpec) -> StashWidths:
    """GPT at 4h and full heads: 10h + 24h = the ZB paper's 34h and 8h + 24h = its 32h; Llama:
    8h + (4h + 4 kv + 6 ffn) and the same for M_W."""
    h, kv, ffn = model.hidden, model.kv_width, model.ffn
    mlp = 6 * ffn if model.gated else 4 * ffn  # gate and up outputs and the down input, or GeLU's input and output
    masks = 2 * h if model.family == "gpt" else 0  # two 1-byte dropout masks
    split = 4 * h + 4 * kv + mlp
    return StashWidths(8 * h + masks, split, 8 * h, split, 5 if model.family == "gpt" else 2)


def layer_work(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash") -> LayerWork:
    """FLOPs (the MFU convention, the same for both attentions) and bytes of one transformer block.

    FLOPs: 2 per matmul weight and token in F, I and W, plus the s x s products: ``4s^2bh`` in F, twice that in I
    (GPT: ``sbh(24h + 4s)``). ``M_B`` follows the attention: eager stashes the s x s scores, softmax and dropout mask
    of every head (the ZB paper's ``sb(34h + 5as)`` for GPT); flash stashes none of them, only a fp32 log-sum-exp
    per row and head (``34sbh + 4abs`` bytes).
    """
    check_attention(attention)
    s, b, h, a = model.seq, microbatch_size, model.hidden, model.heads
    width = PRECISIONS[precision].activation_bytes
    # The ZB paper's byte counts assume 2-byte activations; scale for fp32.
    scale = width / 2
    widths = stash_widths(model)
    per_token = widths.whole + widths.split
    if attention == "eager":
        stash = int(s * b * (per_token + widths.scores * a * s) * scale)
    else:
        stash = int(per_token * s * b * scale) + FLASH_STATS_BYTES * a * s * b
    matmuls = 2 * s * b * model.matmul_params()
    return LayerWork(
        forward_flops=matmuls + 4 * s * s * b * h,
        input_grad_flops=matmuls + 8 * s * s * b * h,
        weight_grad_flops=matmuls,
        activation_bytes=stash,
        weight_grad_bytes=int((widths.weight_whole + widths.weight_split) * s * b * scale),
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
# Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128) times the tensor
# degree (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding), so each GPU's slice is a multiple of 128
MEGATRON_VOCAB_MULTIPLE = 128
# The memory runtimes (``simulator.memory_runtime``) that run Megatron's model code: its padding, its checkpointing
MEGATRON_MODEL = ("megatron", "deepspeed")


def allocated_vocab(runtime: str, vocab: int, tensor: int = 1) -> int:
    """One GPU's slice of the output layer's vocabulary as ``runtime`` allocates it: Megatron's padded slice, or
    torch's vocabulary as it is, split over ``tensor`` GPUs (ceil). It decides whether the logits' matmuls are
    aligned (``kernels.is_aligned``); the work is counted on the vocabulary itself."""
    if runtime in MEGATRON_MODEL:
        unit = MEGATRON_VOCAB_MULTIPLE * tensor
        return -(-vocab // unit) * unit // tensor
    return -(-vocab // tensor)


SHAPE_KEYS = ("layers", "hidden", "heads", "seq", "vocab")
ARCH_KEYS = ("family", "kv_heads", "ffn_hidden", "embedding_norm")  # what sets a Llama or a BLOOM apart
SPEC_KEYS = SHAPE_KEYS + ARCH_KEYS
# Inclusive (low, high) of each integer model dimension (docs/cli.md, "Limits"); the config's RANGES and
# ``model.from_hf``'s values both answer to them
DIMENSION_RANGES: dict[str, tuple[int, int]] = {
    "layers": (1, 100_000), "hidden": (1, 1 << 20), "heads": (1, 1 << 20), "seq": (1, 1 << 24),
    "vocab": (1, 1 << 24), "kv_heads": (1, 1 << 20), "ffn_hidden": (1, 1 << 24),
}


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` section: a preset, or a Hugging Face ``config.json`` (``from_hf``), optionally with some
    dimensions replaced, the microbatch and precision, optionally the transformer blocks of each stage
    (``layers_per_stage``, checked by ``stage_layers``), and the attention implementation (``flash`` or ``eager``;
    analytic costs read it).

    ``preset`` and ``from_hf`` unset mean ``DEFAULT_PRESET``, except under profiled costs, where the profile's model
    is the run's.
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
    family: str | None = None  # one of FAMILIES; None: the preset's or the file's
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    embedding_norm: bool | None = None  # None: the preset's or the file's (none has one)
    from_hf: str | None = None  # a Hugging Face config.json (simulator/hf_config.py)

    def spec(self) -> ModelSpec:
        """The model's shape.

        Raises:
            ValueError: naming the key: an unknown preset, a preset beside ``from_hf``, a bad ``from_hf`` file or a
                dimension in it out of range, heads that do not divide hidden or kv heads that do not divide heads.
        """
        spec = replace(self._base(), **self._given())
        source = f" (from model.from_hf {short_repr(self.from_hf)})" if self.from_hf is not None else ""
        if spec.hidden % spec.heads:
            raise ValueError(f"model.heads: got {spec.heads}, expected a divisor of model.hidden (={spec.hidden})"
                             f"{source}")
        if spec.kv_heads is not None and spec.heads % spec.kv_heads:
            raise ValueError(f"model.kv_heads: got {spec.kv_heads}, expected a divisor of model.heads (={spec.heads}): "
                             f"each key/value head serves a whole group of query heads{source}")
        return spec

    def _base(self) -> ModelSpec:
        """The preset's shape, or the ``from_hf`` file's, each dimension of which is checked against the limits."""
        if self.from_hf is None:
            try:
                return preset(self.preset or DEFAULT_PRESET)
            except KeyError as err:
                raise ValueError(err.args[0]) from None
        if self.preset is not None:
            raise ValueError(f"model.from_hf: got {short_repr(self.from_hf)} with model.preset {self.preset!r}, "
                             f"expected one of the two")
        from pipescope.simulator.hf_config import read_hf_config  # a file's reader, loaded only when one is named

        given = self._given()  # set beside the file: they replace its values, so those are not read
        shape = read_hf_config(self.from_hf, frozenset(given))
        for key, value in shape.items():
            low, high = DIMENSION_RANGES.get(key, (value, value))
            if not low <= value <= high:
                raise ValueError(f"model.{key}: got {value} from model.from_hf {short_repr(self.from_hf)}, expected "
                                 f"{low:,} to {high:,}")
        return ModelSpec(name=f"{shape['family']} from {_file_label(self.from_hf)}", **{**shape, **given})

    def _given(self) -> dict[str, int | str | bool]:
        """The shape and architecture keys this section sets."""
        return {key: getattr(self, key) for key in SPEC_KEYS if getattr(self, key) is not None}

    @property
    def label(self) -> str:
        """``gpt-1.3b`` when the shape is the preset's; else the shape by its dimensions, those left unset named as
        the preset's (``GPT layers=96, hidden=12288 (heads=16, seq=2048, vocab=50257 from gpt-1.3b)``), so a custom
        shape never reads as a preset. A ``from_hf`` model is named by its file (``llama from
        Meta-Llama-3-8B/config.json``), with what was set beside it."""
        given = self._given()
        shape = ", ".join(f"{key}={value}" for key, value in given.items())
        if self.from_hf is not None:
            try:
                name = self._base().name
            except ValueError:
                name = _file_label(self.from_hf)
            return name + (f" with {shape}" if shape else "")
        name = self.preset or DEFAULT_PRESET
        base = PRESETS.get(name)
        if base is None or all(getattr(base, key) == value for key, value in given.items()):
            return name
        unset = [f"{key}={getattr(base, key)}" for key in SHAPE_KEYS if key not in given]
        family = "GPT" if (self.family or base.family) == "gpt" else "Llama"
        return f"{family} {shape}" + (f" ({', '.join(unset)} from {name})" if unset else "")


def _file_label(path: str) -> str:
    """A file by its folder and name (``Meta-Llama-3-8B/config.json``): enough to tell models apart."""
    parts = str(path).replace("\\", "/").rstrip("/").split("/")
    return "/".join(parts[-2:])
