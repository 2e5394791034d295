"""A newcomer's second hour (issue 28): the planner plans what it was given, a custom shape is named by its
dimensions, one gradient size everywhere, injection bandwidth counted once, the units people use, and what would
fit when nothing does."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

import pipescope
from pipescope.experiments.plan import _allreduce_floor
from pipescope.runner import prepare
from pipescope.simulator.models import ModelConfig
from pipescope.topologies.summary import summarize
from pipescope.topologies.topology_io import load_topology

ONE_CANDIDATE = ["--global-batch", "64", "--schedules", "1f1b", "--tensor", "1", "--depths", "1",
                 "--microbatch-sizes", "4", "--recompute", "none", "--vocab", "naive", "--workers", "1",
                 "--no-progress"]


@pytest.fixture
def planned_file(tmp_path: Path) -> Path:
    path = tmp_path / "f.yaml"
    path.write_text("model: {preset: gpt-355m}\ncluster: {topology: dgx-a100, nodes: 2}\n"
                    "parallel: {tensor: 4, sequence: true}\n")
    return path


def test_plan_plans_the_files_model_and_cluster_and_says_which_keys_it_set(cli, planned_file: Path) -> None:
    """The flags' defaults overrode the file (612 candidates on 8 GPUs of gpt-1.3b), and the file's tensor width
    and sequence parallelism rejected every t = 1 candidate: the best plan disappeared."""
    code, out, err = cli(["plan", "--config", str(planned_file), *ONE_CANDIDATE, "--json"])
    report = json.loads(out)
    assert code == 0, err
    assert report["planned_for"] == "gpt-355m on 2 x dgx-a100, 16 a100 GPUs" and report["gpus"] == 16
    assert report["best"]["tensor"] == 1 and report["best"]["width"] == 16
    assert report["file_keys_searched"] == {"parallel.tensor": 4, "parallel.sequence": True}
    code, out, _ = cli(["plan", "--config", str(planned_file), *ONE_CANDIDATE, "--nodes", "1"])
    assert code == 0 and out.startswith("plan: gpt-355m on 1 x dgx-a100, 8 a100 GPUs: 1 candidate,")
    assert "not used from the config (the search sets them): parallel.tensor=4, parallel.sequence=true" in out


def test_a_custom_shape_is_named_by_its_dimensions_not_as_the_preset() -> None:
    custom = ModelConfig(layers=96, hidden=12288, heads=96)
    assert custom.label == "GPT layers=96, hidden=12288, heads=96 (seq=1024, vocab=50257 from gpt-1.3b)"
    assert ModelConfig(preset="gpt-355m").label == "gpt-355m"
    assert ModelConfig(preset="gpt-355m", layers=24).label == "gpt-355m"  # the preset's own value
    whole = ModelConfig(layers=2, hidden=64, heads=4, seq=32, vocab=100)
    assert whole.label == "GPT layers=2, hidden=64, heads=4, seq=32, vocab=100"


def test_the_planners_allreduce_floor_moves_the_gradient_bytes_the_ledger_holds() -> None:
    """Megatron keeps (and reduces) a bf16 model's gradients in fp32; the floor counted 2 bytes a parameter."""
    floors = {}
    for runtime in ("megatron", "torch"):
        built = prepare(pipescope.load_config(raw={
            "model": {"preset": "gpt-355m", "layers": 4, "precision": "bf16"}, "memory": {"runtime": runtime},
            "cluster": {"topology": "dgx-a100", "data_parallel": 2},
            "schedule": {"name": "1f1b", "stages": 4, "microbatches": 4}}))
        floors[runtime] = _allreduce_floor(built, built.stage_costs())
    assert floors["torch"] > 0 and floors["megatron"] == pytest.approx(2 * floors["torch"], rel=1e-6)


def test_injection_bandwidth_counts_a_gpus_pcie_port_once() -> None:
    """dgx-h100's GPU has edges to its PCIe switch and to its NIC through that switch: 450 + 64, not + 64 + 64."""
    assert summarize(load_topology("dgx-h100", 1, None, 1))["gpu_injection_bandwidth"] == 514e9


def test_simulate_reports_tokens_tflops_and_the_cost_of_a_training_run(cli) -> None:
    code, out, _ = cli(["simulate", "--config", "demo", "--json", "--train-tokens", "1T", "--gpu-hour-price", "2.5"])
    s = json.loads(out)
    seq = 1024  # demo.yaml: gpt-1.3b at its preset's sequence
    assert code == 0 and s["gpus"] == 4
    assert s["tokens_per_s"] == pytest.approx(s["throughput_samples_per_s"] * seq)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(s["tokens_per_s"] / 4)
    assert s["tflops_per_gpu"] == pytest.approx(s["mfu"] * 989.4, rel=1e-3)  # H100 SXM dense bf16
    training = s["training"]
    assert training["time_to_train_s"] == pytest.approx(1e12 / s["tokens_per_s"])
    assert training["gpu_hours"] == pytest.approx(training["time_to_train_s"] * 4 / 3600)
    assert training["cost"] == pytest.approx(2.5 * training["gpu_hours"])
    code, out, _ = cli(["simulate", "--config", "demo", "--train-tokens", "300B"])
    days = 300e9 / s["tokens_per_s"] / 86400
    assert code == 0 and f"to train on 300 B tokens: {days:.1f} days" in out and "cost" not in out
    assert "TFLOP/s per GPU" in out and "tokens/s" in out


@pytest.mark.parametrize("flags, expected", [
    (["--gpu-hour-price", "2"], "--gpu-hour-price: got '2' without --train-tokens, expected --train-tokens N too"),
    (["--train-tokens", "1X"], "--train-tokens: got '1X': unknown unit 'X', expected one of k, K, M, B, G, T"),
    (["--train-tokens", "0"], "--train-tokens: got 0, expected a count from 1 to 1e+16"),
    (["--train-tokens", "0.5"], "--train-tokens: got 0.5, expected a count from 1 to 1e+16"),
    (["--train-tokens", "1T", "--gpu-hour-price", "nan"], "--gpu-hour-price: got 'nan', expected a number"),
    (["--train-tokens", "1T", "--gpu-hour-price", "-1"], "--gpu-hour-price: got -1, expected a price from 0"),
])
def test_bad_training_goals_are_one_line_usage_errors(cli, flags: list[str], expected: str) -> None:
    code, out, err = cli(["simulate", "--config", "demo", *flags])
    assert (code, out) == (2, "") and err.startswith(f"pipescope: error: {expected}") and err.count("\n") == 1


def test_plan_ranks_with_tokens_mfu_and_the_runs_cost(cli) -> None:
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", *ONE_CANDIDATE,
                        "--train-tokens", "1T", "--gpu-hour-price", "2", "--json"])
    best = json.loads(out)["best"]
    assert code == 0 and best["tokens_per_s"] == pytest.approx(best["throughput_samples_per_s"] * 1024)
    assert best["cost"] == pytest.approx(2 * 8 * 1e12 / best["tokens_per_s"] / 3600)
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", *ONE_CANDIDATE,
                        "--train-tokens", "1T"])
    head = out.splitlines()[1]
    assert code == 0 and all(column in head for column in ("tokens/s", "TFLOP/s", "MFU", "to train"))
    assert "cost" not in head
    assert " ms " in out.splitlines()[2] or out.splitlines()[2].rstrip().endswith("days")


def test_when_nothing_fits_the_plan_names_the_closest_and_what_would_fit() -> None:
    """It showed the first rejection of each kind (the worst as often as not) and said nothing of what would fit.
    One plan, its JSON and its table (``plan_cmd.as_json`` and ``summary``, what the CLI prints)."""
    from pipescope.experiments.plan import plan
    from pipescope.experiments.plan_cmd import as_json, summary
    from pipescope.experiments.plan_space import PlanRequest, base_config

    request = PlanRequest(base_config("gpt-3.8b", "dgx-a100", None, 8 << 30), 64, schedules=("1f1b",), tensor=(1,),
                          recompute=("none",), microbatch_sizes=(1, 2), vocab=("naive",))
    result = plan(request, workers=1, progress=False)
    report, out = as_json(result), summary(result, request.top)
    assert report["best"] is None
    needs = [r["needs_bytes"] for r in report["rejected"] if "needs_bytes" in r]
    assert needs and min(needs) > 8 * 2**30
    fit = report["would_fit"]
    assert fit["nodes"] > 1 and fit["recompute"] == "full" and fit["microbatch_size"] == 1
    assert fit["peak_memory_bytes"] <= 8 * 2**30 and fit["gpus"] == 8 * fit["nodes"]
    closest = min((r for r in report["rejected"] if "needs_bytes" in r), key=lambda r: r["needs_bytes"])
    assert f"closest to fitting: 1f1b w={closest['width']} d={closest['depth']}" in out
    sharded = f" and ZeRO-{fit['zero']}" if fit["zero"] else ""  # ZeRO-3 is tried too (tests/test_zero.py)
    assert f"would fit: {fit['nodes']} nodes ({fit['gpus']} GPUs) with full recompute and microbatch 1{sharded}, e.g." \
        in out


def test_a_failed_sweep_run_is_named_by_its_point(cli, tmp_path: Path) -> None:
    """It printed only the run id, a hash the user never wrote."""
    grid = tmp_path / "grid.yaml"
    grid.write_text("schedule: {name: 1f1b, stages: 4, microbatches: 8}\nsweep:\n  schedule.stages: [4, 64]\n")
    code, out, _ = cli(["sweep", str(grid), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert code == 1 and "error: schedule.stages=64 (run " in out and "the run needs 64 GPUs" in out
    # the units people use, each a column of its own (tokens_per_s is not only the start of tokens_per_s_per_gpu)
    assert all(re.search(rf"\b{column}\b", out) for column in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu",
                                                                "mfu"))


@pytest.mark.parametrize("args, expected", [
    (["--schedule", "zbv"], "schedule.name: got 'zbv', expected one of gpipe, "),
    (["--set", "schedule.microbatchs=4"], "schedule.microbatchs: unknown key, expected one of schedule.name, "),
    (["--set", "costs.eficiency=0.5"], "costs.eficiency: unknown key, expected one of costs.backward_input, "),
    (["--set", "costs.kind=analitic"], "costs.kind: got 'analitic', expected one of analytic, uniform, profile"),
    (["--set", "model.preset=gpt-1.3"], "model.preset: got 'gpt-1.3', expected one of tiny, "),
])
def test_a_near_miss_names_the_nearest_valid_choice(cli, args: list[str], expected: str) -> None:
    code, out, err = cli(["simulate", *args])
    nearest = {"zbv": "zb-v", "schedule.microbatchs=4": "schedule.microbatches", "costs.eficiency=0.5":
               "costs.efficiency", "costs.kind=analitic": "analytic", "model.preset=gpt-1.3": "gpt-1.3b"}[args[1]]
    assert (code, out) == (2, "") and err.startswith(f"pipescope: error: {expected}")
    assert err.endswith(f" (did you mean {nearest}?)\n") and err.count("\n") == 1


def test_schedule_names_are_matched_without_regard_to_case(cli) -> None:
    code, out, _ = cli(["simulate", "--schedule", "ZB-V", "--json"])
    assert code == 0 and json.loads(out)["schedule"] == "zb-v"


def test_the_planner_reads_schedule_names_without_regard_to_case_or_alias() -> None:
    """``--schedules ZB-V,1F1B`` planned a depth-1 run as ZB-V (the 1F1B test was on the name as typed) and
    ``ZB-V,zb-v`` twice; vocab-1 refused '1F1B'. One name per generator, its own."""
    from pipescope.experiments.plan_space import PlanRequest, _schedules_at

    request = PlanRequest({}, 8, schedules=("ZB-V", "1F1B", "zb-v", "Pipedream-Flush", "no-such"))
    assert request.schedules == ("zb-v", "1f1b", "no-such")
    assert _schedules_at(1, request.schedules) == ("1f1b",)
    report = pipescope.plan(PlanRequest({}, 8, schedules=("1F1B",), depths=(4,), tensor=(1,), microbatch_sizes=(1,),
                                        recompute=("none",), vocab=("vocab-1",)), workers=1)
    assert [row["schedule"] for row in report.ranked] == ["1f1b"] and report.ranked[0]["vocab"] == "vocab-1"


def test_a_config_that_is_not_yaml_says_so(cli, tmp_path: Path) -> None:
    table = tmp_path / "results.csv"
    table.write_text("a,b,c\n1,2,3\n")
    code, out, err = cli(["simulate", "--config", str(table)])
    assert (code, out) == (2, "") and err == (f"pipescope: error: --config: {str(table)!r} is a CSV file, not a YAML "
                                              "config, expected a YAML mapping of sections (schedule:, model:, "
                                              "cluster:, ...; docs/cli.md)\n")
    parquet = tmp_path / "results.parquet"  # binary: it failed as 'byte 19 is not UTF-8'
    parquet.write_bytes(b"PAR1\x15\x04\x15\x00\x15\xff\xfe\x00\x00PAR1")
    code, out, err = cli(["simulate", "--config", str(parquet)])
    assert (code, out) == (2, "") and err.startswith(f"pipescope: error: --config: {str(parquet)!r} is a PARQUET "
                                                     "file, not a YAML config, expected a YAML mapping")


def test_past_a_few_hundred_microbatches_the_gantt_draws_busy_shares_and_says_so() -> None:
    """A row of 600 ops was a barcode; now each row is the device's busy share per kind over time slices."""
    import matplotlib.pyplot as plt

    from pipescope.experiments.plots import gantt_figure
    from pipescope.experiments.plots_gantt import MICROBATCHES_PER_SLICE, SUMMARY_BINS, _busy_until

    assert list(_busy_until(np.array([0.0, 3.0]), np.array([2.0, 4.0]), np.array([0.0, 1.0, 2.5, 5.0]))) == [
        0.0, 1.0, 2.0, 3.0]
    result = pipescope.run(pipescope.load_config(raw={
        "schedule": {"name": "1f1b", "stages": 2, "microbatches": 300},
        "costs": {"kind": "uniform", "forward": 1, "backward_input": 1, "backward_weight": 1}}))
    fig = gantt_figure(result)
    try:
        ax = fig.axes[0]
        slices = 300 // MICROBATCHES_PER_SLICE  # fewer than SUMMARY_BINS: a slice over 1.25 periods was a sawtooth
        assert slices < SUMMARY_BINS and f"300 microbatches, more than 256: each row is the device's busy share per " \
            f"kind in {slices} time slices" in ax.get_title()
        bands = [c for c in ax.collections if len(c.get_paths()) == 1]
        assert len(bands) == 2 * 2 and len(ax.collections) == len(bands)  # 2 devices x (F, B): no bar per op
        # the bands stack to each slice's busy share: full in 1F1B's steady state, which is most of this run
        tops = [band.get_paths()[0].vertices[:, 1].min() for band in bands]
        assert min(tops) == pytest.approx(-0.4, abs=1e-6)
    finally:
        plt.close(fig)
    # The lanes, the links and the memory panel of a routed run are summarised too: one band per lane and kind,
    # per link, and each device's range of bytes, not a bar per transfer or a line through every rise and fall.
    routed = pipescope.run(pipescope.load_config("demo", ["schedule.microbatches=300"]))
    fig = gantt_figure(routed, comm_lanes=True, memory=True)
    try:
        lanes, links, memory = fig.axes[0], fig.axes[1], fig.axes[2]
        assert all(len(c.get_paths()) == 1 for ax in (lanes, links) for c in ax.collections)
        assert len(links.collections) == len(links.get_yticks()) > 0
        assert len(memory.collections) == len(memory.get_lines()) == 4  # a range band and its top per device
        assert max(len(line.get_xdata()) for line in memory.get_lines()) == slices + 1
    finally:
        plt.close(fig)


def test_the_optimizer_step_is_clearly_apart_from_an_odd_chunks_backward() -> None:
    """They were #937860 and #9A5424: two browns."""
    from matplotlib.colors import to_rgb

    from pipescope.experiments.plots_style import COLORS, ODD_CHUNK_COLORS
    from pipescope.simulator.ir import ActionKind as K

    a, b = np.array(to_rgb(COLORS[K.OPT])), np.array(to_rgb(ODD_CHUNK_COLORS[K.B]))
    assert np.linalg.norm(a - b) > 0.4


def test_every_schedule_has_its_own_colour_and_marker_and_an_alias_shares_its_schedules() -> None:
    from pipescope.experiments.palette import SCHEDULE_COLORS, SCHEDULE_MARKERS, schedule_color
    from pipescope.simulator.schedules import GENERATORS

    assert set(SCHEDULE_COLORS) == set(SCHEDULE_MARKERS) == set(GENERATORS)
    assert len(set(SCHEDULE_COLORS.values())) == len(SCHEDULE_COLORS)
    assert len(set(SCHEDULE_MARKERS.values())) == len(SCHEDULE_MARKERS)
    assert schedule_color("flush") == schedule_color("1f1b") and schedule_color("ZB-V") == SCHEDULE_COLORS["zb-v"]


def readme_commands() -> list[str]:
    """The README's "Commands" block, one command a line, comments dropped."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Commands\n\n```\n(.*?)```", text, re.S)
    assert block, "README has no Commands block"
    return [line for line in block.group(1).splitlines() if line.startswith("pipescope ")]


def test_the_readmes_commands_run_as_printed(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    monkeypatch.chdir(tmp_path)  # a user's folder: shipped configs are found by name
    commands = readme_commands()
    assert len(commands) >= 6
    for command in commands:
        code, out, err = cli(shlex.split(command, comments=True)[1:])
        assert code == 0, f"{command}: {err[-500:]}"
        assert out.strip(), command
    assert (tmp_path / "bubble.png").stat().st_size > 10_000


def test_every_picture_the_readme_shows_exists() -> None:
    import re

    root = Path(__file__).resolve().parents[1]
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (root / "README.md").read_text())
    assert len(pictures) >= 7 and all((root / path).is_file() for path in pictures)


def test_a_throughput_point_never_takes_the_best_of_two_models() -> None:
    """The 2BW paper's sweep zips the model with the stages (2.2B 8 deep, 3.8B 16 deep, 64 GPUs each): each schedule
    was one point, the better of the two models."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from pipescope.experiments.plots import throughput_figure

    frame = pd.DataFrame({"schedule.name": ["2bw", "2bw"], "schedule.stages": [8, 16], "cluster.data_parallel": [8, 4],
                          "model.preset": ["gpt-2.2b", "gpt-3.8b"], "model.layers": [28, 32],
                          "throughput_samples_per_s": [188.8, 52.0], "status": ["ok", "ok"]})
    fig = throughput_figure(frame)
    try:
        ax = fig.axes[0]
        assert sorted(bar.get_width() for bar in ax.patches) == [52.0, 188.8]
        assert [tick.get_text() for tick in ax.get_yticklabels()] == ["2bw (preset=gpt-2.2b)", "2bw (preset=gpt-3.8b)"]
    finally:
        plt.close(fig)


def test_validate_says_first_when_the_machine_is_busy() -> None:
    """A validate run on a loaded machine reported -51% and nothing about why."""
    from pipescope.experiments.validate_cmd import busy_machine

    assert busy_machine(1.0, 2) is None and busy_machine(0.2, 1) is None
    assert busy_machine(3.3, 2).startswith("the machine is busy before validate starts (load average 3.3 on 2 CPU "
                                           "cores)")


def test_validate_defaults_to_a_model_whose_ops_outweigh_a_cpus_overheads(capsys: pytest.CaptureFixture) -> None:
    """Without flags it calibrated `tiny` (ops of 0.1-0.4 ms) and reported -50%; the executor's end-to-end test runs
    the CPU's default op times (tests/test_executor.py)."""
    from pipescope.experiments.cli import main
    from pipescope.experiments.validate_cmd import DEFAULT_MODEL
    from pipescope.simulator.models import PRESETS

    assert DEFAULT_MODEL == "tiny-512" and PRESETS[DEFAULT_MODEL].hidden == 512
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "(default tiny-512;" in " ".join(capsys.readouterr().out.split())


def test_a_file_key_the_planner_does_not_search_applies_only_where_it_means_something() -> None:
    """A file's ZeRO stage and tensor-parallel overlap do not reject the candidates they mean nothing for: 2BW (no
    flush, so no ZeRO step) and t = 1 (no tensor-parallel collectives to overlap) are planned, not refused."""
    from pipescope.experiments.plan_space import PlanRequest

    report = pipescope.plan(PlanRequest({"parallel": {"zero": 1, "sequence": True, "tp_comm_overlap": True}}, 8,
                                        schedules=("1f1b", "2bw"), depths=(4,), tensor=(1, 2), microbatch_sizes=(1,),
                                        recompute=("none",), vocab=("naive",), top=8), workers=1)
    planned = {(row["schedule"], row["tensor"]) for row in report.ranked}
    assert planned >= {("1f1b", 1), ("2bw", 1), ("1f1b", 2), ("2bw", 2)}
    assert not [row for row in report.rejected if "parallel." in row["reason"]]
