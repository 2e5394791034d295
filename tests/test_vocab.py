"""``schedule.vocab``: vocabulary layers as explicit work (docs/schedules.md section 7).

Real runs through ``pipescope.run`` (analytic costs on a DGX A100's routed network, or uniform costs), checked for
what the paper's methods promise: balanced compute and parameters, the activation peaks of 1F1B with vocab-1
(p+2), vocab-2 (p+1) and interlaced (1.5p), the C0/C1/C2 collectives on the network, and redistribute's split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipescope.config import ConfigError, load_config
from pipescope.runner import run
from pipescope.simulator.costs import AnalyticCosts
from pipescope.simulator.readers.csvio import to_csv_text
from pipescope.simulator.ir import ActionKind, Collective
from pipescope.simulator.models import PRESETS, stage_layers
from pipescope.simulator.result import SimResult
from pipescope.simulator.vocab import VocabMethod, VocabShards, padded_vocab

K = ActionKind
VOCABS = (32_000, 64_000, 128_000, 256_000)
BASE = ["model.preset=gpt-355m", "model.seq=1024", "cluster.topology=dgx-a100", "schedule.stages=4",
        "schedule.microbatches=8"]


def simulate(vocab: str, *sets: str) -> SimResult:
    return run(load_config(None, [*BASE, f"schedule.vocab={vocab}", *sets]))


def compute_ns_per_device(result: SimResult, kinds: tuple[str, ...]) -> list[int]:
    """Each device's summed duration of the ops of ``kinds``."""
    frame = result.timeline
    ops = frame[frame["kind"].isin(kinds)]
    return (ops["end_ns"] - ops["start_ns"]).groupby(ops["device"]).sum().reindex(range(4), fill_value=0).tolist()


@pytest.mark.parametrize("method", ["vocab-1", "vocab-2"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_per_device_compute_is_uniform(method: str, vocab: int) -> None:
    result = simulate(method, f"model.vocab={vocab}")
    per_device = compute_ns_per_device(result, ("F", "B", "S", "T"))
    assert len(set(per_device)) == 1, per_device
    vocab_ns = compute_ns_per_device(result, ("S", "T"))
    assert len(set(vocab_ns)) == 1 and vocab_ns[0] > 0


def test_naive_last_stage_grows_linearly_with_the_vocabulary() -> None:
    model = PRESETS["gpt-355m"]
    totals = []
    for vocab in VOCABS:
        costs = AnalyticCosts(model.__class__(**{**vars(model), "vocab": vocab}), 312e12)
        c = costs.stage_cost(3, 4, 1)
        totals.append(c.forward_ns + c.input_grad_ns + c.weight_grad_ns)
    steps = np.diff(totals) / np.diff(VOCABS)  # ns per vocabulary entry between neighbours
    assert steps.min() > 0 and steps.max() / steps.min() < 1.001, steps
    middle = costs.stage_cost(1, 4, 1)
    assert totals[-1] > 2 * (middle.forward_ns + middle.input_grad_ns + middle.weight_grad_ns)


@pytest.mark.parametrize("vocab", [32_000, 256_000])
def test_redistribute_is_no_worse_than_naive_and_reports_its_split(vocab: int) -> None:
    naive = simulate("naive", f"model.vocab={vocab}")
    moved = simulate("redistribute", f"model.vocab={vocab}")
    assert moved.iteration_ns <= naive.iteration_ns
    split = json.loads(json.dumps(moved.summary()))["layers_per_stage"]
    assert sum(split) == PRESETS["gpt-355m"].layers and len(split) == 4
    if vocab == 256_000:  # the output layer outweighs layers: the last stage gives some away and the run gains
        assert split[-1] < stage_layers(24, 4)[-1] and moved.iteration_ns < naive.iteration_ns


@pytest.mark.parametrize(("method", "extra"), [("vocab-1", 2), ("vocab-2", 1)])
@pytest.mark.parametrize("p", [4, 6])
def test_activation_peak_on_the_first_device(method: str, extra: int, p: int) -> None:
    result = simulate(method, f"schedule.stages={p}", f"schedule.microbatches={3 * p}", "model.layers=24")
    assert result.devices[0].peak_activations == p + extra
    naive = simulate("naive", f"schedule.stages={p}", f"schedule.microbatches={3 * p}", "model.layers=24")
    assert naive.devices[0].peak_activations == p


def test_interlaced_holds_one_and_a_half_p() -> None:
    result = simulate("interlaced", "schedule.microbatches=12")
    assert result.devices[0].peak_activations == 6


@pytest.mark.parametrize(("method", "kinds"), [("vocab-1", {K.BROADCAST, K.ALL_REDUCE, K.REDUCE_SCATTER}),
                                               ("vocab-2", {K.BROADCAST, K.ALL_REDUCE})])
def test_collectives_run_on_the_network(method: str, kinds: set[ActionKind]) -> None:
    result = simulate(method, "model.vocab=128000")
    records = result.records
    # the vocabulary's collectives; clipping's norm all-reduce before the steps has no stage (-1)
    rows = [i for i, a in enumerate(records.actions) if isinstance(a, Collective) and a.stage >= 0]
    assert {records.actions[i].kind for i in rows} == kinds
    for kind in kinds:  # one per microbatch, every device a member
        per_kind = {records.actions[i] for i in rows if records.actions[i].kind is kind}
        assert sorted(c.microbatch for c in per_kind) == list(range(8))
        assert all(c.group == (0, 1, 2, 3) and c.nbytes > 0 for c in per_kind)
    assert all(records.end[i] > records.start[i] for i in rows)  # the routed network took time to move them
    shards = VocabShards(VocabMethod(method), 4, PRESETS["gpt-355m"].__class__(
        **{**vars(PRESETS["gpt-355m"]), "seq": 1024, "vocab": 128000}), 1, "bf16")
    assert {records.actions[i].kind: records.actions[i].nbytes for i in rows} == shards.collective_bytes()


def test_overlapped_collectives_do_not_hold_the_stream() -> None:
    """vocab-2's collectives run beside the compute stream: its devices idle less than interlaced's, whose
    all-reduces hold every stream."""
    overlapped, held = simulate("vocab-1", "model.vocab=256000"), simulate("interlaced", "model.vocab=256000")
    assert overlapped.iteration_ns < held.iteration_ns


def test_interlaced_runs_each_pass_on_all_devices_at_once() -> None:
    """Interlaced's collectives hold the streams, so its passes are gang-placed: each S(k) and T(k) starts at the
    same moment on every device."""
    frame = simulate("interlaced", "model.vocab=128000").timeline
    for kind in ("S", "T"):
        starts = frame[frame["kind"] == kind].groupby("microbatch")["start_ns"].nunique()
        assert len(starts) == 8 and (starts == 1).all()


def test_parameters_are_balanced() -> None:
    result = simulate("vocab-2", "model.vocab=256000")
    static = [d.static_memory_bytes for d in result.devices]
    position = 1024 * 1024 * 18  # the position embedding stays on device 0 (18 bytes per parameter, Megatron's)
    assert static[1] == static[2] == static[3] and static[0] - static[1] == position
    naive = simulate("naive", "model.vocab=256000")
    assert max(d.static_memory_bytes for d in naive.devices) > max(static)


def test_uniform_costs_keep_the_closed_form() -> None:
    """With S and T of 0 and free collectives, vocab-2's longer warm-up changes nothing: (m + p - 1)(F + B)."""
    for method in ("vocab-1", "vocab-2"):
        result = run(load_config(None, ["costs.kind=uniform", "schedule.stages=4", "schedule.microbatches=8",
                                        f"schedule.vocab={method}"]))
        assert result.iteration_ns == (8 + 4 - 1) * 3 * 10**9
    timed = run(load_config(None, ["costs.kind=uniform", "schedule.stages=4", "schedule.microbatches=8",
                                   "schedule.vocab=vocab-2", "costs.vocab_s=0.25", "costs.vocab_t=0.25"]))
    assert compute_ns_per_device(timed, ("S", "T")) == [8 * 5 * 10**8] * 4


@pytest.mark.parametrize("method", ["vocab-1", "vocab-2"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize(("s", "t", "f", "i", "w"), [(0.25, 0.25, 1, 1, 1), (1.0, 0.5, 1, 2, 0), (2, 2, 1, 1.5, 0.5)])
def test_the_passes_add_their_work_and_no_bubble(method: str, p: int, m: int, s: float, t: float, f: float,
                                                 i: float, w: float) -> None:
    """Uniform costs, free p2p: 1F1B with vocab-1 or vocab-2 takes (m + p - 1)(F + B) + m(S + T), its bubble
    unchanged (the paper's "same bubble as 1F1B"), even with S or T longer than F."""
    result = run(load_config(None, ["costs.kind=uniform", f"schedule.stages={p}", f"schedule.microbatches={m}",
                                    f"schedule.vocab={method}", f"costs.vocab_s={s}", f"costs.vocab_t={t}",
                                    f"costs.forward={f}", f"costs.backward_input={i}", f"costs.backward_weight={w}"]))
    assert result.iteration_ns == round(((m + p - 1) * (f + i + w) + m * (s + t)) * 1e9)


@pytest.mark.parametrize("method", ["vocab-1", "vocab-2"])
def test_v_half_keeps_its_makespan_and_memory_plus_the_passes(method: str) -> None:
    base = ["costs.kind=uniform", "schedule.name=v-half", "schedule.stages=8", "schedule.microbatches=24"]
    plain = run(load_config(None, base))
    split = run(load_config(None, [*base, f"schedule.vocab={method}", "costs.vocab_s=0.5", "costs.vocab_t=1"]))
    assert split.iteration_ns == plain.iteration_ns + 24 * 1.5 * 10**9
    assert [d.peak_activations for d in split.devices] == [d.peak_activations for d in plain.devices]


def test_v_half_gets_the_passes_too() -> None:
    result = simulate("vocab-2", "schedule.name=v-half", "schedule.microbatches=8", "model.vocab=256000")
    per_device = compute_ns_per_device(result, ("F", "I", "W", "S", "T"))
    assert len(set(per_device)) == 1
    assert result.schedule.name == "v-half+vocab-2"


def test_padding_to_a_multiple_of_2p() -> None:
    assert padded_vocab(50257, 4) == 50264 and padded_vocab(50264, 4) == 50264
    assert VocabShards(VocabMethod.VOCAB_1, 8, PRESETS["gpt-355m"], 1, "bf16").shard_vocab * 8 == padded_vocab(50257, 8)


@pytest.mark.parametrize(("sets", "names"), [
    (["schedule.vocab=vocab-3"], ("schedule.vocab", "naive, redistribute, vocab-1, vocab-2, interlaced")),
    (["schedule.vocab=vocab-1", "schedule.name=gpipe"], ("schedule.vocab", "schedule.name", "gpipe")),
    (["schedule.vocab=interlaced", "schedule.name=v-half"], ("schedule.vocab", "schedule.name", "v-half")),
    (["schedule.vocab=redistribute", "model.layers_per_stage=6,6,6,6"], ("schedule.vocab", "model.layers_per_stage")),
    (["schedule.vocab=redistribute", "costs.kind=uniform"], ("schedule.vocab", "costs.kind")),
])
def test_bad_combinations_are_one_line_errors(sets: list[str], names: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        run(load_config(None, [*BASE, *sets]))
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in names), message
    assert err.value.key == "schedule.vocab"


def test_csv_export_refuses_vocabulary_passes() -> None:
    result = simulate("vocab-2")
    with pytest.raises(ValueError) as err:
        to_csv_text(result.schedule)
    assert "\n" not in str(err.value) and "S/T" in str(err.value)
    assert to_csv_text(simulate("redistribute").schedule).count("\n") == 4


def test_cli_refuses_csv_export_before_running(tmp_path, capsys) -> None:
    from pipescope.experiments.cli import main

    out = tmp_path / "s.csv"
    assert main(["simulate", "--config", "demo", "--set", "schedule.vocab=vocab-1", "--csv", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--csv" in err and "schedule.vocab" in err and not out.exists()


PROFILE_SETS = ["costs.kind=profile", "schedule.stages=2", "schedule.microbatches=4", "model.microbatch_size=4",
                "model.seq=128"]


def profile_run(folder, vocab: str) -> SimResult:
    return run(load_config(None, [*PROFILE_SETS, f"costs.profile={folder}", f"schedule.vocab={vocab}"]))


def test_profiled_costs_read_the_shard_rows(tmp_path) -> None:
    """vocab-1 takes the profile's 2-shard S and T rows (2,000 ns each in the test profile); vocab-2 without S2/T2
    rows estimates S2 = S + T/2 and T2 = T/2 and says so."""
    from test_profiled_costs import make_profile

    folder = make_profile(tmp_path / "p")
    one = profile_run(folder, "vocab-1")
    per_op = one.timeline.groupby("kind").apply(lambda f: set(f["end_ns"] - f["start_ns"]))
    assert per_op["S"] == {2000} and per_op["T"] == {2000}
    assert not any("S2" in w for w in one.warnings)
    two = profile_run(folder, "vocab-2")
    per_op = two.timeline.groupby("kind").apply(lambda f: set(f["end_ns"] - f["start_ns"]))
    assert per_op["S"] == {3000} and per_op["T"] == {1000}
    assert any("S2" in w and "T2" in w for w in two.warnings)
    assert len(set(compute_ns_per_device(two, ("F", "B", "S", "T"))[:2])) == 2  # the embedding lookup stays on 0


def test_profiled_costs_use_s2_t2_rows_when_present(tmp_path) -> None:
    """Rows S2 and T2 (the calibration of vocab-2's passes) win over the estimate. The schema takes them once
    calibration writes them, so they are added to the loaded table here."""
    import pandas as pd
    from test_profiled_costs import make_profile

    from pipescope.simulator.profiled import ProfiledCosts

    costs = ProfiledCosts.load(make_profile(tmp_path / "p"), microbatch_size=4)
    extra = costs.timings[costs.timings["component"] == "output_shard"].copy()
    extra["op"] = extra["op"].map({"S": "S2", "T": "T2"})
    extra["median_ns"] = extra["median_ns"].where(extra["op"] == "T2", extra["median_ns"] * 2)
    costs.timings = pd.concat([costs.timings, extra], ignore_index=True)
    assert costs.vocab_passes_ns(2, vocab_2=True) == (4000, 2000)
    assert costs.vocab_passes_ns(2, vocab_2=False) == (2000, 2000)
    assert not any("S2" in w for w in costs.warnings)


def test_trace_and_gantt_show_the_passes_in_their_own_kind(tmp_path) -> None:
    from pipescope.experiments.plots import write_gantt
    from pipescope.experiments.plots_style import COLORS, LABELS
    from pipescope.simulator.trace import write_trace

    result = simulate("vocab-1")
    write_trace(result, str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    cats = {e.get("cat") for e in events}
    assert {"vocabulary S", "vocabulary T", "broadcast", "all-reduce", "reduce-scatter"} <= cats
    assert len({COLORS[k] for k in (K.F, K.B, K.I, K.W, K.OPT, K.S, K.T)}) == 7 and "S pass" in LABELS[K.S]
    write_gantt(result, str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_mfu_counts_the_vocabulary_layers() -> None:
    """MFU is model FLOPs (layers and the 6bshV output layer at the real vocabulary, padding not counted) over the
    devices' peak; balancing the vocabulary raises it at 256k."""
    naive, split = simulate("naive", "model.vocab=256000"), simulate("vocab-2", "model.vocab=256000")
    model = PRESETS["gpt-355m"]
    tokens, h = 1024, model.hidden
    from pipescope.simulator.models import layer_work
    work = layer_work(model.__class__(**{**vars(model), "seq": 1024}), 1, "bf16")
    per_mb = 24 * (work.forward_flops + work.input_grad_flops + work.weight_grad_flops) + 6 * tokens * h * 256000
    assert split.model_flops_per_iteration == naive.model_flops_per_iteration == pytest.approx(8 * per_mb)
    assert split.mfu == pytest.approx(8 * per_mb / split.iteration_time_s / (4 * split.peak_flops_per_device))
    assert split.mfu > naive.mfu
    shards = VocabShards(VocabMethod.VOCAB_2, 4, model.__class__(**{**vars(model), "seq": 1024, "vocab": 256000}),
                         1, "bf16")
    shard_flops = sum(k.flops for kernels in shards.pass_kernels().values() for k in kernels)
    assert 4 * shard_flops == 6 * tokens * h * padded_vocab(256000, 4)


def test_plot_vocab_draws_a_sweep_table(tmp_path, capsys) -> None:
    import pandas as pd

    from pipescope.experiments.cli import main

    rows = []
    for method in ("naive", "vocab-2"):
        for vocab in (32_000, 128_000):
            r = simulate(method, f"model.vocab={vocab}")
            rows.append({"status": "ok", "schedule.name": "1f1b", "schedule.vocab": method, "schedule.stages": 4,
                         "model.seq": 1024, "model.vocab": vocab, "mfu": r.mfu,
                         "peak_memory_bytes": r.peak_memory_bytes, "memory_capacity_bytes": r.memory_capacity_bytes})
    table = tmp_path / "results.csv"
    pd.DataFrame(rows).to_csv(table, index=False)
    out = tmp_path / "v.png"
    assert main(["plot", "vocab", str(table), "-o", str(out)]) == 0 and out.stat().st_size > 10_000
    for frame, needle in [
            (pd.DataFrame(rows).drop(columns="schedule.vocab"), "no column 'schedule.vocab'"),
            (pd.DataFrame(rows[::2]), "model.vocab takes 1 value(s) [32000], expected a sweep over model.vocab"),
            (pd.DataFrame(rows * 2).assign(**{"schedule.microbatches": [8] * 4 + [16] * 4}),
             "schedule.microbatches varies (16, 8) between runs of one mark")]:
        frame.to_csv(table, index=False)
        assert main(["plot", "vocab", str(table), "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err


@pytest.mark.parametrize(("peak", "label", "line"), [(3 << 20, "peak memory per device (MiB; device 80 GiB)", False),
                                                     (60 << 30, "peak memory per device (GiB)", True)])
def test_plot_vocab_reads_memory_in_its_unit_and_draws_the_capacity_only_near_it(peak: int, label: str,
                                                                                  line: bool) -> None:
    """A small model's peaks read in MiB with the device's 80 GiB in the label (a line that high would flatten
    them); peaks within half of the device's memory in GiB, with the capacity dashed."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from pipescope.experiments.plots_vocab import vocab_figure

    frame = pd.DataFrame([{"schedule.name": "1f1b", "schedule.vocab": method, "schedule.stages": 2, "model.seq": 64,
                           "model.vocab": vocab, "mfu": 0.3, "peak_memory_bytes": peak + vocab,
                           "memory_capacity_bytes": 80 << 30} for method in ("naive", "vocab-1")
                          for vocab in (512, 2048)])
    fig = vocab_figure(frame)
    try:
        memory = fig.axes[1]
        assert memory.get_ylabel() == label
        assert ("device memory" in [drawn.get_label() for drawn in memory.get_lines()]) is line
        assert fig.get_figwidth() >= 6  # one panel: the title and legend fit
        for ax in fig.axes[:2]:  # the highest markers inside the frame (they touched its top)
            top = max(float(max(line.get_ydata())) for line in ax.get_lines())
            assert ax.get_ylim()[1] >= top * 1.05
    finally:
        plt.close(fig)


def test_kernel_report_lists_the_shard_passes() -> None:
    result = simulate("vocab-1", "model.vocab=128000")
    for group in result.kernels:
        assert group["pass_time_s"]["S"] > 0 and group["pass_time_s"]["T"] > 0
        assert not any(row["component"] == "output" for row in group["kernels"])
    ns = compute_ns_per_device(result, ("S",))[0] / 8
    assert ns == pytest.approx(result.kernels[0]["pass_time_s"]["S"] * 1e9, abs=1)


def test_a_sweep_refuses_a_bad_combination_before_running(tmp_path) -> None:
    from pipescope.experiments.sweep import expand

    path = tmp_path / "s.yaml"
    path.write_text("schedule: {name: 1f1b}\nsweep:\n  schedule.name: [1f1b, zb-v]\n  schedule.vocab: [vocab-2]\n")
    with pytest.raises(ConfigError) as err:
        expand(str(path))
    assert "\n" not in str(err.value) and "schedule.vocab" in str(err.value) and "zb-v" in str(err.value)


def test_redistribute_under_profiled_costs(tmp_path) -> None:
    from test_profiled_costs import make_profile

    folder = make_profile(tmp_path / "p")
    sets = [*PROFILE_SETS, f"costs.profile={folder}", "model.layers=6"]
    naive = run(load_config(None, [*sets, "schedule.vocab=naive"]))
    moved = run(load_config(None, [*sets, "schedule.vocab=redistribute"]))
    assert moved.iteration_ns <= naive.iteration_ns
    assert sum(moved.summary()["layers_per_stage"]) == 6


@pytest.mark.parametrize("method", ["vocab-1", "vocab-2", "interlaced"])
def test_engine_and_oracle_agree_on_a_vocabulary_program(method: str) -> None:
    """The overlapped collectives (joins and waits) and the stream-holding ones replay the same in both loops."""
    from test_network import GB, servers

    from pipescope.simulator.engine import Engine
    from pipescope.simulator.oracle import Oracle
    from pipescope.simulator.program import op_durations
    from pipescope.simulator.schedules import build
    from pipescope.simulator.simulate import prepare
    from pipescope.simulator.vocab_placement import vocab_schedule

    model = PRESETS["gpt-1.3b"].__class__(**{**vars(PRESETS["gpt-1.3b"]), "vocab": 256000})
    shards = VocabShards(VocabMethod(method), 4, model, 4, "bf16")
    costs = AnalyticCosts(model, 989e12, 4, "bf16", 0.5, vocab=shards)
    base = build("1f1b", 4, 8)
    durations = op_durations([costs.stage_cost(s, 4, 1) for s in range(4)], False)
    program, _ = prepare(vocab_schedule(base, VocabMethod(method), durations, shards.collective_bytes()), costs)
    engine = Engine(program, servers(1, 4, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(1, 4, 450 * GB, 2 * GB)).run()
    assert sum(1 for f in engine.flow_end if f > 0) >= 8 * 2  # collectives ran (and took time)


def test_balance_layers_levels_an_affine_cost() -> None:
    """Each layer 10 ns, the last stage 45 ns more (the output layer): the slowest device goes from 105 ns to 75 ns,
    the best integer split (7, 7, 7, 3); every stage keeps a layer."""
    from pipescope.simulator.vocab import balance_layers

    def stage_ns(split: tuple[int, ...]) -> list[int]:
        return [10 * n + (45 if s == len(split) - 1 else 0) for s, n in enumerate(split)]

    split = balance_layers((6, 6, 6, 6), (0, 1, 2, 3), stage_ns)
    assert split == (7, 7, 7, 3) and max(stage_ns(split)) == 75
    assert balance_layers((1, 1, 1, 1), (0, 1, 2, 3), stage_ns) == (1, 1, 1, 1)  # nothing to give away
    v = balance_layers((3,) * 8, (0, 1, 2, 3, 3, 2, 1, 0), stage_ns)  # V placement: balance per device
    per_device = [0] * 4
    for stage, ns in enumerate(stage_ns(v)):
        per_device[(0, 1, 2, 3, 3, 2, 1, 0)[stage]] += ns
    assert max(per_device) - min(per_device) <= 10 and max(per_device) < 60 + 45


def test_redistribute_with_v_half() -> None:
    naive = simulate("naive", "schedule.name=v-half", "model.vocab=256000")
    moved = simulate("redistribute", "schedule.name=v-half", "model.vocab=256000")
    assert moved.iteration_ns <= naive.iteration_ns and len(moved.summary()["layers_per_stage"]) == 8


@pytest.mark.parametrize("method", ["vocab-2", "interlaced"])
def test_data_parallel_replicas_each_run_their_own_vocabulary_collectives(method: str) -> None:
    """With 2 replicas of a 4-device pipeline, each replica's C0/C1/C2 run over its own devices, the gradient
    all-reduces across them, the engine and the oracle agree, and each replica does what one pipeline alone does."""
    from test_network import GB, servers

    from pipescope.simulator.engine import Engine
    from pipescope.simulator.oracle import Oracle
    from pipescope.simulator.program import op_durations
    from pipescope.simulator.replicas import GradSync, data_parallel
    from pipescope.simulator.schedules import build
    from pipescope.simulator.simulate import prepare
    from pipescope.simulator.vocab_placement import vocab_schedule

    model = PRESETS["gpt-1.3b"].__class__(**{**vars(PRESETS["gpt-1.3b"]), "vocab": 256000})
    shards = VocabShards(VocabMethod(method), 4, model, 4, "bf16")
    costs = AnalyticCosts(model, 989e12, 4, "bf16", 0.5, vocab=shards)
    durations = op_durations([costs.stage_cost(s, 4, 1) for s in range(4)], False)
    schedule = vocab_schedule(build("1f1b", 4, 8), VocabMethod(method), durations, shards.collective_bytes())
    base, stage_costs = prepare(schedule, costs)
    program = data_parallel(base, schedule, 2, [c.params * 2 for c in stage_costs], GradSync())
    groups = {c.group for c in program.flow_collective if c is not None}
    assert {(0, 1, 2, 3), (4, 5, 6, 7)} <= groups and (0, 4) in groups
    engine = Engine(program, servers(1, 8, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(1, 8, 450 * GB, 2 * GB)).run()
    result = simulate(method, "model.vocab=256000", "cluster.data_parallel=2")
    alone = simulate(method, "model.vocab=256000")
    busy = [d.busy_s for d in result.devices]
    assert busy[:4] == busy[4:] == [d.busy_s for d in alone.devices]
    assert result.throughput_samples_per_s > 1.9 * alone.throughput_samples_per_s
