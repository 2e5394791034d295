"""How fast a GPU runs each kind of kernel (docs/costs.md, "Rates"). A kernel takes the longer of its compute and
its memory time (the roofline):

- a matmul computes at the fraction of the dense peak that large GEMMs reach in cuBLAS, times the share of its
  tiles' work that is useful: a GEMM is cut into output tiles, and the GPU runs them in waves of one tile per SM, so
  a last wave that does not fill the SMs, or tiles that overhang the matrix, waste their part; and each tile fills
  its pipeline of k-slices before its first multiply, which a short inner dimension pays for (``Tiling``);
- a flash-attention kernel computes at FlashAttention's measured rate for its sequence length and head dimension
  (``FlashRates``), on FlashAttention's own FLOP count (``kernels.Flash``);
- every kernel streams its bytes at the fraction of the HBM bandwidth a streaming kernel reaches.

The rates come from the GPU's datasheet and public measurements (``topologies/devices.py`` names them). Stdlib
only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

from pipescope.simulator.kernels import PASSES, Kernel

if TYPE_CHECKING:  # measured_gemms builds on Tiling
    from pipescope.simulator.measured_gemms import MeasuredGemms

# The large tiles big bf16/fp16 GEMMs run with on Ampere and Hopper (CUTLASS's default for SM80 tensor ops is a
# 128 x 256 x 64 threadblock with 3 stages, include/cutlass/gemm/device/default_gemm_configuration.h; cuBLASLt
# lists TILE_128x256 and TILE_256x128), one per SM at a time; the heuristic takes the orientation that wastes less.
LARGE_TILES = ((256, 128), (128, 256))
# Before its first multiply a tile loads (stages - 1) k-slices of 64: 128 elements of the inner dimension whose time
# it waits for, once per tile.
PIPELINE_FILL = 2 * 64


@dataclass(frozen=True)
class Tiling:
    """Tile and wave quantization of a GEMM on a GPU with ``sms`` streaming multiprocessors, and each tile's
    pipeline fill along the inner dimension."""

    sms: int
    tiles: tuple[tuple[int, int], ...] = LARGE_TILES

    def efficiency(self, batch: int, rows: int, cols: int, inner: int | None = None) -> float:
        """The useful share of the work the GPU does for ``batch`` products of ``rows`` x ``cols`` outputs over
        ``inner``: the outputs over the outputs of every tile of the waves run (a partial wave takes as long as a
        full one), times ``inner`` over ``inner`` plus the pipeline fill (None: an inner dimension too long to
        matter)."""
        useful = batch * rows * cols
        best = 0.0
        for tile_rows, tile_cols in self.tiles:
            tiles = batch * math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
            waves = math.ceil(tiles / self.sms)
            best = max(best, useful / (waves * self.sms * tile_rows * tile_cols))
        return best if inner is None else best * inner / (inner + PIPELINE_FILL)


@dataclass(frozen=True)
class FlashRates:
    """FlashAttention's measured forward+backward rate on one GPU under a causal mask, as a fraction of its dense
    peak: per head dimension, (sequence length, fraction) points. Between points the fraction is interpolated on
    log2 of the sequence length; outside them it is held at the nearest point; a head dimension not measured takes
    the nearest one's."""

    points: tuple[tuple[int, tuple[tuple[int, float], ...]], ...]

    def fraction(self, seq: int, head_dim: int) -> float:
        curve = min(self.points, key=lambda entry: (abs(entry[0] - head_dim), entry[0]))[1]
        if seq <= curve[0][0]:
            return curve[0][1]
        for (s0, r0), (s1, r1) in zip(curve, curve[1:]):
            if seq <= s1:
                share = (math.log2(seq) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + share * (r1 - r0)
        return curve[-1][1]


# Bisection steps of the power-limited clock: 2^-50 of the boost clock, below a float's use here.
_POWER_STEPS = 50


def power_limited_clock(flops: float, compute_s: float, memory_s: float, headroom: float) -> float:
    """The fraction of its boost clock a GPU holds running a mix of kernels back to back, at its power limit
    (docs/costs.md, "Under continuous load"): ``flops`` take ``compute_s`` in compute-bound kernels and ``memory_s``
    in memory-bound ones at the boost clock; ``headroom`` is the FLOP rate at which the GPU, at its boost clock,
    draws its power limit.

    Power above the idle draw grows with the FLOP rate, and each FLOP's energy with the square of the voltage, which
    scales with the clock: at clock fraction c the compute-bound kernels take ``compute_s / c`` (the HBM keeps its
    own clock) and the power is in proportion to ``rate(c) * c**2``. The GPU holds the largest c at which that is at
    most ``headroom``: 1 when the mix at boost is under it, else the root of
    ``flops * c**3 = headroom * (compute_s + memory_s * c)``, which rises with c."""
    if flops <= headroom * (compute_s + memory_s):
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(_POWER_STEPS):
        mid = (low + high) / 2
        low, high = (low, mid) if flops * mid**3 > headroom * (compute_s + memory_s * mid) else (mid, high)
    return low


def bound_by(kernel: Kernel, compute_s: float, memory_s: float) -> str:
    """``compute`` or ``memory``: which of ``kernel``'s two times (``Roofline.times``) sets it; a kernel without
    FLOPs is memory-bound."""
    return "compute" if kernel.flops and compute_s >= memory_s else "memory"


@dataclass(frozen=True)
class Roofline:
    """A kernel's time is max(compute time, memory time): whichever of the two it waits for.

    ``peak_flops`` x ``gemm_efficiency`` is what a large, well-tiled matmul reaches; ``tiling`` (None: none)
    scales it by the GEMM's quantization and pipeline fill; ``flash`` (None: flash kernels like any other FLOPs)
    times flash attention; ``memory_rate`` (None: memory traffic is not timed) is the bytes/s a streaming kernel
    reaches; ``gemms`` (None: none) are measured matmul rates, which replace ``gemm_efficiency`` for matmuls;
    ``misaligned`` is, per pass (F, I, W), the fraction of its rate a matmul reaches whose rows do not start on 16
    bytes (``kernels.is_aligned``); a pass it does not name runs at the aligned rate. ``sustained`` is the fraction
    of those short-benchmark compute rates a GPU holds under a training step's continuous load, at its power limit
    (docs/costs.md, "Under continuous load"); streaming rates come from long copies and do not take it.
    ``scores_rate`` (None: ``memory_rate``) is the bytes/s eager attention's kernels over the s x s scores reach
    (``Kernel.scores``; docs/costs.md, "Eager attention").
    """

    peak_flops: float
    gemm_efficiency: float
    memory_rate: float | None
    tiling: Tiling | None = None
    flash: FlashRates | None = None
    gemms: MeasuredGemms | None = None
    misaligned: tuple[tuple[str, float], ...] = ()
    sustained: float = 1.0
    scores_rate: float | None = None

    @property
    def compute_rate(self) -> float:
        """FLOP/s of a large, well-tiled matmul under continuous load."""
        return self.peak_flops * self.gemm_efficiency * self.sustained

    def flop_rate(self, kernel: Kernel) -> float:
        """The FLOP/s ``kernel`` computes at, in its own FLOP count (a flash kernel's: ``Flash.flops``)."""
        if kernel.flash is not None and self.flash is not None:
            return self.peak_flops * self.flash.fraction(kernel.flash.seq, kernel.flash.head_dim) * self.sustained
        g = kernel.gemm
        if g is None:
            return self.compute_rate
        alignment = 1.0 if g.aligned else dict(self.misaligned).get(kernel.op, 1.0)
        if self.gemms is not None:
            return self.gemms.flop_rate(g, self.tiling) * alignment * self.sustained
        if self.tiling is not None:
            return self.compute_rate * self.tiling.efficiency(g.batch, g.rows, g.cols, g.inner) * alignment
        return self.compute_rate * alignment

    def work(self, kernel: Kernel) -> float:
        """The FLOPs its rate is measured in: FlashAttention's own count for a flash kernel timed at flash rates."""
        return kernel.flash.flops if kernel.flash is not None and self.flash is not None else kernel.flops

    def times(self, kernel: Kernel) -> tuple[float, float]:
        """(compute seconds, memory seconds) of ``kernel``."""
        rate = self.scores_rate if kernel.scores and self.scores_rate else self.memory_rate
        memory = kernel.nbytes / rate if rate else 0.0
        flops = self.work(kernel)
        return (flops / self.flop_rate(kernel) if flops else 0.0), memory

    def seconds(self, kernel: Kernel) -> float:
        return max(self.times(kernel))

    def bound(self, kernel: Kernel) -> str:
        """``compute`` or ``memory``: which term sets the kernel's time (a kernel without FLOPs: memory)."""
        return bound_by(kernel, *self.times(kernel))

    def efficiency(self, kernel: Kernel) -> float | None:
        """The kernel's FLOPs per second over the peak (None for a kernel without FLOPs), in its own count: a flash
        kernel's is FlashAttention's (the causal half), so it stays below 1."""
        seconds = self.seconds(kernel)
        return self.work(kernel) / seconds / self.peak_flops if kernel.flops and seconds else None

    def pass_seconds(self, kernels: list[Kernel]) -> dict[str, float]:
        """Seconds of each pass (``kernels.PASSES``): the sum of its kernels' times."""
        totals = dict.fromkeys(PASSES, 0.0)
        for kernel in kernels:
            totals[kernel.op] += self.seconds(kernel)
        return totals
