"""``python -m pipescope.calibration.probes OUT``: the few measurements the cost model's named terms rest on, timed
on a lent GPU in about two minutes (docs/validation.md, "The probes").

The probes, each written to ``OUT/probes.json``:

- ``optimizer``: one stage's optimizer step taken apart (a ``gpt-1.3b`` middle stage, fp32 as the executor runs it):
  AdamW's ``step()`` on separate gradients (what ``calibrate`` times), on gradients that are views of one flat buffer
  (what the executor steps), zeroing that buffer, the gradient norm (a host sync per buffer), the executor's whole op
  timed from an idle GPU, and torch's fused AdamW (what Megatron's fused Adam is like).
- ``alignment``: one GEMM with each width in turn one short of a multiple of 8 (and its token count).
- ``gemm_layouts``: every linear of a transformer layer in the three layouts a training step multiplies in:
  forward ``x @ W.T``, the input gradient ``dy @ W`` and the weight gradient ``dy.T @ x`` (bf16), at hidden sizes of
  the published runs; and the output layer at GPT-2's vocabulary (50,257) against its padded size (50,304), whole
  and in 8 shards.
- ``launch``: the host's time per eager PyTorch kernel launch when the GPU outruns it (a one-element add, a small
  linear, a small layer norm), and a small GPT block's forward and backward per kernel they launch.
- ``streaming``: a copy's and a fill's bytes per second; ``attention``: torch's causal attention at several sequence
  lengths and head dimensions.
- ``elementwise``: eager attention's memory-bound kernels on its scores (softmax, dropout, and their backwards)
  beside a copy of the same tensor: whether each streams at the copy's rate on the cost model's byte count (dropout's
  forward draws a random number per element, its backward does not).
- ``sustained``: a GEMM and a GPT block's forward and backward, each run back to back for tens of seconds, their rate
  per second beside the SM clock, power and temperature: what a GPU holds under a step's continuous load; with
  ``--block-samples`` the block again at those microbatch sizes, whose kernels draw less power.
- ``eager_layer``: Megatron's layer with eager attention at the published runs' shapes, its forward and backward
  and its attention core's, then under load with the power readings (``EagerLayer``).
- ``device``: what ran it (name, clocks, versions).

Every GPU time is CUDA events on the current stream, L2 flushed (``timing.CudaTimer``); host times are
``perf_counter_ns`` with the GPU synchronised before and after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipescope.calibration import env
from pipescope.calibration.model import Block
from pipescope.calibration.ops import attach_flat_grads
from pipescope.calibration.timing import Bench, Timer, TimingConfig, make_timer

PROBES = ("launch", "optimizer", "gemm_layouts", "alignment", "attention", "streaming", "elementwise", "sustained",
          "eager_layer")


@dataclass(frozen=True)
class Sizes:
    """What the probes run at: a GPU's sizes (``GPU``), or small ones that rehearse every probe on a CPU in seconds."""

    stage: tuple[int, int, int] = (6, 2048, 16)  # layers, hidden, heads: gpt-1.3b's 24 layers over 4 stages
    gemm_hidden: tuple[int, ...] = (2048, 4096, 8192, 12288)  # gpt-1.3b and the published runs' widths
    gemm_tokens: tuple[int, ...] = (2048, 8192)  # one sequence of 2048 tokens; four of them
    logits_hidden: tuple[int, ...] = (2048, 12288)
    vocabs: tuple[int, int] = (50257, 50304)  # GPT-2's vocabulary, and Megatron's padding of it (a multiple of 128)
    alignment: tuple[int, int, int] = (8192, 8192, 4096)  # tokens, out, in of the GEMM whose widths are varied
    head_dims: tuple[int, ...] = (64, 128)
    seqs: tuple[int, ...] = (1024, 2048, 4096, 8192)
    attention_tokens: int = 16384  # samples x sequence of each attention probe
    attention_width: int = 2048  # heads x head dimension
    stream_bytes: int = 1 << 30
    launches: int = 2000
    sustained: tuple[int, float] = (8192, 40.0)  # GEMM side and seconds of back-to-back work under full load
    sustained_block: tuple[int, int] = (8, 1024)  # samples and sequence of the block run under load (``stage``'s)
    block_samples: tuple[int, ...] = ()  # the block under load again at these microbatch sizes (``block-<b>``)
    scores: tuple[int, int] = (96, 1024)  # batch x heads and sequence of eager attention's scores: Qi et al.'s 6.2B
    # (hidden, heads, seq, samples) of the eager-attention layers the published runs ran on A100s: Qi et al.'s 1.5B
    # and 6.2B (their measured passes are furthest from the model's in F), Narayanan et al.'s 1.7B (its whole step)
    eager_layers: tuple[tuple[int, int, int, int], ...] = ((2304, 24, 1024, 6), (4096, 32, 1024, 3),
                                                           (2304, 24, 2048, 16))
    eager_load_s: float = 20.0  # the first eager layer back to back under load, with the power readings


GPU = Sizes()
PROBE_TIMING = TimingConfig(budget_s=0.3, max_reps=50)  # at most 0.3 s a measurement
CPU_REHEARSAL = Sizes(stage=(1, 64, 4), gemm_hidden=(64,), gemm_tokens=(128,), logits_hidden=(64,), vocabs=(257, 264),
                      alignment=(128, 128, 64), head_dims=(16,), seqs=(64,), attention_tokens=128, attention_width=64,
                      stream_bytes=1 << 22, launches=50, sustained=(128, 1.0),
                      sustained_block=(1, 32), block_samples=(2,), scores=(4, 32), eager_layers=((64, 4, 32, 2),),
                      eager_load_s=1.0)


def default_sizes(device: torch.device) -> Sizes:
    """A GPU's sizes on CUDA, the rehearsal's on a CPU."""
    return GPU if device.type == "cuda" else CPU_REHEARSAL


def _dtype(device: torch.device) -> torch.dtype:
    """What the probes multiply in: bf16 on a GPU, as training does; fp32 on a CPU, as ``calibrate`` does there."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ns(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    """Wall ns per call of ``work`` over ``repeats`` calls, the device idle before and drained after."""
    work()
    _sync(device)
    start = time.perf_counter_ns()
    for _ in range(repeats):
        work()
    _sync(device)
    return (time.perf_counter_ns() - start) / repeats


def _stage_params(device: torch.device, sizes: Sizes) -> list[nn.Parameter]:
    layers, hidden, heads = sizes.stage
    blocks = [Block(hidden, heads) for _ in range(layers)]
    return [p for b in blocks for p in b.to(device).parameters()]


def _adamw(params: list[torch.Tensor], **options) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(params, lr=1e-4, **options)
    for p in params:  # gradients like a real step's: all-zero ones make AdamW slower on CPU
        if p.grad is None:
            p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # the state made, as after the first iteration
    return optimizer


def _flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.randn(sum(p.numel() for p in params), device=params[0].device) * 1e-3
    attach_flat_grads(params, flat)
    return flat


def optimizer_probe(device: torch.device, timing: TimingConfig, sizes: Sizes) -> dict:
    """The optimizer step's parts, in ns (see the module doc)."""
    timer = make_timer(device, timing)
    params = _stage_params(device, sizes)
    out: dict = {"params": sum(p.numel() for p in params), "tensors": len(params)}
    separate = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = _adamw(separate)
    out["step_separate_grads"] = timer.measure(Bench(lambda _, o=optimizer: o.step())).median_ns
    del optimizer, separate
    flat = _flat_grads(params)
    stepper = _adamw(params)
    out["step_flat_grads"] = timer.measure(Bench(lambda _: stepper.step())).median_ns
    out["zero_flat"] = timer.measure(Bench(lambda _: flat.zero_())).median_ns
    flat.normal_().mul_(1e-3)
    out["norm_gpu"] = timer.measure(Bench(lambda _: torch.linalg.vector_norm(flat))).median_ns
    out["norm_host_sync"] = host_ns(device, lambda: float(torch.linalg.vector_norm(flat)), 50)
    out["step_host_launch"] = _host_launch_ns(device, stepper.step, 20)

    def executor_op() -> None:  # what the executor's OPT row spans: from an idle GPU, the step then the zeroing
        stepper.step()
        flat.zero_()

    out["executor_op_host"] = host_ns(device, executor_op, 20)
    out["executor_op_idle_start"] = _idle_start_ns(device, executor_op, 20)
    for option in ("foreach", "fused"):
        try:
            variant = _adamw(params, **{option: True})
        except (RuntimeError, ValueError) as exc:  # fused needs a floating device type torch supports
            out[f"step_{option}"] = f"unavailable: {exc}"
            continue
        out[f"step_{option}"] = timer.measure(Bench(lambda _, o=variant: o.step())).median_ns
        del variant
    return out


def _host_launch_ns(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    """Host ns to issue ``work`` (the device drained between calls, so the queue never pushes back)."""
    total = 0
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter_ns()
        work()
        total += time.perf_counter_ns() - start
    _sync(device)
    return total / repeats


def _idle_start_ns(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    """Event-timed ns of ``work`` issued to an idle GPU (as an op after a host sync runs): the GPU time plus what it
    waits for the host's launches. Host wall time on CPU."""
    if device.type != "cuda":
        return host_ns(device, work, repeats)
    spans = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize(device)
        spans.append(start.elapsed_time(end) * 1e6)
    return sorted(spans)[len(spans) // 2]


def linear_shapes(sizes: Sizes) -> list[tuple[str, int, int, int]]:
    """(name, tokens, out, in) of every linear of a layer at each width and token count, then the output layer."""
    shapes = []
    for h in sizes.gemm_hidden:
        for t in sizes.gemm_tokens:
            shapes += [("qkv", t, 3 * h, h), ("proj", t, h, h), ("fc1", t, 4 * h, h), ("fc2", t, h, 4 * h)]
    for h in sizes.logits_hidden:
        for t in sizes.gemm_tokens:
            shapes += [(f"logits-{v}", t, v, h) for v in sizes.vocabs]
            shapes += [(f"logits-{v}/8", t, -(-v // 8), h) for v in sizes.vocabs]
    return shapes


def gemm_probe(device: torch.device, timing: TimingConfig, shapes: list[tuple[str, int, int, int]]) -> list[dict]:
    """Each shape's forward, input-gradient and weight-gradient GEMM: ns and TFLOP/s."""
    timer = make_timer(device, timing)
    dtype = _dtype(device)
    rows = []
    for index, (name, t, n, k) in enumerate(shapes, 1):
        for layout, work in _layouts(*(torch.randn(*s, device=device, dtype=dtype) for s in ((t, k), (n, k), (t, n)))):
            ns = timer.measure(Bench(lambda _, work=work: work())).median_ns
            rows.append({"name": name, "tokens": t, "out": n, "in": k, "layout": layout, "ns": ns,
                         "tflops": 2 * t * n * k / ns / 1e3})
        print(f"probes: gemm {index}/{len(shapes)} {name} {t} x {n} x {k}: "
              + ", ".join(f"{r['layout']} {r['tflops']:.0f}" for r in rows[-3:]) + " TFLOP/s",
              file=sys.stderr, flush=True)
    return rows


def _layouts(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """A Linear's three products: forward x W^T, input gradient dy W, weight gradient dy^T x."""
    return [("forward", lambda: F.linear(x, w)), ("dgrad", lambda: dy @ w), ("wgrad", lambda: dy.t() @ x)]


def launch_probe(device: torch.device, sizes: Sizes) -> dict:
    """Host ns per launched op, and a small block's host ns per kernel it runs."""
    one = torch.zeros(1, device=device)
    small = torch.randn(8, 64, device=device)
    linear, norm = nn.Linear(64, 64).to(device), nn.LayerNorm(64).to(device)
    out = {
        "add_one_element": host_ns(device, lambda: one.add_(1), sizes.launches),
        "linear_8x64": host_ns(device, lambda: linear(small), sizes.launches // 4),
        "layer_norm_8x64": host_ns(device, lambda: norm(small), sizes.launches // 4),
    }
    block = Block(64, 4).to(device)
    x = torch.randn(1, 128, 64, device=device, requires_grad=True)

    def forward_backward() -> None:
        block(x).sum().backward()

    for name, work in (("block_forward", lambda: block(x)), ("block_forward_backward", forward_backward)):
        out[name] = host_ns(device, work, 50)
        out[f"{name}_kernels"] = _kernel_count(device, work)
    return out


def _kernel_count(device: torch.device, work: Callable[[], object]) -> int | None:
    """Kernels one call of ``work`` launches (torch.profiler; None on CPU or when the profiler fails)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            work()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception as exc:  # noqa: BLE001 - a probe that cannot count still reports its times
        print(f"probes: kernel count failed: {exc}", file=sys.stderr)
        return None


def alignment_shapes(sizes: Sizes) -> list[tuple[str, int, int, int]]:
    """One GEMM with each of its dimensions in turn one short of a multiple of 8, and its output 8 and 64 wider."""
    t, n, k = sizes.alignment
    return [("aligned", t, n, k), ("tokens-odd", t - 1, n, k), ("out-odd", t, n - 1, k), ("in-odd", t, n, k - 1),
            ("out+8", t, n + 8, k), ("out+64", t, n + 64, k)]


def attention_probe(device: torch.device, timing: TimingConfig, sizes: Sizes) -> list[dict]:
    """torch's scaled_dot_product_attention, causal, bf16: forward and forward + backward ns, and TFLOP/s on
    FlashAttention's own count (a causal forward is half of 4 s^2 d per head and sample, the backward 2.5 times it)."""
    timer = make_timer(device, timing)
    dtype = _dtype(device)
    rows = []
    for head_dim in sizes.head_dims:
        for seq in sizes.seqs:
            rows.append(_attention_row(timer, device, dtype, head_dim, seq, sizes))
            print(f"probes: attention d={head_dim} s={seq}: {rows[-1]['forward_backward_tflops']:.0f} TFLOP/s",
                  file=sys.stderr, flush=True)
    return rows


def _attention_row(timer: Timer, device: torch.device, dtype: torch.dtype, head_dim: int, seq: int,
                   sizes: Sizes) -> dict:
    batch, heads = max(1, sizes.attention_tokens // seq), sizes.attention_width // head_dim
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    flops = 4 * seq * seq * head_dim * batch * heads / 2
    f_ns = timer.measure(Bench(lambda _: forward())).median_ns
    fb_ns = timer.measure(Bench(lambda _: forward().backward(grad))).median_ns
    return {"head_dim": head_dim, "seq": seq, "batch": batch, "heads": heads, "forward_ns": f_ns,
            "forward_backward_ns": fb_ns, "forward_tflops": flops / f_ns / 1e3,
            "forward_backward_tflops": 3.5 * flops / fb_ns / 1e3}


def sustained_probe(device: torch.device, sizes: Sizes) -> dict:
    """Work under a training step's continuous load for ``sizes.sustained`` seconds each: a square bf16 GEMM back
    to back, then a GPT block's forward and backward (``stage``'s width, ``sustained_block`` tokens). TFLOP/s (the
    block: iterations/s) per one-second window, and ``nvidia-smi``'s SM clock, power and temperature every second
    meanwhile (CUDA), so the burst rate a short benchmark sees and the rate a GPU holds under load can be set side by
    side."""
    side, seconds = sizes.sustained
    dtype = _dtype(device)
    a, b = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    hidden = sizes.stage[1]
    block = Block(hidden, sizes.stage[2]).to(device=device, dtype=dtype)
    x = torch.randn(*sizes.sustained_block, hidden, device=device, dtype=dtype, requires_grad=True)
    blocks = {f"block-{b}": torch.randn(b, sizes.sustained_block[1], hidden, device=device, dtype=dtype,
                                        requires_grad=True) for b in sizes.block_samples}
    out = {"side": side}
    work = [("gemm", lambda: torch.matmul(a, b), 2 * side**3 / 1e12), ("block", lambda: block(x).sum().backward(), 1.0)]
    work += [(name, lambda t=t: block(t).sum().backward(), 1.0) for name, t in blocks.items()]
    for name, step, per_call in work:
        with _gpu_monitor(device) as samples:
            out[name] = {"windows": _windows(device, step, seconds, per_call), "gpu": samples}
    return out


def _windows(device: torch.device, work: Callable[[], object], seconds: float, per_call: float) -> list[dict]:
    """``work`` back to back for ``seconds``: per one-second window, calls x ``per_call`` per second."""
    windows, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds:
        window_start, count = time.perf_counter(), 0
        while time.perf_counter() - window_start < 1.0:
            for _ in range(10):
                work()
            count += 10
            _sync(device)
        elapsed = time.perf_counter() - window_start
        windows.append({"t_s": round(time.perf_counter() - started, 2), "rate": count * per_call / elapsed})
    return windows


@contextmanager
def _gpu_monitor(device: torch.device) -> Iterator[list[dict]]:
    """``nvidia-smi`` sampling the SM clock (MHz), power (W) and temperature (C) every second while the body runs;
    the list is filled when it ends (empty on a CPU or without nvidia-smi)."""
    samples: list[dict] = []
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        yield samples
        return
    monitor = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader,nounits", "-lms", "1000", "-i", str(device.index or 0)],
                               stdout=subprocess.PIPE, text=True)
    try:
        yield samples
    finally:
        monitor.terminate()
        text, _ = monitor.communicate(timeout=10)
        for line in text.splitlines():
            try:
                clock, power, temperature = (float(v) for v in line.split(","))
            except ValueError:
                continue
            samples.append({"sm_mhz": clock, "power_w": power, "temperature_c": temperature})


def streaming_probe(device: torch.device, timing: TimingConfig, sizes: Sizes) -> dict:
    """Bytes per second of a copy (read + write) and of a fill (write) of ``sizes.stream_bytes`` (1 GiB on a GPU,
    far above its L2)."""
    timer = make_timer(device, timing)
    elements = sizes.stream_bytes // 4
    a, b = torch.empty(elements, device=device), torch.empty(elements, device=device)
    copy_ns = timer.measure(Bench(lambda _: b.copy_(a))).median_ns
    fill_ns = timer.measure(Bench(lambda _: b.fill_(1.0))).median_ns
    return {"bytes": 4 * elements, "copy_ns": copy_ns, "copy_bytes_per_s": 8 * elements / copy_ns * 1e9,
            "fill_ns": fill_ns, "fill_bytes_per_s": 4 * elements / fill_ns * 1e9}


def elementwise_probe(device: torch.device, timing: TimingConfig, sizes: Sizes) -> dict:
    """Eager attention's memory-bound kernels on scores of ``sizes.scores`` (batch x heads, seq, seq): ns each, and
    bytes per second on the bytes ``simulator/kernels.py`` counts for it (a softmax reads and writes each element,
    its backward reads two and writes one, a dropout reads one and writes one and a 1-byte mask, its backward reads
    one and the mask and writes one), beside a copy of the same tensor; ``of_copy`` is that rate over the copy's."""
    timer = make_timer(device, timing)
    bh, seq = sizes.scores
    x = torch.randn(bh, seq, seq, device=device, dtype=_dtype(device))
    y, grad, probs = torch.empty_like(x), torch.randn_like(x), torch.softmax(x, -1)
    mask = torch.ops.aten.native_dropout(x, 0.1, True)[1]
    e = x.element_size()
    kernels: dict[str, tuple[Callable[[object], object], int]] = {
        "copy": (lambda _: y.copy_(x), 2 * e),
        "softmax": (lambda _: torch.softmax(x, -1), 2 * e),
        "softmax_backward": (lambda _: torch.ops.aten._softmax_backward_data(grad, probs, -1, x.dtype), 3 * e),
        "dropout": (lambda _: torch.ops.aten.native_dropout(x, 0.1, True), 2 * e + 1),
        "dropout_backward": (lambda _: torch.ops.aten.native_dropout_backward(grad, mask, 1 / 0.9), 2 * e + 1),
    }
    rows = {}
    for name, (work, per_element) in kernels.items():
        ns = timer.measure(Bench(work)).median_ns
        rows[name] = {"ns": ns, "bytes_per_s": per_element * x.numel() / ns * 1e9}
    for row in rows.values():
        row["of_copy"] = row["bytes_per_s"] / rows["copy"]["bytes_per_s"]
    return {"shape": list(x.shape), "dtype": str(x.dtype), "kernels": rows}


class EagerLayer(nn.Module):
    """A GPT layer as Megatron-LM of 2021-2023 runs it without flash attention, on ``[s, b, h]`` activations:
    layer norm, QKV, the core (``baddbmm`` scaled by 1/sqrt(d), the causal mask, softmax, dropout 0.1, ``bmm`` with
    V, heads back to ``[s, b, h]``), the out projection, bias + dropout + residual, layer norm, the 4h MLP with a
    bias-GeLU, bias + dropout + residual. Megatron fuses scale, mask and softmax into one kernel; torch masks with
    ``masked_fill_`` first, a pass more over the scores, which ``eager_layer_probe`` times on its own."""

    def __init__(self, hidden: int, heads: int, seq: int):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Eager attention on ``[b*a, s, d]`` queries, keys and values; its ``[b*a, s, d]`` context."""
        scores = torch.baddbmm(torch.empty(q.shape[0], q.shape[1], k.shape[1], device=q.device, dtype=q.dtype),
                               q, k.transpose(1, 2), beta=0.0, alpha=self.dim ** -0.5)
        scores = scores.view(-1, self.heads, *scores.shape[1:]).masked_fill_(self.causal, -10000.0)
        probs = F.dropout(torch.softmax(scores, -1), 0.1, self.training)
        return torch.bmm(probs.view(-1, *probs.shape[2:]), v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b * self.heads, 3 * self.dim).transpose(0, 1).split(self.dim, -1)
        context = self.core(q, k, v).transpose(0, 1).reshape(s, b, h)
        x = F.dropout(self.out(context), 0.1, self.training) + x
        return F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), 0.1, self.training) + x


def eager_layer_probe(device: torch.device, timing: TimingConfig, sizes: Sizes) -> dict:
    """Megatron's eager-attention layer (``EagerLayer``) at the published runs' shapes (``sizes.eager_layers``):
    the layer's forward and forward + backward, its attention core's alone, and ``masked_fill_`` on the scores (the
    pass torch adds to Megatron's fused softmax), in ns; then the first shape's forward + backward back to back for
    ``sizes.eager_load_s`` seconds with the SM clock and power (``sustained``'s windows): a mix whose memory-bound
    share is far above the block the power line was read from (docs/costs.md, "Under continuous load")."""
    timer, dtype = make_timer(device, timing), _dtype(device)
    rows = []
    for shape in sizes.eager_layers:
        rows.append(_eager_layer_row(timer, device, dtype, *shape))
        print(f"probes: eager layer {shape}: F {rows[-1]['forward_ns'] / 1e6:.2f} ms, F+B "
              f"{rows[-1]['forward_backward_ns'] / 1e6:.2f} ms", file=sys.stderr, flush=True)
    hidden, heads, seq, samples = sizes.eager_layers[0]
    layer = EagerLayer(hidden, heads, seq).to(device=device, dtype=dtype)
    x = torch.randn(seq, samples, hidden, device=device, dtype=dtype, requires_grad=True)
    with _gpu_monitor(device) as samples_read:
        windows = _windows(device, lambda: layer(x).sum().backward(), sizes.eager_load_s, 1.0)
    return {"layers": rows, "load": {"shape": sizes.eager_layers[0], "windows": windows, "gpu": samples_read}}


def _eager_layer_row(timer: Timer, device: torch.device, dtype: torch.dtype, hidden: int, heads: int, seq: int,
                     samples: int) -> dict:
    """One shape of ``eager_layer_probe``: the layer's, its core's and the mask's ns (its tensors freed on return,
    before the next shape's)."""
    layer = EagerLayer(hidden, heads, seq).to(device=device, dtype=dtype)
    x = torch.randn(seq, samples, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    q, k, v = (torch.randn(samples * heads, seq, hidden // heads, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    scores = torch.randn(samples, heads, seq, seq, device=device, dtype=dtype)

    def ns(work: Callable[[], object]) -> float:
        return timer.measure(Bench(lambda _: work())).median_ns

    return {"hidden": hidden, "heads": heads, "seq": seq, "samples": samples,
            "forward_ns": ns(lambda: layer(x)), "forward_backward_ns": ns(lambda: layer(x).backward(grad)),
            "core_forward_ns": ns(lambda: layer.core(q, k, v)),
            "core_forward_backward_ns": ns(lambda: layer.core(q, k, v).backward(q.detach())),
            "mask_ns": ns(lambda: scores.masked_fill_(layer.causal, -10000.0))}


def run(out: Path, device: torch.device, only: list[str] | None = None, sizes: Sizes | None = None,
        timing: TimingConfig = PROBE_TIMING) -> dict:
    """The probes named in ``only`` (all by default) at ``sizes`` (a GPU's on CUDA, the rehearsal's on a CPU),
    written to ``out/probes.json`` after each (a stopped run keeps what it finished)."""
    sizes = sizes or default_sizes(device)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": env.device_info(device), "versions": env.versions(), "created_utc": env.now_utc(),
                    "sizes": asdict(sizes)}
    every: dict[str, Callable[[], object]] = {
        "launch": lambda: launch_probe(device, sizes),
        "optimizer": lambda: optimizer_probe(device, timing, sizes),
        "gemm_layouts": lambda: gemm_probe(device, timing, linear_shapes(sizes)),
        "alignment": lambda: gemm_probe(device, timing, alignment_shapes(sizes)),
        "attention": lambda: attention_probe(device, timing, sizes),
        "streaming": lambda: streaming_probe(device, timing, sizes),
        "elementwise": lambda: elementwise_probe(device, timing, sizes),
        "sustained": lambda: sustained_probe(device, sizes),
        "eager_layer": lambda: eager_layer_probe(device, timing, sizes),
    }
    for name in only or every:
        probe = every[name]
        started = time.perf_counter()
        report[name] = probe()
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
        (out / "probes.json").write_text(json.dumps(report, indent=1))
        print(f"probes: {name} done in {report['seconds'][name]} s", file=sys.stderr, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipescope.calibration.probes",
        description="Time what the cost model's named terms rest on: kernel launches, the optimizer step's parts, "
                    "GEMMs in their three layouts and misaligned, attention, streaming, eager attention's "
                    "element-wise kernels, the rate under continuous load (docs/validation.md, "
                    "\"The probes\"). On a CPU it rehearses every probe at small sizes.")
    parser.add_argument("out", type=Path, help="folder for probes.json (written after each probe)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to time (default: cuda when there is one)")
    parser.add_argument("--only", nargs="+", choices=PROBES, help="these probes, in this order (default: all)")
    parser.add_argument("--block-samples", nargs="+", type=int, default=[], metavar="B",
                        help="sustained: also run the block under load at these microbatch sizes (each 1 to 64)")
    parser.add_argument("--sustained-seconds", type=float, metavar="S",
                        help="sustained: seconds of back-to-back work per item (5 to 120; default 40 on a GPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("probes: --device: got 'cuda', but torch sees no CUDA device here; expected cpu", file=sys.stderr)
        return 2
    bad = [b for b in args.block_samples if not 1 <= b <= 64]
    if bad:
        print(f"probes: --block-samples: got {bad[0]}, expected a microbatch size from 1 to 64", file=sys.stderr)
        return 2
    if args.sustained_seconds is not None and not 5 <= args.sustained_seconds <= 120:
        print(f"probes: --sustained-seconds: got {args.sustained_seconds}, expected 5 to 120", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    sizes = default_sizes(device)
    sizes = replace(sizes, block_samples=tuple(args.block_samples) or sizes.block_samples)
    if args.sustained_seconds is not None:
        sizes = replace(sizes, sustained=(sizes.sustained[0], args.sustained_seconds))
    run(args.out, device, args.only, sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
