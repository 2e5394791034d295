"""``model.layers_per_stage``: uneven transformer-layer splits (Megatron-style), from YAML and ``--set``, checked
against the schedule's stages, and followed by the analytic and profile cost models and the memory ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_profiled_costs import make_profile, op_time

from pipescope.config import ConfigError, load_config
from pipescope.runner import run
from pipescope.simulator.costs import AnalyticCosts, seconds_to_ns, split_layers
from pipescope.simulator.memory import static_memory
from pipescope.simulator.models import PRESETS, layer_work, preset, stage_layers
from pipescope.simulator.profiled import ProfiledCosts
from pipescope.simulator.result import SimResult

KEY = "model.layers_per_stage"
BASE = ["model.preset=gpt-355m", "schedule.stages=4", "schedule.microbatches=4"]  # 24 layers over 4 stages
MODEL = PRESETS["gpt-355m"]


def config_error(sets: list[str] = (), path: str | None = None) -> str:
    """The one-line ConfigError that loading and running the config gives, naming the key."""
    with pytest.raises(ConfigError) as err:
        run(load_config(path, list(sets)))
    message = str(err.value)
    assert "\n" not in message and err.value.key == KEY, message
    return message


def forward_ns(result: SimResult) -> dict[int, int]:
    """Each stage's F duration in a run (every microbatch's F of a stage takes the same time)."""
    frame = result.timeline
    f = frame[frame["kind"] == "F"]
    durations = (f["end_ns"] - f["start_ns"]).groupby(f["stage"]).agg(["min", "max"])
    assert (durations["min"] == durations["max"]).all()
    return durations["min"].to_dict()


def test_the_default_split_is_the_old_equal_split() -> None:
    """Unset, stage_layers is equal slices with the remainder on the earliest stages, exactly as before; a run
    reports the split it used in its config, and giving that split explicitly changes nothing."""
    for layers, stages in ((24, 4), (5, 2), (7, 3), (100, 7), (9, 9)):
        base, extra = divmod(layers, stages)
        old = [base + (1 if s < extra else 0) for s in range(stages)]
        assert stage_layers(layers, stages) == split_layers(layers, stages) == old
    default = run(load_config(None, BASE))
    assert default.config.model.layers_per_stage == (6, 6, 6, 6)
    explicit = run(load_config(None, [*BASE, f"{KEY}=6,6,6,6"]))
    assert explicit.iteration_ns == default.iteration_ns
    assert [d.static_memory_bytes for d in explicit.devices] == [d.static_memory_bytes for d in default.devices]


@pytest.mark.parametrize(("value", "expected"), [
    ("4,4", f"{KEY}: got [4, 4], expected 4 entries (one per stage: schedule.stages x chunks)"),
    ("[6,6,6,6,6]", f"{KEY}: got [6, 6, 6, 6, 6], expected 4 entries"),
    ("[5,6,6,6]", f"{KEY}: [5, 6, 6, 6] sums to 23, expected model.layers = 24"),
    ("0,8,8,8", f"{KEY}: got 0 at entry 1, expected an integer from 1 to 100,000"),
    ("8,-2,9,9", f"{KEY}: got -2 at entry 2, expected an integer from 1 to 100,000"),
    ("6,6.5,6,5", f"{KEY}: got '6.5' at entry 2, expected an integer"),
    ("[6, 6, x, 6]", f"{KEY}: got 'x' at entry 3, expected an integer"),
    ("[6, true, 6, 6]", f"{KEY}: got True at entry 2, expected an integer"),
    ("6,,6,6", f"{KEY}: got '' at entry 2, expected an integer"),
    ("", f"{KEY}: got '', expected a list of integers such as 5,6,6,5"),
    ("[]", f"{KEY}: got [], expected a list of integers such as 5,6,6,5"),
    (",".join(["1"] * 100_001), f"{KEY}: got 100,001 entries, expected at most 100,000"),
])
def test_bad_lists_from_set_are_one_line_errors(value: str, expected: str) -> None:
    assert config_error([*BASE, f"{KEY}={value}"]).startswith(expected)


@pytest.mark.parametrize(("value", "expected"), [
    ("[4, 4]", "got [4, 4], expected 4 entries"),
    ("[7, 7, 7, 7]", "[7, 7, 7, 7] sums to 28, expected model.layers = 24"),
    ("[6, 0, 6, 12]", "got 0 at entry 2, expected an integer from 1 to 100,000"),
    ("[6, -6, 12, 12]", "got -6 at entry 2"),
    ("[6, 6, 6, 5.5]", "got 5.5 at entry 4"),
    ("[6, 6, [6], 6]", "got [6] at entry 3"),
    ("{a: 1}", "got {'a': 1} at entry 1"),
    ("[" + ", ".join(["1"] * 100_001) + "]", "got 100,001 entries, expected at most 100,000"),
])
def test_bad_lists_from_yaml_are_one_line_errors(value: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  preset: gpt-355m\n  layers_per_stage: {value}\n"
                    "schedule:\n  stages: 4\n  microbatches: 4\n")
    assert config_error(path=str(path)).startswith(f"{KEY}: {expected}")


def test_yaml_list_comma_string_and_set_list_agree(tmp_path: Path) -> None:
    """A YAML list, ``--set key=5,7,7,5`` and ``--set key=[5, 7, 7, 5]`` are the same config; null is unset."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  layers_per_stage: [5, 7, 7, 5]\n")
    forms = [load_config(str(path)), load_config(None, [f"{KEY}=5,7,7,5"]),
             load_config(None, [f"{KEY}=[5, 7, 7, 5]"]), load_config(None, [f"{KEY}= 5, 7 ,7,5 "])]
    assert {c.model.layers_per_stage for c in forms} == {(5, 7, 7, 5)}
    assert load_config(None, [f"{KEY}=null"]).model.layers_per_stage is None


def test_analytic_stage_costs_follow_the_list() -> None:
    """Each stage's forward time and its activation, weight-grad and parameter bytes are its own layer count
    times one layer's; the first stage adds the embedding, the last the output layer, as with the equal split."""
    split = (5, 7, 9, 3)
    work = layer_work(MODEL, 1, "bf16")
    costs = AnalyticCosts(MODEL, 1e15, layers_per_stage=split)
    equal = AnalyticCosts(MODEL, 1e15)
    rate = 1e15 * 0.5
    for stage in (1, 2):
        n, cost = split[stage], costs.stage_cost(stage, 4, 1)
        assert cost.forward_ns == seconds_to_ns(n * work.forward_flops / rate)
        assert cost.activation_bytes == n * work.activation_bytes
        assert cost.weight_grad_bytes == n * work.weight_grad_bytes
        assert cost.params == n * MODEL.layer_params()
    for stage in (0, 3):  # embedding and output layer on top of the layers, unchanged by the split
        cost, base = costs.stage_cost(stage, 4, 1), equal.stage_cost(stage, 4, 1)
        assert cost.params - base.params == (split[stage] - 6) * MODEL.layer_params()
        assert cost.activation_bytes - base.activation_bytes == (split[stage] - 6) * work.activation_bytes
    with pytest.raises(ValueError, match=f"{KEY}: got \\[5, 7, 9, 3\\], expected 2 entries"):
        costs.stage_cost(0, 2, 1)


def test_a_run_follows_the_list_in_time_and_memory() -> None:
    """Through run(): stage 2 with 9 layers takes 9/6 of the equal split's forward and holds 9/6 of its
    parameters (1F1B: one stage per device, no embedding or output layer on device 2)."""
    even = run(load_config(None, BASE))
    uneven = run(load_config(None, [*BASE, f"{KEY}=5,7,9,3"]))
    assert uneven.config.model.layers_per_stage == (5, 7, 9, 3)
    f_even, f_uneven = forward_ns(even), forward_ns(uneven)
    assert sorted(f_uneven) == [0, 1, 2, 3]
    assert abs(6 * f_uneven[2] - 9 * f_even[2]) <= 9  # each time rounded to 1 ns
    assert abs(6 * f_uneven[1] - 7 * f_even[1]) <= 7
    overhead = uneven.memory_overheads.total  # what the GPU holds besides tensors, the same for any split
    tensors = [result.devices[2].static_memory_bytes - overhead for result in (uneven, even)]
    assert tensors[0] * 6 == tensors[1] * 9
    assert uneven.devices[1].peak_memory_bytes > even.devices[1].peak_memory_bytes


def test_with_two_chunks_the_list_is_per_chunk_stage() -> None:
    """zb-v on 2 devices has 4 stages (device 0 holds stages 0 and 3, device 1 stages 1 and 2): the list has 4
    entries in stage order, and each device's parameters are the sum over its stages."""
    sets = ["model.preset=gpt-355m", "model.layers=8", "schedule.name=zb-v", "schedule.stages=2",
            "schedule.microbatches=4"]
    assert config_error([*sets, f"{KEY}=4,4"]).startswith(f"{KEY}: got [4, 4], expected 4 entries")
    result = run(load_config(None, [*sets, f"{KEY}=1,3,2,2"]))
    assert result.config.model.layers_per_stage == (1, 3, 2, 2)
    f = forward_ns(result)
    assert abs(2 * f[1] - 3 * f[2]) <= 3  # 3 layers against 2, each time rounded to 1 ns
    spec = preset("gpt-355m", layers=8)
    stage_params = [n * spec.layer_params() for n in (1, 3, 2, 2)]
    stage_params[0] += spec.embedding_params()
    stage_params[3] += spec.output_params()
    for device, stages in ((0, (0, 3)), (1, (1, 2))):
        params = sum(stage_params[s] for s in stages)
        assert result.devices[device].static_memory_bytes == static_memory(params, 1, "bf16").total + \
            result.memory_overheads.total


def test_profiled_costs_follow_the_list(tmp_path: Path) -> None:
    """A profile's per-layer times and bytes times each stage's layers: 5 layers as 1 + 4 instead of 3 + 2."""
    folder = make_profile(tmp_path)
    costs = ProfiledCosts.load(folder, microbatch_size=2, layers_per_stage=(1, 4))
    first, last = costs.stage_cost(0, 2, 1), costs.stage_cost(1, 2, 1)
    assert (first.params, last.params) == (1 * 700 + 50, 4 * 700 + 60)
    assert first.forward_ns == (1 + 10) * op_time("F", 2, 128)
    assert last.forward_ns == (4 + 3) * op_time("F", 2, 128)
    assert last.recompute_ns == 4 * op_time("R", 2, 128)
    assert first.activation_bytes == (1 + 1) * 1000 * 2 * 128
    assert last.weight_grad_bytes == (4 + 1) * 200 * 2 * 128


def test_a_profile_run_follows_and_checks_the_list(tmp_path: Path) -> None:
    """Through run(): the profile's 5 layers split 1 + 4 time each stage's forward by its layers; a list summing
    to another count than the profile's layers is refused naming both."""
    folder = make_profile(tmp_path)
    sets = ["costs.kind=profile", f"costs.profile={folder}", "schedule.stages=2", "schedule.microbatches=4",
            "model.microbatch_size=2"]
    result = run(load_config(None, [*sets, f"{KEY}=1,4"]))
    assert result.config.model.layers_per_stage == (1, 4)
    assert forward_ns(result) == {0: 11 * op_time("F", 2, 128), 1: 7 * op_time("F", 2, 128)}
    assert run(load_config(None, sets)).config.model.layers_per_stage == (3, 2)
    assert config_error([*sets, f"{KEY}=2,2"]) == f"{KEY}: [2, 2] sums to 4, expected model.layers = 5"


def test_uniform_costs_do_not_read_the_list() -> None:
    """Uniform costs are per stage and take no layers: the list changes nothing and is left as given."""
    sets = ["costs.kind=uniform", "schedule.stages=4", "schedule.microbatches=8"]
    plain, given = run(load_config(None, sets)), run(load_config(None, [*sets, f"{KEY}=1,2,3,4"]))
    assert plain.iteration_ns == given.iteration_ns
    assert plain.config.model.layers_per_stage is None and given.config.model.layers_per_stage == (1, 2, 3, 4)

