"""The analytic cost model's roofline (docs/costs.md): kernels per pass and their FLOPs against the MFU totals,
compute- and memory-bound times, flash and eager attention, the optimizer step under every cost kind, and the
per-kernel breakdown in ``simulate --json``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from pipescope import load_config, run
from pipescope.config import ConfigError
from pipescope.calibration.profile_io import write_table
from pipescope.simulator.costs import AnalyticCosts, UniformCostsConfig, seconds_to_ns
from pipescope.simulator.gpu_rates import Roofline, Tiling
from pipescope.simulator.kernels import PASSES, Kernel, layer_kernels, optimizer_kernels, output_kernels
from pipescope.simulator.models import ATTENTIONS, ModelSpec, layer_work, output_layer_flops, preset
from pipescope.simulator.readers.profile_schema import ProfileError
from pipescope.simulator.profiled import ProfiledCosts
from pipescope.topologies.devices import DEVICES
from test_profiled_costs import make_profile

H100 = DEVICES["h100"]
MODEL = preset("gpt-1.3b")


def flops_by_pass(kernels: list[Kernel]) -> dict[str, float]:
    totals = dict.fromkeys(PASSES, 0.0)
    for kernel in kernels:
        totals[kernel.op] += kernel.flops
    return totals


def h100_costs(attention: str = "flash", precision: str = "bf16", **extra) -> AnalyticCosts:
    return AnalyticCosts(MODEL, H100.peak_flops[precision], 1, precision, 0.5, memory_bandwidth=H100.memory_bandwidth,
                         attention=attention, **extra)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", ["tiny", "gpt-355m", "gpt-1.3b"])
@pytest.mark.parametrize("microbatch_size", [1, 3])
def test_kernel_flops_add_up_to_the_mfu_totals(attention: str, name: str, microbatch_size: int) -> None:
    """Each pass's kernels carry exactly docs/schedules.md's FLOPs (sections 5 and 7), which MFU divides by."""
    model = preset(name)
    work = layer_work(model, microbatch_size, "bf16", attention)
    layer = flops_by_pass(layer_kernels(model, microbatch_size, "bf16", attention))
    assert (layer["F"], layer["I"], layer["W"]) == (work.forward_flops, work.input_grad_flops, work.weight_grad_flops)
    output = flops_by_pass(output_kernels(model, microbatch_size, "bf16"))
    assert (output["F"], output["I"], output["W"]) == output_layer_flops(model, microbatch_size)
    assert layer["optimizer"] == output["optimizer"] == 0


def test_a_kernel_waits_for_compute_or_memory_whichever_is_slower() -> None:
    """Large matmuls run at efficiency x peak; element-wise passes (no FLOPs) at memory_efficiency x bandwidth."""
    costs = h100_costs()
    roofline = costs.roofline
    kernels = {(k.name, k.op): k for k in layer_kernels(MODEL, 1, "bf16")}
    qkv, gelu = kernels["QKV", "F"], kernels["bias-GeLU", "F"]
    assert roofline.seconds(qkv) == qkv.flops / (989e12 * 0.5) and roofline.bound(qkv) == "compute"
    assert roofline.seconds(gelu) == gelu.nbytes / (3350e9 * 0.8) and roofline.bound(gelu) == "memory"
    assert gelu.nbytes == 8 * 1024 * 2048 * 2  # reads and writes the 4h-wide activation in bf16
    tiny = {(k.name, k.op): k for k in layer_kernels(preset("tiny"), 1, "bf16")}
    assert roofline.bound(tiny["QKV", "F"]) == "memory"  # 32 tokens x 64 wide: too little work per byte


def test_memory_efficiency_moves_only_memory_bound_kernels() -> None:
    """Half the memory rate: memory-bound kernels take twice as long, those still compute-bound the same, and a
    kernel near the ridge point (the out projection's weight gradient here) something between."""
    fast, slow = h100_costs(), h100_costs(memory_efficiency=0.4)
    for kernel in layer_kernels(MODEL, 1, "bf16"):
        ratio = slow.roofline.seconds(kernel) / fast.roofline.seconds(kernel)
        if fast.roofline.bound(kernel) == "memory":
            assert ratio == pytest.approx(2.0)
        elif slow.roofline.bound(kernel) == "compute":
            assert ratio == 1.0
        else:
            assert 1.0 < ratio < 2.0


def test_stage_times_are_the_sums_of_their_kernels() -> None:
    """A middle stage's F, I, W are n layers' kernels; the last adds the output layer's; recompute repeats F."""
    costs = h100_costs()
    layer = costs.roofline.pass_seconds(layer_kernels(MODEL, 1, "bf16"))
    output = costs.roofline.pass_seconds(output_kernels(MODEL, 1, "bf16"))
    middle, last = costs.stage_cost(1, 4, 1), costs.stage_cost(3, 4, 1)
    assert middle.forward_ns == seconds_to_ns(6 * layer["F"]) == middle.recompute_ns
    assert middle.input_grad_ns == seconds_to_ns(6 * layer["I"])
    assert middle.weight_grad_ns == seconds_to_ns(6 * layer["W"])
    assert abs(last.input_grad_ns - seconds_to_ns(6 * layer["I"] + output["I"])) <= 1
    assert layer["F"] > layer_work(MODEL, 1, "bf16").forward_flops / (989e12 * 0.5)  # memory passes add time


def test_without_a_memory_bandwidth_only_flops_are_timed() -> None:
    """The model before the roofline: all FLOPs at efficiency x peak, and no optimizer step."""
    costs = AnalyticCosts(MODEL, 1e15, 1, "bf16", 0.5)
    work = layer_work(MODEL, 1, "bf16")
    cost = costs.stage_cost(1, 4, 1)
    assert abs(cost.forward_ns - seconds_to_ns(6 * work.forward_flops / 5e14)) <= 1
    assert cost.optimizer_ns == 0


def test_eager_attention_stashes_the_papers_s_squared_terms_and_flash_none() -> None:
    """Eager: M_B = sb(34h + 5as) (ZB paper); flash: 34sbh plus one fp32 statistic per row and head."""
    s, b, h, a = MODEL.seq, 2, MODEL.hidden, MODEL.heads
    assert layer_work(MODEL, b, "bf16", "eager").activation_bytes == s * b * (34 * h + 5 * a * s)
    assert layer_work(MODEL, b, "bf16", "flash").activation_bytes == 34 * s * b * h + 4 * a * s * b
    assert layer_work(MODEL, b, "fp32", "eager").activation_bytes == 2 * s * b * (34 * h + 5 * a * s)
    assert layer_work(MODEL, b, "fp32", "flash").activation_bytes == 2 * 34 * s * b * h + 4 * a * s * b
    for precision in ("bf16", "fp32"):  # what W keeps after I does not depend on the attention
        assert len({layer_work(MODEL, b, precision, kind).weight_grad_bytes for kind in ATTENTIONS}) == 1
    with pytest.raises(ValueError, match="model.attention: got 'sdpa', expected one of flash, eager"):
        layer_work(MODEL, 1, "bf16", "sdpa")


def test_eager_materialises_score_matrices_that_flash_keeps_on_chip() -> None:
    """At s = 1024 on an H100 the s x s passes of eager attention are memory-bound; flash's core is one
    compute-bound kernel, so the same FLOPs take less time."""
    eager, flash = h100_costs("eager"), h100_costs("flash")
    kernels = {(k.name, k.op): k for k in layer_kernels(MODEL, 1, "bf16", "eager")}
    softmax = kernels["softmax", "F"]
    assert softmax.nbytes == 2 * 16 * 1024 * 1024 * 2 and eager.roofline.bound(softmax) == "memory"
    core = next(k for k in layer_kernels(MODEL, 1, "bf16", "flash") if k.name == "flash attention")
    assert flash.roofline.bound(core) == "compute"
    for op in ("forward_ns", "input_grad_ns"):
        assert getattr(eager.stage_cost(1, 4, 1), op) > getattr(flash.stage_cost(1, 4, 1), op)
    assert eager.stage_cost(1, 4, 1).weight_grad_ns == flash.stage_cost(1, 4, 1).weight_grad_ns


# FlashAttention (arXiv 2205.14135) Appendix E, Table 11, row "Megatron": its eager attention, forward + backward,
# fp16, 16 samples x 8 heads of 64, dropout 0.1, on an A100 40GB (1,555 GB/s): ms at sequence 1,024 and 2,048.
FA1_MEGATRON_A100_MS = {1024: 4.21, 2048: 16.50}


def fa1_benchmark_model(seq: int) -> ModelSpec:
    return ModelSpec("fa1-benchmark", layers=1, hidden=512, heads=8, seq=seq, vocab=8)


@pytest.mark.parametrize("seq", sorted(FA1_MEGATRON_A100_MS))
def test_the_a100_eager_rate_gives_back_the_published_megatron_attention(seq: int) -> None:
    """The A100's eager fraction (topologies/devices.py) is the bytes kernels.py counts for Megatron's attention
    core over FlashAttention's measured times, on the A100 40GB it was measured on: the model gives them back."""
    a100 = DEVICES["a100"]
    costs = AnalyticCosts(fa1_benchmark_model(seq), a100.peak_flops["fp16"], 16, "fp16", a100.gemm_efficiency,
                          memory_bandwidth=1555e9, memory_efficiency=a100.memory_efficiency, attention="eager",
                          eager_efficiency=a100.eager_efficiency, tiling=Tiling(a100.sms))
    core = [k for k in layer_kernels(costs.model, 16, "fp16", "eager") if k.scores]
    assert {k.name for k in core} == {"attention scores", "softmax", "attention dropout", "attention times V",
                                      "attention times V (probabilities)", "attention times V (values)"}
    seconds = sum(costs.roofline.seconds(k) for k in core)
    assert seconds * 1e3 == pytest.approx(FA1_MEGATRON_A100_MS[seq], rel=0.005)
    streaming = replace(costs, eager_efficiency=None).roofline  # at a copy's rate the model was 13% fast
    assert sum(streaming.seconds(k) for k in core) < 0.9 * seconds


def test_the_eager_rate_moves_only_the_score_kernels_and_is_a_config_key(cli) -> None:
    """``costs.eager_efficiency`` replaces the GPU's for eager attention's s x s kernels; flash attention and every
    other kernel keep theirs."""
    eager, half = h100_costs("eager"), h100_costs("eager", eager_efficiency=0.4)
    for kernel in layer_kernels(MODEL, 1, "bf16", "eager"):
        slower = half.roofline.seconds(kernel) > eager.roofline.seconds(kernel)
        assert slower == (kernel.scores and eager.roofline.bound(kernel) == "memory"), kernel.name
    assert not any(k.scores for k in layer_kernels(MODEL, 1, "bf16", "flash"))
    sets = ["--set", "cluster.topology=dgx-a100", "--set", "model.attention=eager", "--json"]
    default = json.loads(cli(["simulate", *sets])[1])
    faster = json.loads(cli(["simulate", *sets, "--set", "costs.eager_efficiency=0.79"])[1])
    assert faster["iteration_time_s"] < default["iteration_time_s"]
    assert default["warnings"] == faster["warnings"] == []  # the A100's rate was measured


def test_eager_attention_on_a_gpu_never_measured_says_so(cli) -> None:
    """On an H100 no measurement of Megatron's eager attention exists: the run says its score kernels stream at a
    copy's rate; naming a fraction, or flash attention, says nothing."""
    report = json.loads(cli(["simulate", "--set", "model.attention=eager", "--json"])[1])
    eager = report["warnings"]
    assert report["model"]["attention"] == "eager"  # and the headline says it
    assert " bf16 eager (analytic)" in cli(["simulate", "--set", "model.attention=eager"])[1].splitlines()[0]
    assert len(eager) == 1 and eager[0].startswith("model.attention: eager on H100") and \
        "costs.eager_efficiency" in eager[0]
    named = ["simulate", "--set", "model.attention=eager", "--set", "costs.eager_efficiency=0.7", "--json"]
    assert json.loads(cli(named)[1])["warnings"] == json.loads(cli(["simulate", "--json"])[1])["warnings"] == []


def test_eager_attention_under_a_profile_says_it_is_not_read(cli) -> None:
    """A profile timed what calibrate ran (torch's scaled_dot_product_attention): model.attention=eager changes
    nothing there, and the run says so instead of passing it over."""
    profile = ["simulate", "--set", "costs.kind=profile", "--set",
               f"costs.profile={Path(__file__).resolve().parents[1] / 'calibration/profiles/h200/gpt-355m'}", "--json"]
    plain, eager = (json.loads(cli([*profile, *extra])[1]) for extra in ([], ["--set", "model.attention=eager"]))
    assert eager["iteration_time_s"] == plain["iteration_time_s"] and eager["model"]["attention"] is None
    assert eager["warnings"] == [*plain["warnings"], "model.attention: eager is not read under a profile's costs, "
                                 "which timed what 'pipescope calibrate' ran (torch's scaled_dot_product_attention)"]


def test_flash_attention_on_a_v100_says_flash_does_not_run_there(cli) -> None:
    """FlashAttention needs sm80: on a V100 its rate is an estimate of something no run there does, and the run
    says so; eager attention there says its own rate was never measured instead."""
    v100 = ["simulate", "--set", "cluster.topology=p3.16xlarge", "--json"]
    [flash] = json.loads(cli(v100)[1])["warnings"]
    assert flash.startswith("model.attention: flash on V100, where FlashAttention does not run")
    [eager] = json.loads(cli([*v100, "--set", "model.attention=eager"])[1])["warnings"]
    assert eager.startswith("model.attention: eager on V100")


def test_the_activation_memory_of_a_run_follows_model_attention() -> None:
    """1F1B, p = 4: device 1 stashes 3 microbatches of 6 layers, so eager needs 18 times the per-layer
    difference more (the p2p buffers at the peak may differ by at most two boundary tensors)."""
    sets = ["schedule.stages=4", "schedule.microbatches=8", "model.preset=gpt-1.3b"]
    flash, eager = (run(load_config(None, [*sets, f"model.attention={kind}"])) for kind in ATTENTIONS)
    per_layer = layer_work(MODEL, 1, "bf16", "eager").activation_bytes - layer_work(MODEL, 1, "bf16").activation_bytes
    boundary = layer_work(MODEL, 1, "bf16").boundary_bytes
    gap = eager.devices[1].peak_memory_bytes - flash.devices[1].peak_memory_bytes
    assert abs(gap - 18 * per_layer) <= 2 * boundary
    assert eager.devices[1].static_memory_bytes == flash.devices[1].static_memory_bytes
    assert eager.config.model.attention == "eager" and flash.config.model.attention == "flash"


@pytest.mark.parametrize(("precision", "bytes_per_param"), [("bf16", 2 + 4 + 28), ("fp32", 4 + 8 + 28)])
def test_analytic_optimizer_step_is_memory_bound(precision: str, bytes_per_param: int) -> None:
    """Gradient norm (read g), clipping (read and write g) and AdamW (read g and the fp32 state, write the state
    and the weights) over the stage's parameters, at memory_efficiency x bandwidth."""
    kernels = optimizer_kernels(1000, precision)
    assert [k.name for k in kernels] == ["gradient norm", "gradient clipping", "AdamW"]
    assert sum(k.nbytes for k in kernels) == 1000 * bytes_per_param
    costs = h100_costs(precision=precision)
    for stage in (0, 1, 3):
        cost = costs.stage_cost(stage, 4, 1)
        assert cost.optimizer_ns == seconds_to_ns(cost.params * bytes_per_param / (3350e9 * 0.8))
        assert cost.optimizer_ns > 0


def test_uniform_optimizer_is_a_per_stage_time_shared_by_chunks() -> None:
    """``costs.optimizer`` is per whole device-stage like F, I and W; default 0 keeps the closed forms."""
    assert UniformCostsConfig().costs("bf16").stage_cost(0, 4, 1).optimizer_ns == 0
    config = load_config(None, ["costs.kind=uniform", "costs.optimizer=2"])
    costs = config.costs.costs("bf16")
    assert costs.stage_cost(0, 4, 1).optimizer_ns == 2 * 10**9
    assert costs.stage_cost(3, 8, 2).optimizer_ns == 10**9
    assert load_config(None, ["costs.optimizer=18.5ms"]).costs.kind == "analytic"  # valid, not in effect


def test_profile_optimizer_is_the_adamw_fit_at_the_stage_parameters(tmp_path: Path) -> None:
    """The hand-made profile's step takes 500 + 3 params + 20 tensors ns; a layer has 700 parameters in 2
    tensors, the embedding 50 (2), the output layer 60 (2): with 5 layers on 2 stages (3 and 2)."""
    costs = ProfiledCosts.load(make_profile(tmp_path / "p"), 2)
    assert costs.stage_cost(0, 2, 1).optimizer_ns == 500 + 3 * (3 * 700 + 50) + 20 * (3 * 2 + 2)
    assert costs.stage_cost(1, 2, 1).optimizer_ns == 500 + 3 * (2 * 700 + 60) + 20 * (2 * 2 + 2)


def test_a_profile_without_optimizer_rows_is_refused(tmp_path: Path) -> None:
    folder = make_profile(tmp_path / "p", parquet=False)
    meta = json.loads((folder / "profile.json").read_text())
    timings = pd.read_csv(folder / meta["tables"]["timings"])
    write_table(folder, "timings", timings[timings["op"] != "step"].to_dict("records"), parquet=False)
    with pytest.raises(ProfileError, match="no optimizer rows; expected a complete profile"):
        ProfiledCosts.load(folder, 2)


def test_simulate_json_lists_each_stages_kernels_once(cli) -> None:
    """Stages with the same kernels form one group; each group's pass times are its kernels' sums and equal the
    ops the timeline ran."""
    code, out, err = cli(["simulate", "--json", "--set", "model.layers_per_stage=5,7,7,5"])
    assert code == 0, err
    groups = json.loads(out)["kernels"]
    assert sorted(stage for group in groups for stage in group["stages"]) == [0, 1, 2, 3]
    middle = next(group for group in groups if group["stages"] == [1, 2])
    assert middle["layers"] == 7
    kernels = middle["kernels"]
    assert {row["component"] for row in kernels} == {"layer", "optimizer"}
    assert {row["bound"] for row in kernels} == {"compute", "memory"}
    for op in PASSES:
        assert middle["pass_time_s"][op] == pytest.approx(sum(r["time_s"] for r in kernels if r["pass"] == op))
    work = layer_work(MODEL, 1, "bf16")
    assert sum(r["flops"] for r in kernels if r["pass"] == "F") == pytest.approx(7 * work.forward_flops)
    result = run(load_config(None, ["model.layers_per_stage=5,7,7,5"]))
    frame = result.timeline
    forward = frame[(frame["kind"] == "F") & (frame["stage"] == 1)]
    assert set(forward["end_ns"] - forward["start_ns"]) == {seconds_to_ns(middle["pass_time_s"]["F"])}


def test_kernels_are_listed_only_under_analytic_costs(cli) -> None:
    code, out, _ = cli(["simulate", "--json", "--set", "costs.kind=uniform"])
    assert code == 0 and json.loads(out)["kernels"] == []
    code, out, _ = cli(["simulate", "--json", "--set", "model.attention=eager", "--set", "model.preset=gpt-355m"])
    names = {row["kernel"] for group in json.loads(out)["kernels"] for row in group["kernels"]}
    assert {"attention scores", "softmax", "attention dropout", "attention times V"} <= names
    assert "flash attention" not in names


@pytest.mark.parametrize(("setting", "message"), [
    ("model.attention=sdpa", "model.attention: got 'sdpa', expected one of flash, eager"),
    ("costs.memory_efficiency=0", "costs.memory_efficiency: got 0.0, expected a number in (0, 1]"),
    ("costs.memory_efficiency=1.5", "costs.memory_efficiency: got 1.5, expected a number in (0, 1]"),
    ("costs.eager_efficiency=0", "costs.eager_efficiency: got 0.0, expected a number in (0, 1]"),
    ("costs.sustained=1e-9", "check the model size and the rate keys costs.efficiency, costs.memory_efficiency, "
                             "costs.eager_efficiency and costs.sustained"),
    ("costs.optimizer=-1", "costs.optimizer: got -1, expected a non-negative time"),
])
def test_bad_values_are_one_line_errors(setting: str, message: str, cli) -> None:
    code, out, err = cli(["simulate", "--set", setting])
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_roofline_without_memory_rate_times_flops_only() -> None:
    roofline = Roofline(1e12, 1.0, None)
    kernel = Kernel("x", "F", 2e12, 1e15)
    assert roofline.seconds(kernel) == 2.0 and roofline.bound(kernel) == "compute"
    assert roofline.seconds(Kernel("add", "F", 0, 1e9)) == 0.0


def test_a_gpu_without_a_datasheet_is_its_peak_and_bandwidth_on_a_known_machine() -> None:
    """``cluster.peak_flops`` and ``cluster.memory_bandwidth`` replace the datasheet's numbers in every kernel: at
    twice the H100's both, every kernel (compute- or memory-bound) takes half; MFU is against the given peak."""
    base = ["model.preset=gpt-355m", "schedule.stages=2", "schedule.microbatches=2"]
    h100 = run(load_config(None, base))
    spec = DEVICES["h100"]
    double = run(load_config(None, [*base, f"cluster.peak_flops={2 * spec.peak_flops['bf16']:g}",
                                    f"cluster.memory_bandwidth={2 * spec.memory_bandwidth / 1e12:g}TB/s"]))
    for mine, theirs in zip(double.kernels, h100.kernels):
        for k, (a, b) in enumerate(zip(mine["kernels"], theirs["kernels"])):
            assert a["time_s"] == pytest.approx(b["time_s"] / 2, rel=1e-6), (k, a["kernel"])
    assert double.mfu == pytest.approx(h100.mfu * h100.iteration_time_s / double.iteration_time_s / 2, rel=1e-9)
    v100_bf16 = ["cluster.topology=p3.16xlarge", "model.precision=bf16", *base]  # V100 has no bf16 tensor cores
    with pytest.raises(ConfigError, match="V100 GPUs have no bf16 tensor cores"):
        run(load_config(None, v100_bf16))
    assert run(load_config(None, [*v100_bf16, "cluster.peak_flops=100TFLOP/s"])).iteration_time_s > 0  # as told
    for value, expected in (("5", "5 FLOP/s, expected a compute rate from 1 GFLOP/s to 1000 PFLOP/s"),
                            ("9EFLOP/s", "unknown unit 'EFLOP/s'")):
        with pytest.raises(ConfigError, match=f"cluster.peak_flops: got .*{re.escape(expected)}"):
            load_config(None, [f"cluster.peak_flops={value}"])
