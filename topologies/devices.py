"""Datasheet numbers of the GPUs the machines are built of, and the public measurements of what their kernels reach
(docs/costs.md, "Rates", has each source).

A precision the GPU cannot run at tensor-core speed is absent from its ``peak_flops``: V100 has fp16 tensor cores
but no bf16 at all (it would run emulated, far below any datasheet number), so a bf16 run on V100 is refused
rather than priced at its fp16 peak. fp32 is the plain (non-TF32) peak: torch leaves TF32 matmuls off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipescope.simulator.gpu_rates import FlashRates, Tiling


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU: its datasheet (dense tensor-core peak per precision in FLOP/s, HBM bandwidth and size, SM count) and
    what real kernels reach on it, each a fraction of the datasheet's number (so a ``cluster.peak_flops`` or
    ``memory_bandwidth`` given for another part scales them): ``gemm_measured`` of the peak, the fastest matmul a
    public benchmark found, at its shape ``gemm_shape`` (rows, columns, inner); ``memory_efficiency`` of the HBM
    bandwidth a streaming kernel reaches; ``flash`` FlashAttention's measured forward+backward rates;
    ``misaligned_gemm``, per pass (F, I, W), the fraction of the aligned rate a bf16/fp16 matmul reaches whose rows do
    not start on 16 bytes (an odd vocabulary), where measured (empty: not measured, priced as aligned);
    ``power_headroom``, the FLOP rate at which the GPU at its boost clock draws its power limit, from which a
    step's compute rates under continuous load follow (``gpu_rates.power_limited_clock``; None: not known);
    without it, ``sustained``, a fixed fraction of the short benchmarks' compute rates held under load (1: the
    benchmark was already a long one); ``eager_efficiency``, of the HBM bandwidth, what Megatron's eager attention
    kernels over the s x s scores reach (``Kernel.scores``; None: not measured, they stream at
    ``memory_efficiency``); ``flash_runs``, False where FlashAttention does not run at all (sm70), so ``flash`` is
    an estimate of something no run there does."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    sms: int
    gemm_measured: float
    gemm_shape: tuple[int, int, int]
    memory_efficiency: float
    flash: FlashRates
    misaligned_gemm: tuple[tuple[str, float], ...] = ()
    sustained: float = 1.0
    power_headroom: float | None = None
    eager_efficiency: float | None = None
    flash_runs: bool = True

    @property
    def gemm_efficiency(self) -> float:
        """The fraction of the peak a matmul with no quantization or pipeline fill reaches: the measurement over
        what ``Tiling`` takes from the measured shape, so that the rate model gives back the measurement there."""
        return self.gemm_measured / Tiling(self.sms).efficiency(1, *self.gemm_shape)

    @property
    def default_precision(self) -> str:
        """bf16 where the GPU has it, else fp16: what a mixed-precision run on it uses."""
        return "bf16" if "bf16" in self.peak_flops else "fp16"


GiB = 1 << 30
SEQS = (512, 1024, 2048, 4096, 8192, 16384)


def _flash(tflops: dict[int, tuple[float, ...]], peak: float, seqs: tuple[int, ...] = SEQS) -> FlashRates:
    """FlashRates from TFLOP/s at ``seqs`` per head dimension, measured on a GPU of dense ``peak`` FLOP/s."""
    return FlashRates(tuple((d, tuple(zip(seqs, (r * 1e12 / peak for r in rates)))) for d, rates in tflops.items()))


# FlashAttention-2 (Dao 2023, arXiv 2307.08691), forward+backward under a causal mask, TFLOP/s read off the bars of
# its Fig. 4 (A100 80GB SXM4) and Fig. 7 (H100 80GB SXM5): Dao-AILab/flash-attention,
# assets/flash2_a100_fwd_bwd_benchmark.png and flash2_h100_fwd_bwd_benchmark.png (commit 4f285b35).
_FLASH2_A100_TFLOPS = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}
_FLASH2_H100_TFLOPS = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
# FlashAttention does not run on V100 (sm70) and no V100 rate was published: an estimate, the A100 curve scaled by
# the two fp16 peaks.
_FLASH_V100_TFLOPS = {d: tuple(r * 125 / 312 for r in rates) for d, rates in _FLASH2_A100_TFLOPS.items()}
FLASH_V100, FLASH_A100 = _flash(_FLASH_V100_TFLOPS, 125e12), _flash(_FLASH2_A100_TFLOPS, 312e12)
FLASH_H100 = _flash(_FLASH2_H100_TFLOPS, 989e12)
# Measured on an H200 by the probes (calibration/profiles/h200/probes/probes-2.json, "attention"): torch 2.11's
# scaled_dot_product_attention, causal, bf16, forward + backward on FlashAttention's count, at sequences 1,024 to
# 8,192 (held beyond them); which kernel torch picked was not recorded. 1.2-1.7x FlashAttention-2's H100 bars.
H200_SDPA_SEQS = (1024, 2048, 4096, 8192)
_SDPA_H200_TFLOPS = {64: (233, 314, 379, 423), 128: (286, 388, 470, 527)}
FLASH_H200 = _flash(_SDPA_H200_TFLOPS, 989e12, H200_SDPA_SEQS)
H200_STREAMING = 0.885  # a 1 GiB copy at 4.25 of 4.8 TB/s, reads and writes counted (probes-2.json, "streaming")
# Misaligned bf16 matmuls on an H200 (calibration/profiles/h200/probes, `python -m pipescope.calibration.probes`):
# the median, per pass, of 10 pairs each (the logits at vocabularies 50,257 against 50,304, whole and in 8 shards,
# at 2,048 and 8,192 tokens and widths 2,048 and 12,288; a 8192 x 8192 x 4096 GEMM with its output or input width
# one short). Same SM architecture and cuBLAS kernels on H100. Not measured on A100 or V100.
MISALIGNED_HOPPER = (("F", 0.127), ("I", 0.178), ("W", 0.186))
# The FLOP rate at which the GPU, at its boost clock, draws its power limit (gpu_rates.power_limited_clock).
# H200 (probes-4.json, "sustained"): a gpt-1.3b block back to back at its boost clock drew 347 W at 176.6 TFLOP/s
# (1 x 1,024 tokens) and 541 W at 338.1 (2 x 1,024): 135.4 W plus 1.198 W per TFLOP/s; under load the limiter held
# 690.5 W (the median of the three runs at the limit), reached at (690.5 - 135.4) / 1.198 = 463.2 TFLOP/s. That
# predicts the 8192^3 GEMM's 666 TFLOP/s under load (measured 655-670) and the block's clock at 4 and 8 samples
# (tests/test_probes.py). H100: the H200's (the same die at the same 700 W).
H200_POWER_HEADROOM = 463.2e12
# A100 (400 W): no power reading published. mli/transformers-benchmarks' square fp16 matmuls held 230 TFLOP/s over
# 3 s back to back against 271.2 at their best: a pure matmul's rate falls with the clock, as the clock cubed
# falls with the power, so the headroom is 271.2 x (230 / 271.2)^3.
A100_POWER_HEADROOM = 230e12**3 / 271.2e12**2
# Megatron's eager attention on an A100 (FlashAttention, Dao et al. 2022, arXiv 2205.14135, Appendix E, Table 11,
# row "Megatron": its fused scale-mask-softmax, dropout 0.1 and batched matmuls, forward + backward, fp16, 16
# samples x 8 heads of 64, on an A100 40GB of 1,555 GB/s): 4.21 ms at sequence 1,024 and 16.50 ms at 2,048. The
# bytes kernels.py counts for those kernels (16 score matrices and 12 activations) over those times are 0.687 and
# 0.685 of the bandwidth (tests/test_roofline.py); the mean, as a fraction of the datasheet, for the A100 80GB.
EAGER_A100 = 0.686

DEVICES: dict[str, DeviceSpec] = {
    # GEMM: 95 of 125 TFLOP/s fp16, the best of square matmuls up to n = 8192 (mli/transformers-benchmarks, README
    # "Micro-Benchmarking Summary"); HBM: its VectorMul at 784 GB/s of 900 (same table). Each is the median of at
    # least 3 s of back-to-back calls (micro_bench.ipynb, `walltime`): already under continuous load.
    "v100": DeviceSpec("V100-SXM2-32GB", {"fp16": 125e12, "fp32": 15.7e12}, 900e9, 32 * GiB, sms=80,
                       gemm_measured=95 / 125, gemm_shape=(8192, 8192, 8192), memory_efficiency=0.87,
                       flash=FLASH_V100, flash_runs=False),
    # GEMM: 271.2 of 312 TFLOP/s bf16 at 1024 x 10240 x 5120 (M x N x K), Stas Bekman's maximum achievable matmul
    # FLOPS (stas00/ml-engineering, compute/accelerator/README.md); HBM: 1.616 TB/s of 2.039
    # (mli/transformers-benchmarks VectorMul).
    "a100": DeviceSpec("A100-SXM4-80GB", {"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12}, 2039e9, 80 * GiB,
                       sms=108, gemm_measured=271.2 / 312, gemm_shape=(1024, 10240, 5120), memory_efficiency=0.79,
                       flash=FLASH_A100, power_headroom=A100_POWER_HEADROOM, eager_efficiency=EAGER_A100),
    # GEMM: 794.5 of 989 TFLOP/s bf16 at 2048 x 2048 x 13312 (the same table, "H200 is the same"); HBM: 3.98 TB/s of
    # 4.8 on H200 (NVIDIA/cccl PR #2086, babelstream mul over 2^28 bytes); no H100 measurement found: the H200's.
    # (The H200's own entry now takes its probes' measurements; H100 keeps these sources, not measured here.)
    "h100": DeviceSpec("H100-SXM5-80GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 3350e9, 80 * GiB,
                       sms=132, gemm_measured=794.5 / 989, gemm_shape=(2048, 2048, 13312), memory_efficiency=0.83,
                       flash=FLASH_H100, misaligned_gemm=MISALIGNED_HOPPER, power_headroom=H200_POWER_HEADROOM),
    # GEMM: as H100 (the H200's own sweep agrees: costs.md, "Against an H200"); HBM and attention: its probes.
    "h200": DeviceSpec("H200-SXM-141GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 4800e9, 141 * 10**9,
                       sms=132, gemm_measured=794.5 / 989, gemm_shape=(2048, 2048, 13312),
                       memory_efficiency=H200_STREAMING, flash=FLASH_H200, misaligned_gemm=MISALIGNED_HOPPER,
                       power_headroom=H200_POWER_HEADROOM),
}
