"""The GPU rate model (simulator/gpu_rates.py; docs/costs.md, "Rates"): tile and wave quantization, FlashAttention's
measured rates, and the roofline over kernels of each kind."""

from __future__ import annotations

import pytest

from pipescope.simulator.gpu_rates import PIPELINE_FILL, FlashRates, Roofline, Tiling
from pipescope.simulator.kernels import Flash, Gemm, Kernel, layer_kernels
from pipescope.simulator.models import ModelSpec
from pipescope.topologies.devices import DEVICES

A100 = Tiling(108)


def test_a_full_wave_is_all_useful_and_one_more_tile_costs_a_whole_wave() -> None:
    """108 tiles of 256 x 128 fill A100's 108 SMs once; 109 need a second wave that does one tile's work."""
    assert A100.efficiency(1, 256 * 12, 128 * 9) == 1.0
    assert A100.efficiency(1, 256 * 109, 128) == pytest.approx(109 / 216)


def test_the_orientation_that_wastes_less_is_taken() -> None:
    """108 x 256 rows by 128 columns: 256 x 128 tiles fill one wave; 128 x 256 tiles would be 216 (two waves),
    each with half its columns overhanging (0.5)."""
    assert A100.efficiency(1, 256 * 108, 128) == 1.0
    assert Tiling(108, ((128, 256),)).efficiency(1, 256 * 108, 128) == pytest.approx(0.5)


def test_a_partial_tile_wastes_its_overhang() -> None:
    """27 x 256 rows fill a quarter wave; 27 x 256 - 56 rows still need 27 tiles, of which the last is part
    overhang."""
    full = A100.efficiency(4, 27 * 256, 128)
    assert A100.efficiency(4, 27 * 256 - 56, 128) == pytest.approx(full * (27 * 256 - 56) / (27 * 256))


def test_a_short_inner_dimension_pays_the_pipeline_fill() -> None:
    """Each tile loads two 64-wide k-slices before its first multiply (CUTLASS's SM80 default: 3 stages)."""
    assert A100.efficiency(1, 256 * 108, 128, 128) == pytest.approx(0.5)
    assert A100.efficiency(1, 256 * 108, 128, 1 << 20) == pytest.approx(1, rel=2e-4)


def test_the_measured_gemm_is_given_back_at_its_own_shape() -> None:
    """A GPU's large-GEMM efficiency is its benchmark's result divided by what the tiling takes there, so the model
    reproduces the benchmark at the benchmarked shape (A100: 271.2 of 312 TFLOP/s at 1024 x 10240 x 5120)."""
    for gpu in DEVICES.values():
        model = gpu.gemm_efficiency * Tiling(gpu.sms).efficiency(1, *gpu.gemm_shape)
        assert model == pytest.approx(gpu.gemm_measured)
    assert DEVICES["a100"].gemm_measured == pytest.approx(271.2 / 312)


def test_batched_products_share_the_waves() -> None:
    assert A100.efficiency(108, 256, 128) == 1.0
    assert A100.efficiency(4, 256 * 27, 128) == 1.0


FLASH = FlashRates(((64, ((512, 0.3), (2048, 0.5))), (128, ((512, 0.4), (2048, 0.8)))))


def test_flash_rates_interpolate_on_log_sequence_and_hold_outside() -> None:
    assert FLASH.fraction(512, 64) == 0.3
    assert FLASH.fraction(1024, 64) == pytest.approx(0.4)  # halfway in log2
    assert FLASH.fraction(256, 64) == 0.3 and FLASH.fraction(8192, 64) == 0.5
    assert FLASH.fraction(2048, 96) == 0.5  # nearest head dimension (a tie takes the smaller)
    assert FLASH.fraction(2048, 112) == 0.8


def test_roofline_times_each_kind_at_its_rate() -> None:
    roof = Roofline(312e12, 0.869, 1.6e12, A100, FLASH)
    gemm = Kernel("mm", "F", 2.0 * 256 * 12 * 128 * 9 * 4096, 1.0, Gemm(1, 256 * 12, 128 * 9, 4096))
    fill = 4096 / (4096 + PIPELINE_FILL)  # one wave of whole tiles: only the inner dimension's pipeline fill
    assert roof.seconds(gemm) == pytest.approx(gemm.flops / (312e12 * 0.869 * fill))
    flash = Kernel("flash attention", "F", 8e12, 1.0, flash=Flash(4e12, 2048, 128))
    assert roof.seconds(flash) == pytest.approx(4e12 / (0.8 * 312e12))
    assert roof.efficiency(flash) == pytest.approx(0.8)  # FlashAttention's own count, below 1
    stream = Kernel("layer norm", "F", 0, 1.6e9)
    assert roof.seconds(stream) == pytest.approx(1e-3) and roof.bound(stream) == "memory"


def test_without_tiling_or_flash_every_flop_runs_at_the_gemm_rate() -> None:
    """An AnalyticCosts built in Python without a GPU's rates keeps the model before them."""
    roof = Roofline(100e12, 0.5, None)
    model = ModelSpec("m", 2, 1024, 16, 512, 1000)
    for kernel in layer_kernels(model, 2, "bf16"):
        assert roof.seconds(kernel) == pytest.approx(kernel.flops / 50e12)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_gpu_has_its_measured_rates(name: str) -> None:
    gpu = DEVICES[name]
    assert 0.5 < gpu.gemm_efficiency < 1 and 0.5 < gpu.memory_efficiency < 1 and gpu.sms >= 80
    rates = [gpu.flash.fraction(seq, 128) for seq in (512, 2048, 16384)]
    assert rates == sorted(rates) and all(0 < r < 1 for r in rates)
    assert gpu.flash.fraction(2048, 64) < gpu.flash.fraction(2048, 128)  # FlashAttention-2's smaller heads: slower


def test_a_flash_kernel_carries_flashattentions_causal_count() -> None:
    """FlashAttention counts 4 s^2 d per head and sample for a forward, halved under the causal mask, and 2.5 times
    that for the backward: for the whole microbatch that is 2 t s h in F, the MFU convention's 4 t s h halved."""
    from pipescope.simulator.kernels import layer_kernels
    from pipescope.simulator.models import PRESETS

    model = PRESETS["gpt-1.3b"]
    t = 2 * model.seq
    flash = {k.op: k for k in layer_kernels(model, 2, "bf16") if k.flash is not None}
    assert flash["F"].flash.flops == 2 * t * model.seq * model.hidden == flash["F"].flops / 2
    assert flash["I"].flash.flops == 2.5 * flash["F"].flash.flops
