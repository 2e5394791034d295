"""The kernels of each pass: a transformer block's, the output layer's and the optimizer step's, with the FLOPs and
bytes of each and, for a matmul or a flash-attention kernel, the shape its GPU rate depends on (docs/costs.md, "The
kernels"). They are the kernels Megatron-LM runs: fused layer norms, fused bias-GeLU, fused bias-dropout-add, flash
attention or the fused scale-mask-softmax beside two batched matmuls, the vocabulary-parallel cross-entropy over fp32
logits, and a fused Adam (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipescope.simulator.models import FLASH_STATS_BYTES, PRECISIONS, ModelSpec, check_attention

PASSES = ("F", "I", "W", "optimizer")


@dataclass(frozen=True)
class Gemm:
    """What a GPU rate model needs of a matmul: ``batch`` independent products, each ``rows`` x ``cols`` outputs
    summed over ``inner`` (its output tiles and how many waves of them the GPU runs; ``simulator/gpu_rates.py``)."""

    batch: int
    rows: int
    cols: int
    inner: int
    aligned: bool = True  # every stored row a multiple of 16 bytes (``is_aligned``): what cuBLAS's fast kernels need


@dataclass(frozen=True)
class Flash:
    """A flash-attention kernel's work in FlashAttention's own convention, which its measured rates use: forward
    ``4 s^2 d`` per head and sample, halved by the causal mask, the backward 2.5 times that; at ``seq`` and
    ``head_dim``, on which the rate depends."""

    flops: float
    seq: int
    head_dim: int


@dataclass(frozen=True)
class Kernel:
    """One kernel of a pass for one microbatch (the optimizer's: once per iteration).

    ``flops`` are model FLOPs, the MFU convention's: the matmuls' (the s x s ones included). Element-wise,
    normalisation and softmax passes carry 0: their few FLOPs are not counted there, and they are bound by
    memory anyway. ``nbytes`` is what the kernel reads plus what it writes. ``gemm`` and ``flash`` say what a
    matmul or a flash-attention kernel is, for its rate; a kernel with neither streams memory.
    """

    name: str
    op: str  # one of PASSES
    flops: float
    nbytes: float
    gemm: Gemm | None = None
    flash: Flash | None = None
    scores: bool = False  # moves eager attention's s x s scores, at the GPU's measured eager rate (gpu_rates.Roofline)


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
    kv: int = 0  # the keys' (and values') width: ModelSpec.kv_width
    ffn: int = 0  # the MLP's inner width
    llama: bool = False  # the family's block (docs/costs.md, "Llama")

    @classmethod
    def of(cls, model: ModelSpec, microbatch_size: int, precision: str, tensor: int = 1,
           sequence: bool = False, context: int = 1) -> _Shape:
        """The block's sizes on one GPU: under context parallelism its 1/``context`` of the tokens, whose queries
        attend to all ``seq`` keys (``simulator/context.py``)."""
        p = PRECISIONS[precision]
        return cls(model.seq * microbatch_size // context, model.hidden, model.seq, model.heads, model.vocab,
                   p.activation_bytes, p.weight_bytes, p.grad_bytes, tensor, sequence, model.kv_width, model.ffn,
                   model.family == "llama")

    def split(self) -> _Shape:
        """What one of t GPUs holds of a Megatron-split block: hidden, heads, key/value and MLP widths and
        vocabulary over t (ceil)."""
        t = self.tensor
        return replace(self, hidden=self.hidden // t, heads=self.heads // t, vocab=-(-self.vocab // t), tensor=1,
                       kv=self.kv // t, ffn=self.ffn // t)

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

    @property
    def samples_heads(self) -> int:
        """The batched matmuls' batch: one product per sample and head."""
        return self.tokens // self.seq * self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_bytes(self) -> int:
        """Bytes of Q, K and V together (with grouped-query attention K and V are narrower than Q)."""
        return self.tokens * (self.hidden + 2 * self.kv) * self.act


ALIGNMENT_BYTES = 16  # cuBLAS's fast tensor-core kernels need every row of A, B and C to start on 16 bytes


def is_aligned(widths: tuple[int, ...], element_bytes: int) -> bool:
    """Whether rows of these widths (elements) all start on ``ALIGNMENT_BYTES``. A Linear's rows are its input and
    output widths (x is t x k, W is n x k, y and dy are t x n); the token count is never a row width, so it may be
    anything (on an H200 an odd token count ran at the aligned rate, an odd width at 12-22% of it:
    docs/costs.md, "Aligned and misaligned matmuls")."""
    return all(w * element_bytes % ALIGNMENT_BYTES == 0 for w in widths)


def _matmul(name: str, op: str, x: _Shape, k: int, n: int, allocated: int | None = None) -> Kernel:
    """A Linear of k inputs and n outputs over the tokens. F: y = x W^T (t x n outputs over k); I: dx = dy W (t x k
    over n, the same bytes mirrored); W: dW += dy^T x (n x k over t), the gradient read and written in the gradient's
    precision. ``allocated``: the output width the runtime allocates when it pads n (Megatron's vocabulary), which
    decides alignment; the work stays n's."""
    t = x.tokens
    activations = (t * k + t * n) * x.act
    weights = 2 * k * n * x.grad if op == "W" else k * n * x.weight
    aligned = is_aligned((k, allocated or n), x.act)
    gemm = {"F": Gemm(1, t, n, k, aligned), "I": Gemm(1, t, k, n, aligned), "W": Gemm(1, n, k, t, aligned)}[op]
    return Kernel(name, op, 2.0 * t * k * n, activations + weights, gemm)


def _attention(x: _Shape, op: str, attention: str) -> list[Kernel]:
    """The attention core of F or I: 2*t*s*h FLOPs per s x s matmul, two in F and four in I."""
    core = 2.0 * x.tokens * x.seq * x.hidden
    sbh, scores = x.sbh, x.scores * x.act
    mask = x.scores  # the attention dropout's 1-byte mask
    if attention == "flash":  # one fused kernel: Q, K, V in, O out (I: dO, O in; dQ, dK, dV out); stats only
        forward = core  # FlashAttention's count: 4 s^2 d per head and sample (2 core), halved by the causal mask
        if op == "F":
            return [Kernel("flash attention", "F", 2 * core, x.qkv_bytes + sbh + x.stats,
                           flash=Flash(forward, x.seq, x.head_dim))]
        return [Kernel("flash attention", "I", 4 * core, 2 * x.qkv_bytes + 2 * sbh + 2 * x.stats,
                       flash=Flash(2.5 * forward, x.seq, x.head_dim))]
    s, d, batch = x.seq, x.head_dim, x.samples_heads
    if op == "F":  # Q K^T; the fused scale-mask-softmax; its dropout; P V
        return [Kernel("attention scores", "F", core, 2 * sbh + scores, Gemm(batch, s, s, d), scores=True),
                Kernel("softmax", "F", 0, 2 * scores, scores=True),
                Kernel("attention dropout", "F", 0, 2 * scores + mask, scores=True),
                Kernel("attention times V", "F", core, scores + 2 * sbh, Gemm(batch, s, d, s), scores=True)]
    # dQ = dS K and dK = dS^T Q are two products, each reading the scores' gradient dS
    return [Kernel("attention times V (probabilities)", "I", core, 2 * sbh + scores, Gemm(batch, s, s, d), scores=True),
            Kernel("attention times V (values)", "I", core, scores + 2 * sbh, Gemm(batch, s, d, s), scores=True),
            Kernel("attention dropout", "I", 0, 2 * scores + mask, scores=True),
            Kernel("softmax", "I", 0, 3 * scores, scores=True),
            Kernel("attention scores", "I", 2 * core, 2 * scores + 4 * sbh, Gemm(2 * batch, s, d, s), scores=True)]


def _layer_forward(x: _Shape, attention: str) -> list[Kernel]:
    """Megatron fuses each residual branch's bias, dropout and residual add into one kernel: it reads the branch's
    output and the residual and writes the sum and the dropout's 1-byte mask. A Llama block has RMSNorms, rotary
    positions applied to Q and K, no biases or dropouts, and a SwiGLU MLP whose gate and up projections are one
    matmul (Megatron's fused ``linear_fc1``)."""
    if x.llama:
        return _llama_forward(x, attention)
    h, c, e = x.hidden, x.split(), x.whole()  # c: a GPU's split part; e: what it keeps whole
    sbh, mask = e.sbh, e.tokens * e.hidden
    return [Kernel("layer norm 1", "F", 0, 2 * sbh),
            _matmul("QKV", "F", x, h, c.hidden + 2 * c.kv),
            *_attention(c, "F", attention),
            _matmul("out projection", "F", x, c.hidden, h),
            Kernel("bias-dropout-add 1", "F", 0, 3 * sbh + mask),
            Kernel("layer norm 2", "F", 0, 2 * sbh),
            _matmul("MLP up", "F", x, h, c.ffn),
            Kernel("bias-GeLU", "F", 0, 2 * c.tokens * c.ffn * c.act),
            _matmul("MLP down", "F", x, c.ffn, h),
            Kernel("bias-dropout-add 2", "F", 0, 3 * sbh + mask)]


def _llama_forward(x: _Shape, attention: str) -> list[Kernel]:
    h, c, e = x.hidden, x.split(), x.whole()
    sbh, inner = e.sbh, c.tokens * c.ffn * c.act
    rotated = c.tokens * (c.hidden + c.kv) * c.act  # Q and K
    return [Kernel("RMSNorm 1", "F", 0, 2 * sbh),
            _matmul("QKV", "F", x, h, c.hidden + 2 * c.kv),
            Kernel("rotary", "F", 0, 2 * rotated),
            *_attention(c, "F", attention),
            _matmul("out projection", "F", x, c.hidden, h),
            Kernel("residual add 1", "F", 0, 3 * sbh),
            Kernel("RMSNorm 2", "F", 0, 2 * sbh),
            _matmul("MLP up", "F", x, h, 2 * c.ffn),
            Kernel("SwiGLU", "F", 0, 3 * inner),  # gate and up in, their product out
            _matmul("MLP down", "F", x, c.ffn, h),
            Kernel("residual add 2", "F", 0, 3 * sbh)]


def _layer_input_grad(x: _Shape, attention: str) -> list[Kernel]:
    """The backward to the block's input, last kernel first. A residual add's backward is the sum of the two
    gradients at its fork; a layer norm's reads the gradient and its input; GeLU's its gradient and its input;
    SwiGLU's its gradient and both inputs, writing both inputs' gradients."""
    if x.llama:
        return _llama_input_grad(x, attention)
    h, c, e = x.hidden, x.split(), x.whole()
    sbh, mask = e.sbh, e.tokens * e.hidden
    return [Kernel("residual add 2", "I", 0, 3 * sbh),
            Kernel("dropout (MLP)", "I", 0, 2 * sbh + mask),
            _matmul("MLP down", "I", x, c.ffn, h),
            Kernel("bias-GeLU", "I", 0, 3 * c.tokens * c.ffn * c.act),
            _matmul("MLP up", "I", x, h, c.ffn),
            Kernel("layer norm 2", "I", 0, 3 * sbh),
            Kernel("residual add 1", "I", 0, 3 * sbh),
            Kernel("dropout (attention)", "I", 0, 2 * sbh + mask),
            _matmul("out projection", "I", x, c.hidden, h),
            *_attention(c, "I", attention),
            _matmul("QKV", "I", x, h, c.hidden + 2 * c.kv),
            Kernel("layer norm 1", "I", 0, 3 * sbh)]


def _llama_input_grad(x: _Shape, attention: str) -> list[Kernel]:
    h, c, e = x.hidden, x.split(), x.whole()
    sbh, inner = e.sbh, c.tokens * c.ffn * c.act
    rotated = c.tokens * (c.hidden + c.kv) * c.act
    return [Kernel("residual add 2", "I", 0, 3 * sbh),
            _matmul("MLP down", "I", x, c.ffn, h),
            Kernel("SwiGLU", "I", 0, 5 * inner),
            _matmul("MLP up", "I", x, h, 2 * c.ffn),
            Kernel("RMSNorm 2", "I", 0, 3 * sbh),
            Kernel("residual add 1", "I", 0, 3 * sbh),
            _matmul("out projection", "I", x, c.hidden, h),
            *_attention(c, "I", attention),
            Kernel("rotary", "I", 0, 2 * rotated),
            _matmul("QKV", "I", x, h, c.hidden + 2 * c.kv),
            Kernel("RMSNorm 1", "I", 0, 3 * sbh)]


def _layer_weight_grad(x: _Shape) -> list[Kernel]:
    h, c = x.hidden, x.split()
    up = 2 * c.ffn if x.llama else c.ffn
    return [_matmul("QKV", "W", x, h, c.hidden + 2 * c.kv), _matmul("out projection", "W", x, c.hidden, h),
            _matmul("MLP up", "W", x, h, up), _matmul("MLP down", "W", x, c.ffn, h)]


def layer_kernels(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash",
                  tensor: int = 1, sequence: bool = False, context: int = 1) -> list[Kernel]:
    """The kernels of one transformer block's F, I and W (pre-LN, as Megatron's block, with the dropouts the ZB
    paper's M_B counts). Their FLOPs add up to ``layer_work``'s per pass. With ``tensor`` t, one GPU's share:
    matmuls, the attention core and GeLU over t; layer norms, dropouts and residuals whole unless ``sequence``
    (docs/costs.md, "Tensor parallelism"); with ``context`` cp, its 1/cp of the tokens."""
    check_attention(attention)
    x = _Shape.of(model, microbatch_size, precision, tensor, sequence, context)
    return [*_layer_forward(x, attention), *_layer_input_grad(x, attention), *_layer_weight_grad(x)]


def attention_core_kernels(model: ModelSpec, microbatch_size: int, precision: str, attention: str = "flash",
                           tensor: int = 1, context: int = 1) -> list[Kernel]:
    """The attention core's forward kernels on one of t GPUs: what selective recompute re-runs in the backward."""
    check_attention(attention)
    return _attention(_Shape.of(model, microbatch_size, precision, tensor, context=context).split(), "F", attention)


CROSS_ENTROPY_FORWARD_BYTES = 36  # per logit beyond its read: fp32 copy 4, max 4, subtract 8, exp 8, sum 4, divide 8
CROSS_ENTROPY_BACKWARD_BYTES = 12  # per logit beyond its write: the saved softmax scaled in place 8, read as fp32 4


def output_kernels(model: ModelSpec, microbatch_size: int, precision: str, tensor: int = 1,
                   sequence: bool = False, context: int = 1, allocated: int | None = None) -> list[Kernel]:
    """The output layer's kernels: final layer norm, logits, and Megatron's vocabulary-parallel cross-entropy
    (``cross_entropy.py``, not fused): F copies the logits to fp32, takes the row max, subtracts it in place, takes
    the exponentials into a new buffer, sums them and divides in place (the fp32 softmax it keeps for the backward);
    I scales that softmax in place and hands it to the logits' matmul. Their FLOPs add up to ``output_layer_flops``;
    with ``tensor`` t, one GPU's vocabulary slice; with ``context`` cp, its share of the tokens. ``allocated``: one
    GPU's slice as the runtime allocates it, padded (``models.allocated_vocab``); None: as it is."""
    x = _Shape.of(model, microbatch_size, precision, tensor, sequence, context)
    h, v, sbh = x.hidden, x.split().vocab, x.whole().sbh
    logits, targets = x.tokens * v, 8 * x.tokens  # int64 targets
    norm = "final RMSNorm" if x.llama else "final layer norm"
    return [Kernel(norm, "F", 0, 2 * sbh),
            _matmul("logits", "F", x, h, v, allocated),
            Kernel("cross-entropy", "F", 0, logits * (x.act + CROSS_ENTROPY_FORWARD_BYTES) + targets),
            Kernel("cross-entropy", "I", 0, logits * (x.act + CROSS_ENTROPY_BACKWARD_BYTES) + targets),
            _matmul("logits", "I", x, h, v, allocated),
            Kernel(norm, "I", 0, 3 * sbh),
            _matmul("logits", "W", x, h, v, allocated)]


def gradient_bytes(precision: str, grad_bytes: int | None = None) -> int:
    """Bytes per gradient: ``grad_bytes`` as the runtime keeps them, else the precision's."""
    return PRECISIONS[precision].grad_bytes if grad_bytes is None else grad_bytes


def optimizer_kernels(params: int, precision: str, grad_bytes: int | None = None) -> list[Kernel]:
    """One optimizer step over ``params`` parameters, each pass reading and writing every parameter's bytes once
    (fused multi-tensor kernels): fp16 unscales its loss-scaled gradients (and checks them for infinities), the
    gradient norm reads the gradients, clipping scales them in place, and AdamW reads the gradient, its fp32 state
    (master copy where mixed precision keeps one, else the weights themselves) and writes the state and the weights
    the next forward reads. ``grad_bytes``: per gradient, as the runtime keeps it (default the precision's)."""
    p = PRECISIONS[precision]
    g = gradient_bytes(precision, grad_bytes)
    read = g + p.optimizer_bytes + (p.weight_bytes if p.master_bytes == 0 else 0)
    write = p.optimizer_bytes + p.weight_bytes
    unscale = [Kernel("loss-scale unscale", "optimizer", 0, 2 * params * g)] if precision == "fp16" else []
    return [*unscale, Kernel("gradient norm", "optimizer", 0, params * g),
            Kernel("gradient clipping", "optimizer", 0, 2 * params * g),
            Kernel("AdamW", "optimizer", 0, params * (read + write))]
