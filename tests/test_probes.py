"""The GPU probes (``calibration/probes.py``) rehearsed on this machine's CPU at small sizes: every probe runs and
reports what docs/validation.md ("The probes") reads from it; the committed H200 measurements hold the facts the
cost model takes from them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from pipescope.calibration import probes
from pipescope.calibration.timing import TimingConfig
from pipescope.topologies.devices import DEVICES

H200_PROBES = Path(__file__).resolve().parent.parent / "calibration" / "profiles" / "h200" / "probes"


def test_every_probe_runs_on_a_cpu_and_reports_positive_times(tmp_path: Path) -> None:
    fast = TimingConfig(warmup=1, min_reps=3, max_reps=5, budget_s=0.01, flush_l2=False)
    report = probes.run(tmp_path, torch.device("cpu"), timing=fast)
    assert json.loads((tmp_path / "probes.json").read_text()) == json.loads(json.dumps(report))
    assert set(report["seconds"]) == set(probes.PROBES)
    step = report["optimizer"]
    assert step["params"] > 0 and all(step[k] > 0 for k in ("step_flat_grads", "zero_flat", "norm_host_sync"))
    assert len(report["gemm_layouts"]) == 3 * len(probes.linear_shapes(probes.CPU_REHEARSAL))
    assert {r["layout"] for r in report["alignment"]} == {"forward", "dgrad", "wgrad"}
    assert all(r["ns"] > 0 and r["tflops"] > 0 for r in report["gemm_layouts"] + report["alignment"])
    assert report["streaming"]["copy_bytes_per_s"] > 0 and report["launch"]["add_one_element"] > 0
    assert all(w["rate"] > 0 for work in ("gemm", "block", "block-2") for w in report["sustained"][work]["windows"])
    kernels = report["elementwise"]["kernels"]
    assert set(kernels) == {"copy", "softmax", "softmax_backward", "dropout", "dropout_backward"}
    eager = report["eager_layer"]
    assert [(r["hidden"], r["heads"], r["seq"], r["samples"]) for r in eager["layers"]] == [(64, 4, 32, 2)]
    assert all(r[k] > 0 for r in eager["layers"] for k in ("forward_ns", "forward_backward_ns", "core_forward_ns",
                                                          "core_forward_backward_ns", "mask_ns"))
    assert eager["load"]["windows"] and all(w["rate"] > 0 for w in eager["load"]["windows"])
    assert kernels["copy"]["of_copy"] == 1 and all(k["ns"] > 0 and k["of_copy"] > 0 for k in kernels.values())


@pytest.mark.parametrize("flags", [["--block-samples", "0"], ["--block-samples", "65"], ["--sustained-seconds", "2"]])
def test_a_bad_sustained_flag_is_a_usage_error(tmp_path: Path, capsys, flags: list[str]) -> None:
    assert probes.main([str(tmp_path), "--device", "cpu", *flags]) == 2
    assert flags[0] in capsys.readouterr().err and not (tmp_path / "probes.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_no_cuda_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert probes.main([str(tmp_path), "--device", "cuda"]) == 2
    assert "--device" in capsys.readouterr().err and not (tmp_path / "probes.json").exists()


def _rates(name: str) -> dict[tuple, float]:
    report = json.loads((H200_PROBES / name).read_text())
    rows = report["gemm_layouts"] if name == "probes-1.json" else report["alignment"]
    return {(r["name"], r["tokens"], r["in"], r["layout"]): r["tflops"] for r in rows}


def test_hoppers_misaligned_fraction_is_the_median_the_h200_measured() -> None:
    """devices.MISALIGNED_HOPPER per pass is the median of the 10 misaligned / aligned pairs the probes timed."""
    logits, alignment = _rates("probes-1.json"), _rates("probes-2.json")
    layouts = {"F": "forward", "I": "dgrad", "W": "wgrad"}
    for op, fraction in DEVICES["h200"].misaligned_gemm:
        layout = layouts[op]
        pairs = [v / logits[(n.replace("50257", "50304"), t, k, layout)]
                 for (n, t, k, lay), v in logits.items() if n.startswith("logits-50257") and lay == layout]
        aligned = next(v for (n, _, _, lay), v in alignment.items() if n == "aligned" and lay == layout)
        pairs += [v / aligned for (n, _, _, lay), v in alignment.items() if n in ("out-odd", "in-odd")
                  and lay == layout]
        assert len(pairs) == 10 and round(statistics.median(pairs), 3) == fraction


def test_an_odd_token_count_ran_at_the_aligned_rate() -> None:
    """Only the widths decide alignment (``kernels.is_aligned``): the token count is never a row's width."""
    rates = _rates("probes-2.json")
    for layout in ("forward", "dgrad", "wgrad"):
        aligned = next(v for (n, _, _, lay), v in rates.items() if n == "aligned" and lay == layout)
        odd = next(v for (n, _, _, lay), v in rates.items() if n == "tokens-odd" and lay == layout)
        assert abs(odd / aligned - 1) < 0.05


def test_under_continuous_load_the_h200_held_less_than_its_short_measurements() -> None:
    """docs/validation.md, "Under continuous load": the settled GEMM rate against the sweep's short measurement of
    the same shape, and the block's iteration time against the profile's F + B of that block."""
    import pandas as pd

    sustained = json.loads((H200_PROBES / "probes-3.json").read_text())["sustained"]
    settled = [w["rate"] for w in sustained["gemm"]["windows"][2:]]
    sweep = pd.read_parquet(H200_PROBES.parent / "gemms" / "gemms.parquet")
    side = sustained["side"]
    short = sweep[(sweep.m == side) & (sweep.n == side) & (sweep.k == side)].tflops.item()
    assert round(statistics.median(settled) / short, 3) == 0.820
    assert all(s["power_w"] > 680 for s in sustained["gemm"]["gpu"][2:])  # at its 700 W limit
    profile = pd.read_parquet(H200_PROBES.parent / "gpt-1.3b" / "timings.parquet")
    layer = profile[(profile.component == "layer") & (profile.microbatch_size == 8)].set_index("op").median_ns
    block = statistics.median(w["rate"] for w in sustained["block"]["windows"][2:])
    assert round(block * (layer["F"] + layer["B"]) / 1e9, 3) == 0.921


def _block_mix(samples: int) -> tuple[float, float, float]:
    """(FLOPs, compute-bound s, memory-bound s) of the probes' gpt-1.3b block (no dropout) at ``samples`` x 1,024
    tokens, as the model counts and times it on an H200 at its boost clock."""
    from pipescope.simulator.gpu_rates import Roofline, Tiling
    from pipescope.simulator.kernels import layer_kernels
    from pipescope.simulator.models import ModelSpec

    d = DEVICES["h200"]
    rates = Roofline(d.peak_flops["bf16"], d.gemm_efficiency, d.memory_bandwidth * d.memory_efficiency,
                     Tiling(d.sms), d.flash)
    kernels = [k for k in layer_kernels(ModelSpec("probe", 1, 2048, 16, 1024, 50304), samples, "bf16")
               if "dropout" not in k.name]
    compute = sum(rates.seconds(k) for k in kernels if rates.bound(k) == "compute")
    memory = sum(rates.seconds(k) for k in kernels if rates.bound(k) == "memory")
    return sum(map(rates.work, kernels)), compute, memory


def test_the_h200s_power_headroom_is_its_power_readings_and_predicts_the_rates_it_held() -> None:
    """topologies/devices.py's H200_POWER_HEADROOM: the block at its boost clock drew power in a line of its FLOP
    rate (1 and 2 samples), reaching the power the limiter held at the headroom. The power-limited clock
    (``gpu_rates.power_limited_clock``) then predicts what the GEMM and the block at 4 and 8 samples held under load,
    none of which set it (docs/costs.md, "Under continuous load")."""
    import pandas as pd

    from pipescope.simulator.gpu_rates import power_limited_clock
    from pipescope.topologies.devices import H200_POWER_HEADROOM

    sustained = json.loads((H200_PROBES / "probes-4.json").read_text())["sustained"]
    items = {1: "block-1", 2: "block-2", 4: "block-4", 8: "block"}
    power = {b: statistics.median(_settled(sustained[k], "power_w")) for b, k in items.items()}
    rate = {b: statistics.median(_settled(sustained[k], "rate")) * _block_mix(b)[0] for b, k in items.items()}
    per_flop = (power[2] - power[1]) / (rate[2] - rate[1])  # W per FLOP/s
    held = statistics.median([power[4], power[8], statistics.median(_settled(sustained["gemm"], "power_w"))])
    headroom = rate[1] + (held - power[1]) / per_flop
    assert round(headroom / 1e12, 1) == H200_POWER_HEADROOM / 1e12 == 463.2
    assert DEVICES["h100"].power_headroom == DEVICES["h200"].power_headroom == H200_POWER_HEADROOM
    # the GEMM: all compute, at 799 TFLOP/s short; held 670 over 20 s and 655 over 40 s (probes-3.json)
    sweep = pd.read_parquet(H200_PROBES.parent / "gemms" / "gemms.parquet")
    side = sustained["side"]
    short = sweep[(sweep.m == side) & (sweep.n == side) & (sweep.k == side)].tflops.item() * 1e12
    predicted = short * power_limited_clock(short, 1.0, 0.0, H200_POWER_HEADROOM)
    assert round(predicted / 1e12) == 666
    # the block at its short time (the profile's F + B), its kernels' compute-bound share as the model has it
    profile = pd.read_parquet(H200_PROBES.parent / "gpt-1.3b" / "timings.parquet")
    held_share = {}
    for samples, measured in ((4, 0.950), (8, 0.939)):
        layer = profile[(profile.component == "layer") & (profile.microbatch_size == samples)]
        short_s = layer.set_index("op").median_ns[["F", "B"]].sum() / 1e9
        flops, compute, memory = _block_mix(samples)
        share = compute / (compute + memory)
        clock = power_limited_clock(flops, share * short_s, (1 - share) * short_s, H200_POWER_HEADROOM)
        held_share[samples] = short_s / (share * short_s / clock + (1 - share) * short_s)
        assert abs(held_share[samples] - measured) < 0.015
        assert round(statistics.median(_settled(sustained[items[samples]], "rate")) * short_s, 3) == measured
    assert round(held_share[4], 3) == 0.962 and round(held_share[8], 3) == 0.945
    assert power_limited_clock(rate[2], 1.0, 0.0, H200_POWER_HEADROOM) == 1.0  # under the limit: boost
    assert DEVICES["v100"].power_headroom is None and DEVICES["v100"].sustained == 1.0  # 3 s medians already


def test_the_a100s_power_headroom_gives_back_the_public_sustained_matmul_rate() -> None:
    """An all-compute matmul at the A100's best short rate (271.2 TFLOP/s) holds mli's 230 TFLOP/s under load."""
    from pipescope.simulator.gpu_rates import power_limited_clock

    headroom = DEVICES["a100"].power_headroom
    assert round(271.2e12 * power_limited_clock(271.2e12, 1.0, 0.0, headroom) / 1e12, 1) == 230.0


def test_the_power_limited_clock_is_the_root_and_falls_as_the_mix_draws_more() -> None:
    from pipescope.simulator.gpu_rates import power_limited_clock

    clocks = [power_limited_clock(flops, 0.9, 0.1, 100.0) for flops in (50.0, 100.0, 150.0, 300.0, 1000.0)]
    assert clocks[:2] == [1.0, 1.0] and clocks[2] > clocks[3] > clocks[4] > 0
    c = clocks[3]
    assert abs(300.0 * c**3 - 100.0 * (0.9 + 0.1 * c)) < 1e-9


def test_the_h200s_streaming_and_attention_rates_are_its_probes() -> None:
    """topologies/devices.py takes the H200's HBM and attention rates from its probes, rounded as written there."""
    from pipescope.topologies.devices import _SDPA_H200_TFLOPS, H200_SDPA_SEQS, H200_STREAMING

    report = json.loads((H200_PROBES / "probes-2.json").read_text())
    assert round(report["streaming"]["copy_bytes_per_s"] / DEVICES["h200"].memory_bandwidth, 3) == H200_STREAMING
    measured = {(r["head_dim"], r["seq"]): round(r["forward_backward_tflops"]) for r in report["attention"]}
    assert measured == {(d, s): r for d, rates in _SDPA_H200_TFLOPS.items() for s, r in zip(H200_SDPA_SEQS, rates)}
    assert DEVICES["h200"].memory_efficiency == H200_STREAMING


def _settled(item: dict, key: str) -> list[float]:
    """An item's samples after the first two, as docs/validation.md reads them."""
    return [sample[key] for sample in item["windows" if key == "rate" else "gpu"][2:]]


def test_the_h200_lowered_its_clock_only_at_its_power_limit() -> None:
    """docs/validation.md, "A third H200 session": the block at 1 and 2 samples draws far under 700 W and keeps
    its boost clock; at 4 and 8 it reaches the limit and runs slower; the 20-second run held more than the
    40-second one (probes-3.json)."""
    import pandas as pd

    sustained = json.loads((H200_PROBES / "probes-4.json").read_text())["sustained"]
    items = {1: "block-1", 2: "block-2", 4: "block-4", 8: "block"}
    power = {b: statistics.median(_settled(sustained[k], "power_w")) for b, k in items.items()}
    clock = {b: statistics.median(_settled(sustained[k], "sm_mhz")) for b, k in items.items()}
    assert max(power[1], power[2]) < 600 and min(power[4], power[8]) > 680
    assert clock[1] == clock[2] == 1980 and max(clock[4], clock[8]) < 1900
    profile = pd.read_parquet(H200_PROBES.parent / "gpt-1.3b" / "timings.parquet")
    layer = profile[(profile.component == "layer") & (profile.microbatch_size == 8)].set_index("op").median_ns
    block = statistics.median(_settled(sustained["block"], "rate"))
    assert round(block * (layer["F"] + layer["B"]) / 1e9, 3) == 0.939  # 0.921 over 40 s (probes-3.json)
    sweep = pd.read_parquet(H200_PROBES.parent / "gemms" / "gemms.parquet")
    side = sustained["side"]
    short = sweep[(sweep.m == side) & (sweep.n == side) & (sweep.k == side)].tflops.item()
    assert round(statistics.median(_settled(sustained["gemm"], "rate")) / short, 3) == 0.839  # 0.820 over 40 s


def test_dropouts_random_numbers_cost_a_tenth_of_the_forwards_gap() -> None:
    """docs/validation.md, "Eager attention's element-wise kernels": dropout's forward beyond its 5 bytes an element
    at a copy's rate is 0.46 ps an element on the H200, under 1 ps scaled to an A100's arithmetic (SMs x clock),
    against the 6-9 ps a score element by which the model's forward is short of Qi et al.'s."""
    kernels = json.loads((H200_PROBES / "probes-4.json").read_text())["elementwise"]
    elements = 1
    for size in kernels["shape"]:
        elements *= size
    rows = kernels["kernels"]
    extra_ps = (rows["dropout"]["ns"] * 1e-9 - 5 * elements / rows["copy"]["bytes_per_s"]) / elements * 1e12
    assert round(extra_ps, 2) == 0.46
    assert extra_ps * (132 * 1980) / (108 * 1410) < 0.1 * 9
    assert {k: round(v["of_copy"], 3) for k, v in rows.items()} == {
        "copy": 1.0, "softmax": 0.633, "softmax_backward": 0.437, "dropout": 0.726, "dropout_backward": 1.022}
