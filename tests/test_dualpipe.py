"""DualPipeV (docs/schedules.md, "DualPipeV"; simulator/schedules/dualpipe.py): torch's order for every size it
accepts, DeepSeek-V3's published bounds under uniform costs, and what it refuses."""

from __future__ import annotations

import pytest

import pipescope
from pipescope.simulator.schedules import build

COSTS = [(1, 1, 1), (2, 2, 1), (3, 2, 1), (1, 2, 1), (1, 1, 0.5)]  # F, I, W of one chunk (one stage)


def uniform(p: int, m: int, f: float, i: float, w: float) -> pipescope.SimResult:
    """Uniform costs are per whole device: its two chunks take twice a chunk's time."""
    return pipescope.run(pipescope.load_config(raw={
        "schedule": {"name": "dualpipev", "stages": p, "microbatches": m},
        "costs": {"kind": "uniform", "forward": 2 * f, "backward_input": 2 * i, "backward_weight": 2 * w}}))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_the_order_is_torchs_dualpipev_for_every_size_it_takes(p: int) -> None:
    """Device by device, torch's ScheduleDualPipeV order with each OVERLAP_F_B pair as its forward then backward."""
    pytest.importorskip("torch")
    from pipescope.calibration.torch_schedules import torch_schedule

    for m in range(2 * p, 2 * p + 7):
        ours, theirs = build("dualpipev", p, m), torch_schedule("DualPipeV", p, m, 2)
        assert ours.stage_to_device == theirs.stage_to_device
        for device in range(p):
            assert list(ours.compute_actions(device)) == list(theirs.compute_actions(device)), (p, m, device)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_the_csv_is_torchs_with_each_pair_one_overlap_cell(p: int, tmp_path) -> None:
    """``--csv`` writes each F&B pair as torch does, ``(F;B)OVERLAP_F_B``: the text equals torch's own compute-only
    CSV of ScheduleDualPipeV, and reading it back keeps the pairs."""
    pytest.importorskip("torch")
    from pipescope.calibration.torch_schedules import build_torch_schedule
    from pipescope.simulator.readers.csvio import from_csv_text, to_csv_text

    for m in (2 * p, 2 * p + 3):
        path = tmp_path / f"{p}-{m}.csv"
        build_torch_schedule("DualPipeV", p, m, 2, lowered=True)._dump_csv(str(path), format="compute_only")
        ours = build("dualpipev", p, m)
        assert to_csv_text(ours) == path.read_text(), (p, m)
        assert from_csv_text(path.read_text(), m).overlapped == ours.overlapped != frozenset()


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_stage", [1, 2])
def test_the_bubble_and_the_activations_stay_within_deepseeks_bounds(p: int, m_per_stage: int) -> None:
    """DeepSeek-V3 (arXiv 2412.19437, Table 2; deepseek-ai/DualPipe's README): a bubble of (PP/2-1)(F&B+B-3W) for PP
    stages on PP/2 devices, and PP+1 chunks' activations per device; here PP = 2p and F&B = F + B (the pair runs
    its forward, then its backward). Every device is idle at most that long over the run, and holds 2p+1 chunks'
    activations at its peak, exactly."""
    m = 2 * p * m_per_stage
    for f, i, w in COSTS:
        result = uniform(p, m, f, i, w)
        b = i + w
        bound = (p - 1) * ((f + b) + b - 3 * w)
        idle = max(result.makespan_ns / 1e9 - device.busy_s for device in result.devices)
        assert idle <= bound + 1e-9, (p, m, f, i, w)
        assert all(device.busy_s == pytest.approx(m * 2 * (f + i + w)) for device in result.devices)
        assert max(device.peak_activations for device in result.devices) * 2 == 2 * p + 1  # in chunks


def test_parameters_are_held_once_over_the_v() -> None:
    """The V puts stages r and 2p-1-r on device r: every stage once, two per device."""
    schedule = build("dualpipev", 4, 8)
    assert list(schedule.stage_to_device) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert schedule.weight_versions == (1, 1, 1, 1)


@pytest.mark.parametrize("sets, message", [
    (["schedule.microbatches=7"], r"schedule.microbatches: got 7, expected at least 2 x schedule.stages \(=4\) = 8 for "
                                  r"dualpipev"),
    (["schedule.chunks=3"], r"schedule.chunks: got 3, expected 2 for dualpipev"),
])
def test_what_dualpipev_refuses(sets: list[str], message: str) -> None:
    with pytest.raises(pipescope.ConfigError, match=message):
        pipescope.run(pipescope.load_config(None, ["schedule.name=dualpipev", "schedule.stages=4", *sets]))


def test_it_runs_under_the_gpu_model_and_the_planner_takes_it() -> None:
    """A whole run on the default cluster, and a plan that names it, DualPipe and Chimera."""
    from pipescope.experiments.plan import plan
    from pipescope.experiments.plan_space import PlanRequest, base_config

    result = pipescope.run(pipescope.load_config(None, ["schedule.name=dualpipev", "schedule.stages=4",
                                                        "schedule.microbatches=8"]))
    assert result.iteration_time_s > 0 and result.schedule.chunks == 2
    report = plan(PlanRequest(base_config("gpt-355m", "dgx-a100", 1, None), 16, schedules=("dualpipev", "dualpipe",
                                                                                         "chimera", "1f1b"),
                              microbatch_sizes=(1,), tensor=(1,), recompute=("none",), vocab=("naive",),
                              depths=(4,)), workers=1, progress=False)
    assert {"dualpipev", "dualpipe", "chimera"} <= {row["schedule"] for row in report.ranked}


# DualPipe: two pipelines over the same devices (simulator/schedules/dualpipe.py, ``dualpipe``) -----------------------

def dualpipe_like(name: str, p: int, m: int, f: float, i: float, w: float) -> pipescope.SimResult:
    """Uniform costs per stage: each of a device's two stages is a whole 1/p of the model."""
    return pipescope.run(pipescope.load_config(raw={
        "schedule": {"name": name, "stages": p, "microbatches": m},
        "costs": {"kind": "uniform", "forward": f, "backward_input": i, "backward_weight": w}}))


@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("m_per_stage", [1, 2])
def test_dualpipes_bubble_and_activations_are_within_deepseeks_bounds(p: int, m_per_stage: int) -> None:
    """DeepSeek-V3's table for DualPipe on PP devices: a bubble of (PP/2-1)(F&B+B-3W), with F&B = F + B here (the
    pair runs its forward, then its backward), and PP+1 stages' activations at a device's peak; every device does
    both of its stages' work for its half of the microbatches each."""
    m = 2 * p * m_per_stage
    for f, i, w in COSTS:
        result = dualpipe_like("dualpipe", p, m, f, i, w)
        b = i + w
        idle = max(result.makespan_ns / 1e9 - device.busy_s for device in result.devices)
        assert idle <= (p // 2 - 1) * ((f + b) + b - 3 * w) + 1e-9, (p, m, f, i, w)
        assert all(device.busy_s == pytest.approx(m * (f + i + w)) for device in result.devices)
        # peak_activations counts a device's whole share of the model (its two stages) as one
        assert max(device.peak_activations for device in result.devices) * 2 == p + 1


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 10), (6, 12), (8, 20)])
def test_the_two_directions_mirror_each_other_and_each_microbatch_runs_one(p: int, m: int) -> None:
    """Device r holds stage r of the pipeline fed from device 0 and stage p-1-r of the one fed from device p-1
    (schedule stage p + p-1-r); its order is device p-1-r's with the two pipelines swapped, as DeepSeek's schedule
    is symmetric; microbatches 0..m/2-1 run only through the first pipeline, the rest only through the second."""
    from pipescope.simulator.ir import Action

    schedule = build("dualpipe", p, m)
    assert schedule.pipelines == 2 and list(schedule.stage_to_device) == [*range(p), *reversed(range(p))]
    assert {schedule.model_stage(s) for s, d in enumerate(schedule.stage_to_device) if d == 0} == {0, p - 1}

    def swapped(a: Action) -> Action:
        return Action((a.stage + p) % (2 * p), a.kind, (a.microbatch + m // 2) % m)

    for r in range(p):
        assert list(map(swapped, schedule.compute_actions(r))) == schedule.compute_actions(p - 1 - r), (p, m, r)
    for r in range(p):
        for a in schedule.compute_actions(r):
            assert schedule.pipeline_of(a.microbatch) == a.stage // p


def test_the_copies_sum_their_gradients_before_each_step_and_hold_parameters_twice() -> None:
    """Under the GPU model each model stage's two copies (devices j and p-1-j) all-reduce its gradient bytes before
    the step, and each device holds two model stages' parameters: those of 1F1B's devices j and p-1-j."""
    sets = ["schedule.stages=4", "schedule.microbatches=8"]
    dual = pipescope.run(pipescope.load_config(None, ["schedule.name=dualpipe", *sets]))
    plain = pipescope.run(pipescope.load_config(None, ["schedule.name=1f1b", *sets]))
    stage = dual.timeline[dual.timeline.kind == "ALL_REDUCE"]
    pairs = {tuple(sorted(stage[stage.action == a].device)) for a in set(stage.action) if not a.startswith("-1")}
    assert pairs == {(0, 3), (1, 2)}
    params = [c.params for c in dual.stage_costs]
    assert params[:4] == params[4:] == [c.params for c in plain.stage_costs]
    for opt in dual.timeline[dual.timeline.kind == "OPT"].itertuples():
        synced = stage[(stage.device == opt.device) & ~stage.action.str.startswith("-1")]
        assert (synced.end_ns <= opt.start_ns).all()


@pytest.mark.parametrize("name, sets, message", [
    ("dualpipe", ["schedule.stages=3", "schedule.microbatches=6"], r"schedule.stages: got 3, expected an even "
                                                                    r"number from 2 for dualpipe"),
    ("dualpipe", ["schedule.microbatches=7"], r"schedule.microbatches: got 7, expected an even number from 2 x "
                                              r"schedule.stages \(=4\) = 8"),
    ("dualpipe", ["schedule.microbatches=6"], r"schedule.microbatches: got 6, expected an even number from 2 x "
                                              r"schedule.stages \(=4\) = 8"),
    ("dualpipe", ["schedule.chunks=2"], r"schedule.chunks: got 2, expected 1 for dualpipe"),
    ("dualpipe", ["schedule.vocab=redistribute"], r"schedule.vocab: redistribute with schedule.name dualpipe is not "
                                                  r"modelled"),
    ("chimera", ["schedule.stages=3", "schedule.microbatches=6"], r"schedule.stages: got 3, expected an even "
                                                                   r"number from 2 for chimera"),
    ("chimera", ["schedule.microbatches=6"], r"schedule.microbatches: got 6, expected a multiple of "
                                             r"schedule.stages \(=4\)"),
    ("chimera", ["schedule.chunks=2"], r"schedule.chunks: got 2, expected 1 for chimera"),
])
def test_what_the_bidirectional_schedules_refuse(name: str, sets: list[str], message: str) -> None:
    with pytest.raises(pipescope.ConfigError, match=message):
        pipescope.run(pipescope.load_config(None, [f"schedule.name={name}", "schedule.stages=4",
                                                   "schedule.microbatches=8", *sets]))


# Chimera: two pipelines in opposite directions (simulator/schedules/chimera.py) ------------------------------------

@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
def test_chimeras_bubble_is_its_papers_and_its_activations_between_its_bounds(p: int, units: int) -> None:
    """Li and Hoefler's bubble ratio (D-2)/(2N+D-2) for D devices and N microbatches, exactly, when a backward takes
    as long as a forward (the paper's unit steps), the iteration (2N+D-2) F; activations at a device's peak between
    D/2+1 and D microbatches' (its two stages'), D at the middle devices; parameters twice."""
    m = p * units
    for f, i, w in ((2, 1, 1), (3, 2, 1)):
        result = dualpipe_like("chimera", p, m, f, i, w)
        assert result.makespan_ns == (2 * m + p - 2) * f * 10**9
        assert result.bubble_rate == pytest.approx((p - 2) / (2 * m + p - 2))
        peaks = [device.peak_activations * 2 for device in result.devices]  # a device's two stages count one
        assert min(peaks) == p // 2 + 1 if p > 2 else True
        assert max(peaks) == p
    schedule = build("chimera", p, m)
    assert schedule.pipelines == 2 and list(schedule.stage_to_device) == [*range(p), *reversed(range(p))]


def test_chimera_is_its_authors_construction() -> None:
    """The order of Chimera's runtime (Shigangli/Chimera, ``chimera_pipeline_rank.py``) at D = 4, N = 4, read off
    its generator: device 0 runs the down pipeline's first forward, waits a step, its second, then the up
    pipeline's two forward-backward pairs at its last stage, then the down pipeline's two backwards."""
    order = [str(a) for a in build("chimera", 4, 4).compute_actions(0)]
    assert order == ["0F0", "0F1", "7F2", "7B2", "7F3", "7B3", "0B0", "0B1"]
    assert [str(a) for a in build("chimera", 4, 4).compute_actions(3)] == [
        "4F2", "4F3", "3F0", "3B0", "3F1", "3B1", "4B2", "4B3"]  # its mirror: the up pipeline's first stage


@pytest.mark.parametrize("name, p, m", [("dualpipe", 4, 8), ("chimera", 4, 8), ("chimera", 2, 4)])
def test_a_two_pipeline_csv_reads_back_as_two_pipelines_and_runs_the_same(name: str, p: int, m: int) -> None:
    """``--csv`` writes the order (DualPipe's pairs as torch's OVERLAP_F_B cells); reading it back finds the two
    pipelines, since no single pipeline runs half its microbatches on half its stages, and it runs as built."""
    from pipescope.simulator.costs import UniformCosts
    from pipescope.simulator.readers.csvio import from_csv_text, to_csv_text
    from pipescope.simulator.simulate import simulate

    built = build(name, p, m)
    read = from_csv_text(to_csv_text(built), m)
    assert read.pipelines == 2 and read.device_actions == built.device_actions
    costs = UniformCosts(forward=1.0, backward_input=1.0, backward_weight=0.5)
    assert simulate(read, costs).iteration_ns == simulate(built, costs).iteration_ns
    assert from_csv_text(to_csv_text(build("1f1b", p, m)), m).pipelines == 1


@pytest.mark.parametrize("profile", [[], ["--profile", "calibration/profiles/h200/tiny"]])
def test_validate_refuses_a_two_pipeline_schedule_before_it_times_anything(profile: list[str], capsys) -> None:
    """The real executor builds one copy of the model: one line and exit 2, before any calibration or rank."""
    from pathlib import Path

    from pipescope.experiments.cli import main

    root = Path(__file__).resolve().parent.parent
    args = [a if a == "--profile" else str(root / a) for a in profile]
    assert main(["validate", "--schedule", "dualpipe", "--stages", "2", "--microbatches", "4", *args]) == 2
    err = capsys.readouterr().err
    assert "dualpipe runs 2 pipelines" in err and "calibrate" not in err
