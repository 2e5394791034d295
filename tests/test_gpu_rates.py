"""The GPU rate model (simulator/gpu_rates.py; docs/costs.md, "Rates"): tile and wave quantization, FlashAttention's
measured rates, and the roofline over kernels of each kind."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipescope
from pipescope.simulator.gpu_rates import PIPELINE_FILL, FlashRates, Roofline, Tiling
from pipescope.simulator.kernels import Flash, Gemm, Kernel, is_aligned, layer_kernels, output_kernels
from pipescope.simulator.models import ModelSpec, allocated_vocab
from pipescope.simulator.vocab import VocabMethod, VocabShards
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


def test_a_row_must_start_on_16_bytes_and_the_token_count_is_not_a_row() -> None:
    """GPT-2's 50,257 is odd in bf16 and fp32; 50,304 (Megatron's padding) and any token count are fine."""
    assert not is_aligned((2048, 50257), 2) and not is_aligned((50257,), 4)
    assert is_aligned((2048, 50304), 2) and is_aligned((2052,), 4) and not is_aligned((2052,), 2)
    model = ModelSpec("odd", layers=1, hidden=2048, heads=16, seq=1023, vocab=50257)
    assert all(k.gemm.aligned for k in layer_kernels(model, 3, "bf16") if k.gemm is not None)  # 3069 tokens
    logits = [k for k in output_kernels(model, 1, "bf16") if k.gemm is not None]
    assert len(logits) == 3 and not any(k.gemm.aligned for k in logits)
    assert all(k.gemm.aligned for k in output_kernels(model, 1, "bf16", allocated=50304) if k.gemm is not None)


def test_megatron_pads_the_vocabulary_to_128_times_the_tensor_degree_and_torch_does_not() -> None:
    assert allocated_vocab("megatron", 50257) == 50304 and allocated_vocab("megatron", 50257, 8) == 51200 // 8
    assert allocated_vocab("torch", 50257) == 50257 and allocated_vocab("torch", 50257, 8) == 6283
    assert allocated_vocab("megatron", 51200, 8) == 6400  # already a multiple: unchanged


def test_a_misaligned_matmul_runs_at_its_gpus_fraction_per_pass() -> None:
    d = DEVICES["h100"]
    rates = Roofline(d.peak_flops["bf16"], d.gemm_efficiency, None, Tiling(d.sms), misaligned=d.misaligned_gemm)
    model = ModelSpec("odd", layers=1, hidden=2048, heads=16, seq=2048, vocab=50257)
    for kernel in (k for k in output_kernels(model, 4, "bf16") if k.gemm is not None):
        aligned = replace(kernel, gemm=replace(kernel.gemm, aligned=True))
        assert rates.flop_rate(kernel) == pytest.approx(rates.flop_rate(aligned) * dict(d.misaligned_gemm)[kernel.op])
    assert dict(d.misaligned_gemm) == {"F": 0.127, "I": 0.178, "W": 0.186} and not DEVICES["a100"].misaligned_gemm


def _logits_seconds(*sets: str) -> dict[str, float]:
    result = pipescope.run(pipescope.load_config("demo", list(sets)))
    return {k["pass"]: k["time_s"] for group in result.kernels for k in group["kernels"] if k["kernel"] == "logits"}


def test_the_torch_runtime_pays_for_an_odd_vocabulary_on_hopper_and_megatron_pads_it() -> None:
    """The demo (GPT 1.3B on DGX H100s): Megatron's padded logits run at the aligned rate; torch's at 50,257 at the
    measured fractions (at one clock: the slower logits would otherwise let the last stage's clock rise, "Under
    continuous load"); an A100 has no measurement, so both runtimes price the logits alike."""
    one_clock = "costs.sustained=1"
    megatron, torch_runtime = _logits_seconds(one_clock), _logits_seconds(one_clock, "memory.runtime=torch")
    for op, fraction in DEVICES["h100"].misaligned_gemm:
        assert torch_runtime[op] == pytest.approx(megatron[op] / fraction, rel=1e-3)
    a100 = ("cluster.topology=dgx-a100",)
    assert _logits_seconds(*a100) == _logits_seconds(*a100, "memory.runtime=torch")


def test_vocabulary_shards_are_padded_as_the_runtime_pads() -> None:
    """50,257 over 4 devices: the paper's padding to 2p gives 12,566-row shards (odd in bf16) under torch; Megatron
    pads to 50,304 first, 12,576 rows."""
    model = ModelSpec("gpt", layers=4, hidden=2048, heads=16, seq=1024, vocab=50257)
    for runtime, aligned in (("torch", False), ("megatron", True)):
        shards = VocabShards(VocabMethod.VOCAB_1, 4, model, 1, "bf16", runtime)
        gemms = [k.gemm for kernels in shards.pass_kernels().values() for k in kernels if k.gemm is not None]
        assert gemms and all(g.aligned is aligned for g in gemms)


def _stage_clocks(*sets: str) -> tuple[dict[int, float], dict[int, list[dict]]]:
    """Per stage of the demo: its group's ``sustained`` clock and its kernels."""
    groups = pipescope.run(pipescope.load_config("demo", list(sets))).kernels
    return ({s: g["sustained"] for g in groups for s in g["stages"]},
            {s: g["kernels"] for g in groups for s in g["stages"]})


def test_each_stage_runs_at_the_clock_its_own_mix_holds_at_the_power_limit() -> None:
    """docs/costs.md, "Under continuous load": the demo's middle stages (large matmuls) sit above the H100's power
    headroom and slow down; its last stage adds the memory-bound cross-entropy, draws less and keeps more of its
    clock; a compute kernel's efficiency is its boost efficiency times its stage's clock; ``costs.sustained`` fixes
    one fraction for all; a V100 (no headroom) keeps its 1."""
    clocks, kernels = _stage_clocks()
    assert clocks[1] == clocks[2] and 0.85 < clocks[1] < clocks[3] < 1.0
    boost_clocks, boost = _stage_clocks("costs.sustained=1")
    assert set(boost_clocks.values()) == {1.0}

    def qkv(rows: list[dict]) -> dict:
        return next(k for k in rows if k["kernel"] == "QKV" and k["pass"] == "F")

    assert qkv(kernels[1])["efficiency"] == pytest.approx(qkv(boost[1])["efficiency"] * clocks[1], rel=1e-12)
    memory_bound = [k for k in kernels[1] if k["bound"] == "memory"]
    assert memory_bound and all(k["time_s"] == b["time_s"] for k, b in zip(memory_bound, (
        b for b in boost[1] if b["bound"] == "memory")))  # the HBM keeps its clock
    assert set(_stage_clocks("costs.sustained=0.9")[0].values()) == {0.9}
    assert set(_stage_clocks("cluster.topology=p3.16xlarge", "model.precision=fp16")[0].values()) == {1.0}
