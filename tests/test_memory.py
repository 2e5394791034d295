"""The memory ledger: weight versions, optimizer state, activation stashes, against docs/schedules.md's formulas."""

import argparse
import dataclasses

import numpy as np
import pytest

from pipescope.simulator.costs import AnalyticCosts, StageCost, UniformCosts
from pipescope.simulator.memory_runtime import RUNTIMES
from pipescope.simulator.memory import static_memory
from pipescope.simulator.models import layer_work, preset
from pipescope.topologies.devices import DEVICES
from pipescope.simulator.schedules import build
from pipescope.simulator.simulate import simulate

MODEL = preset("gpt-1.3b")
COSTS = AnalyticCosts(MODEL, DEVICES["h100"].peak_flops["bf16"], microbatch_size=1, precision="bf16")


def test_static_bytes_per_parameter() -> None:
    """Mixed precision: 2 (weights) + 2 (grads) + 12 (Adam, fp32 master) = 16 bytes under torch; Megatron's fp32
    main_grad makes the gradient 4, so 18; each extra version +2. fp32: 16 under both."""
    assert static_memory(1000, 1, "bf16", "torch").total == 16_000
    assert static_memory(1000, 1, "bf16").total == static_memory(1000, 1, "bf16", "megatron").total == 18_000
    assert static_memory(1000, 1, "bf16").gradients == 4_000
    assert static_memory(1000, 3, "bf16").weights == 6_000
    assert static_memory(1000, 1, "fp32").total == static_memory(1000, 1, "fp32", "torch").total == 16_000
    assert static_memory(1000, 1, "bf16", "deepspeed").gradients == 6_000  # fp32 accumulator + autograd's bf16
    assert static_memory(1000, 1, "fp16", "deepspeed").gradients == 2_000  # no BF16 optimizer: fp16 as Megatron


def test_pipedream_holds_p_minus_r_versions() -> None:
    """PipeDream: device r's static memory counts p-r weight versions (stage 0 p, the last 1)."""
    p = 4
    result = simulate(build("pipedream", p, 8), COSTS)
    for r, device in enumerate(result.devices):
        params = COSTS.stage_cost(r, p, 1).params
        assert device.static_memory_bytes == static_memory(params, p - r, "bf16").total


def test_2bw_holds_exactly_two_versions() -> None:
    """2BW: every device holds exactly 2 weight versions."""
    p = 4
    result = simulate(build("2bw", p, 8), COSTS)
    for r, device in enumerate(result.devices):
        assert device.static_memory_bytes == static_memory(COSTS.stage_cost(r, p, 1).params, 2, "bf16").total


@pytest.mark.parametrize("recompute", [False, True])
def test_2bw_activation_formula(recompute: bool) -> None:
    """docs/schedules.md section 3 on the ledger's first device, GPT 1.3B, d = 4 stages of 6 layers.

    Without recompute d * |A_total(b)| / d = |A_total(b)|; with recompute |A_total(b)| / d + d * |A_input(b)|, where
    the first stage's input is its token ids.
    The paper's extra d * |A_input(b)| without recompute is inside M_B here (a layer's stash includes its
    input), so it is not counted twice. p2p buffers may add up to two boundary tensors at the peak.
    """
    d, m = 4, 8
    work = layer_work(MODEL, 1, "bf16")
    a_total, a_input = MODEL.layers * work.activation_bytes, work.boundary_bytes
    token_ids = MODEL.seq * 8  # what the first stage keeps under recompute: its input is int64 token ids
    expected = a_total // d + d * token_ids if recompute else a_total
    result = simulate(build("2bw", d, m, recompute=recompute), COSTS)
    device = result.devices[0]
    dynamic_peak = device.peak_memory_bytes - device.static_memory_bytes
    assert expected <= dynamic_peak <= expected + 2 * a_input
    weights = static_memory(COSTS.stage_cost(0, d, 1).params, 2, "bf16").weights
    assert weights == 2 * 2 * COSTS.stage_cost(0, d, 1).params  # 2|W|/d in bf16 bytes


def test_deferred_w_holds_m_w() -> None:
    """ZB-H1: after an I the device still holds M_W until its W, so memory between them exceeds plain 1F1B's."""
    costs = UniformCosts(activation_bytes=1000, weight_grad_bytes=100)
    zb = simulate(build("zb-h1", 4, 8), costs)
    flush = simulate(build("1f1b", 4, 8), costs)
    assert zb.devices[3].peak_memory_bytes > flush.devices[3].peak_memory_bytes
    assert zb.devices[0].peak_activations == flush.devices[0].peak_activations == 4


def test_memory_timeline_starts_and_ends_at_static() -> None:
    """Each device's timeline holds its static bytes from the run's start (a later stage's first op comes later: its
    line started there) and is back at them after the last op, every stash freed."""
    result = simulate(build("1f1b", 4, 8), COSTS)
    first_ops = result.timeline.groupby("device")["start_ns"].min()
    assert first_ops.iloc[-1] > 0
    for device, memory in zip(result.devices, result.memory):
        assert (memory.times[0], memory.bytes_in_use[0]) == (0, device.static_memory_bytes)
        assert memory.bytes_in_use[-1] == device.static_memory_bytes
        assert memory.bytes_in_use.min() >= device.static_memory_bytes


@dataclasses.dataclass(frozen=True)
class BoundaryCosts(UniformCosts):
    """Uniform costs whose stages send BOUNDARY bytes (outputs and input gradients)."""

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        return dataclasses.replace(super().stage_cost(stage, num_stages, chunks), boundary_bytes=BOUNDARY,
                                   param_tensors=TENSORS)


BOUNDARY, ACTIVATION, PARAMS, TENSORS = 100, 1000, 10_000, 7


def _at(memory, time_ns: int) -> int:
    """Bytes in use just after ``time_ns`` (the last row at that time: frees and allocations at it applied)."""
    return int(memory.bytes_in_use[np.searchsorted(memory.times, time_ns, side="right") - 1])


# Per runtime: gradient bytes per parameter, device 0's held boundaries at its peak, device 1's when its last
# backward starts, step-counter bytes per tensor
RUNTIME_HOLDS = {"megatron": (4, 0, 0, 0), "deepspeed": (6, 4, 0, 0), "torch": (2, 5, 3, 4)}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtimes_hold_outputs_and_sent_buffers_as_their_runtime_does(runtime: str) -> None:
    """GPipe, p = 2, m = 4, instant transfers, so Megatron holds no p2p buffer for any time.

    torch keeps device 0's four outputs (sent) until the end of the step, and each received gradient until its
    backward ends: at its first backward 4 stashes + 4 outputs + 1 gradient. Device 1 keeps the input gradients it
    sent: when its last backward starts, 3 of them. Megatron frees all of them, and its gradients are 4 bytes per
    parameter under bf16 (torch: 2); torch's AdamW adds a 4-byte step counter per parameter tensor. DeepSpeed's
    pipe buffers keep device 0's outputs until each one's backward (4 at the first), and its BF16 optimizer keeps
    bf16 gradients beside fp32 ones (6 bytes)."""
    grad, held_0, held_1, counter = RUNTIME_HOLDS[runtime]
    costs = BoundaryCosts(activation_bytes=ACTIVATION, params=PARAMS, precision="bf16")
    result = simulate(build("gpipe", 2, 4), costs, memory_runtime=runtime)
    static = PARAMS * (2 + grad + 12) + counter * TENSORS  # per device-stage
    assert [d.static_memory_bytes for d in result.devices] == [static, static]
    assert result.devices[0].peak_memory_bytes == static + 4 * ACTIVATION + held_0 * BOUNDARY
    frame = result.timeline
    last_backward = frame[(frame["device"] == 1) & (frame["kind"] == "B")]["start_ns"].max()
    assert _at(result.memory[1], last_backward) == static + ACTIVATION + held_1 * BOUNDARY
    assert result.memory[0].bytes_in_use[-1] == result.memory[1].bytes_in_use[-1] == static  # all freed at the end
    if runtime == "deepspeed":  # each output is freed when its backward ends: one fewer after device 0's first
        first_backward_end = frame[(frame["device"] == 0) & (frame["kind"] == "B")]["end_ns"].min()
        assert _at(result.memory[0], first_backward_end) == static + 3 * ACTIVATION + 3 * BOUNDARY


def test_validate_simulates_with_torch_accounting() -> None:
    from pipescope.experiments.validate_cmd import _sets
    args = argparse.Namespace(schedule="1f1b", stages="2", microbatches="4", microbatch_size="1", chunks=None,
                              recompute=False)
    assert "memory.runtime=torch" in _sets(args, "profile") and "schedule.recompute=true" not in _sets(args, "p")
    assert "schedule.recompute=true" in _sets(argparse.Namespace(**{**vars(args), "recompute": True}), "p")


def test_an_embedding_layer_norm_keeps_its_input_on_the_first_stage_only() -> None:
    """BLOOM's layer norm after the embedding (``ModelSpec.embedding_norm``) sits outside the checkpointed blocks: the
    first stage keeps its input (the embedding's output) and two fp32 numbers a token for each microbatch in flight,
    with or without recompute; its weight and bias are two more vectors; its passes stream that tensor."""
    model = preset("gpt-1.3b")
    normed = dataclasses.replace(model, embedding_norm=True)
    tokens, h = 2 * model.seq, model.hidden
    for checkpoint in (False, True):
        costs = [AnalyticCosts(m, 312e12, microbatch_size=2, precision="bf16", memory_bandwidth=2e12,
                               checkpoint_layers=checkpoint) for m in (model, normed)]
        plain, with_norm = ([c.stage_cost(s, 4, 1) for s in range(4)] for c in costs)
        kept = tokens * h * 2 + tokens * 8
        assert with_norm[0].activation_bytes - plain[0].activation_bytes == kept
        assert with_norm[0].input_bytes - plain[0].input_bytes == kept
        assert with_norm[0].params - plain[0].params == 2 * h
        assert with_norm[0].forward_ns > plain[0].forward_ns and with_norm[0].input_grad_ns > plain[0].input_grad_ns
        assert with_norm[1:] == plain[1:]
    assert normed.total_params() - model.total_params() == 2 * h


def test_a_profile_refuses_an_embedding_layer_norm_it_did_not_time() -> None:
    from pathlib import Path

    from pipescope import ConfigError, load_config, run

    profile = str(Path(__file__).resolve().parent.parent / "calibration" / "profiles" / "h200" / "tiny")
    with pytest.raises(ConfigError, match=r"^model\.embedding_norm: got true under costs\.kind profile, expected "
                                          r"false"):
        run(load_config(None, ["costs.kind=profile", f"costs.profile={profile}", "model.embedding_norm=true"]))
