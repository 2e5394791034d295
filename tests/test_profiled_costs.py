"""ProfiledCosts on hand-made profiles: interpolation, extrapolation notes, stage split, schema errors, comms fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipescope.calibration.profile_io import write_json, write_table
from pipescope.simulator.readers.profile_schema import SCHEMA_VERSION, ProfileError
from pipescope.simulator.costs import split_layers
from pipescope.simulator.models import DEFAULT_PRESET, PRESETS
from pipescope.simulator.network import link_transfer_ns
from pipescope.simulator.profiled import ProfiledCosts, interp1

# Per-microbatch time = BASE + SLOPE * microbatch_size * seq / 128 (ns), so every value is checkable by hand.
BASE = {"F": 1000, "I": 2000, "W": 1500, "B": 3300, "R": 1000}
SLOPE = 100


def op_time(op: str, mb: int, seq: int) -> int:
    return BASE[op] + SLOPE * mb * seq // 128


def timing_rows(mbs: tuple[int, ...], seqs: tuple[int, ...]) -> list[dict]:
    rows = []
    for seq in seqs:
        for mb in mbs:
            for component, ops in (("layer", "FIWBR"), ("embedding", "FW"), ("output", "FIWBR")):
                scale = {"layer": 1, "embedding": 10, "output": 3}[component]  # tell components apart in sums
                for op in ops:
                    t = op_time(op, mb, seq) * scale
                    rows.append({"component": component, "op": op, "microbatch_size": mb, "seq": seq, "shards": 1,
                                 "params": 0, "tensors": 0, "median_ns": t, "p10_ns": t, "p90_ns": t, "min_ns": t,
                                 "reps": 9})
            for shards in (1, 2):
                for op in "ST":
                    t = 4000 // shards
                    rows.append({"component": "output_shard", "op": op, "microbatch_size": mb, "seq": seq,
                                 "shards": shards, "params": 0, "tensors": 1, "median_ns": t, "p10_ns": t,
                                 "p90_ns": t, "min_ns": t, "reps": 9})
    for params, tensors in ((100, 2), (1000, 4), (5000, 12)):
        t = 500 + 3 * params + 20 * tensors
        rows.append({"component": "optimizer", "op": "step", "microbatch_size": 0, "seq": 0, "shards": 1,
                     "params": params, "tensors": tensors, "median_ns": t, "p10_ns": t, "p90_ns": t, "min_ns": t,
                     "reps": 9})
    return rows


def memory_rows(mbs: tuple[int, ...], seqs: tuple[int, ...]) -> list[dict]:
    params = {"layer": 700, "embedding": 50, "output": 60}
    return [{"component": c, "microbatch_size": mb, "seq": seq, "params": params[c], "tensors": 2, "param_bytes": 0,
             "activation_bytes": 1000 * mb * seq, "weight_grad_bytes": 200 * mb * seq, "boundary_bytes": 64 * mb * seq,
             "peak_backward_bytes": float("nan")} for c in params for seq in seqs for mb in mbs]


# The profile's model, as calibrate writes it: 5 layers of the default preset's width (the runner refuses a profile
# whose shape it would have to guess)
MODEL = {"name": "test", "layers": 5, "hidden": PRESETS[DEFAULT_PRESET].hidden, "heads": PRESETS[DEFAULT_PRESET].heads,
         "seq": 128, "vocab": PRESETS[DEFAULT_PRESET].vocab}


def make_profile(folder: Path, mbs: tuple[int, ...] = (2, 4), seqs: tuple[int, ...] = (128,),
                 version: int = SCHEMA_VERSION, parquet: bool = True, drop: str | None = None) -> Path:
    """Write a profile folder with the calibrate layout; ``drop`` removes one timings column."""
    folder.mkdir(parents=True, exist_ok=True)
    timings = timing_rows(mbs, seqs)
    if drop:
        timings = [{k: v for k, v in row.items() if k != drop} for row in timings]
    tables = {"timings": write_table(folder, "timings", timings, parquet=parquet),
              "memory": write_table(folder, "memory", memory_rows(mbs, seqs), parquet=parquet)}
    meta = {"schema_version": version, "kind": "compute", "precision": "bf16", "model": {**MODEL, "seq": max(seqs)},
            "seqs": list(seqs), "tables": tables}
    write_json(folder / "profile.json", meta)
    return folder


def test_interp1_interpolates_extrapolates_and_scales_a_single_point() -> None:
    """Inside: the line between neighbours; outside: the end segment, flagged; one point: proportional. An end
    segment that falls as the work grows is held flat at the nearest point, one that reaches 0 below the measured
    sizes is proportional to the nearest point (more work never costs less: that is noise)."""
    assert interp1([1, 4], [10, 40], 2) == (20, "")
    assert interp1([1, 2, 4], [10, 30, 40], 8) == (60, "linear")
    assert interp1([4], [40], 8) == (80, "proportional")
    assert interp1([4], [40], 4) == (40, "")
    assert interp1([2, 4], [30, 10], 8) == (10, "flat")  # the line said -30
    assert interp1([2, 4], [30, 28], 5) == (28, "flat")  # the line said 27: above 0, but below 28
    assert interp1([2, 4], [30, 28], 1) == (30, "flat")  # less work, more time: held too
    assert interp1([2, 4], [10, 40], 1) == (5, "proportional")  # the line said -5 below the measured sizes
    assert interp1([2, 4], [30, 40], 1) == (25, "linear")  # rising, positive: the line
    assert interp1([2, 4], [0, 0], 8) == (0, "linear")  # measured 0 everywhere stays 0


def test_measured_point_is_read_exactly_with_no_notes(tmp_path: Path) -> None:
    """At a measured microbatch size the stage cost is the table's sum and nothing is flagged."""
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=4)
    stage = costs.stage_cost(0, 1, 1)
    f = 5 * op_time("F", 4, 128) + 10 * op_time("F", 4, 128) + 3 * op_time("F", 4, 128)
    assert stage.forward_ns == f
    assert stage.input_grad_ns == 5 * op_time("I", 4, 128) + 3 * op_time("I", 4, 128)
    assert stage.weight_grad_ns == (5 + 10 + 3) * op_time("W", 4, 128)
    assert costs.notes() == []


def test_between_measured_microbatch_sizes_is_linear(tmp_path: Path) -> None:
    """Microbatch 3 between measured 2 and 4 gives the midpoint of times and bytes, with no warning."""
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=3)
    assert costs.time_ns("layer", "F") == op_time("F", 3, 128)
    assert costs.stage_cost(1, 2, 1).activation_bytes == split_layers(5, 2)[1] * 1000 * 3 * 128 + 1000 * 3 * 128
    assert costs.notes() == []


def test_extrapolation_is_flagged_in_notes(tmp_path: Path) -> None:
    """Microbatch 8 beyond the measured 2..4 is extrapolated linearly and the note says so once."""
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=8)
    assert costs.time_ns("layer", "I") == op_time("I", 8, 128)
    costs.stage_cost(0, 2, 1)
    assert costs.notes() == ["costs.profile: microbatch size 8 outside the measured 2..4; extrapolated linearly"]


def test_sequence_lengths_interpolate_and_flag_outside(tmp_path: Path) -> None:
    """With seqs 128 and 256 measured, 192 interpolates silently and 512 is flagged."""
    folder = make_profile(tmp_path, seqs=(128, 256))
    assert ProfiledCosts.load(folder, 2, seq=192).time_ns("layer", "W") == op_time("W", 2, 192)
    beyond = ProfiledCosts.load(folder, 2, seq=512)
    assert beyond.time_ns("layer", "W") == op_time("W", 2, 512)
    assert any("sequence length 512" in note for note in beyond.notes())


def test_stages_split_layers_with_embedding_first_and_output_last(tmp_path: Path) -> None:
    """5 layers on 2 stages: 3 + 2; params count the embedding on stage 0 and the output layer on stage 1."""
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=2)
    first, last = costs.stage_cost(0, 2, 1), costs.stage_cost(1, 2, 1)
    assert (first.params, last.params) == (3 * 700 + 50, 2 * 700 + 60)
    assert first.recompute_ns == 3 * op_time("R", 2, 128) and last.input_grad_ns == 5 * op_time("I", 2, 128)
    assert first.boundary_bytes == last.input_bytes == 64 * 2 * 128
    assert first.input_bytes == 2 * 128 * 8  # the first stage's input is int64 token ids, not an activation
    assert (first.param_tensors, last.param_tensors) == (3 * 2 + 2, 2 * 2 + 2)  # AdamW's step counters count these
    assert first.weight_grad_bytes == 3 * 200 * 2 * 128 + 200 * 2 * 128


def test_layers_override_changes_the_split(tmp_path: Path) -> None:
    """layers=8 over 4 stages puts 2 layers on each."""
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=2, layers=8)
    assert costs.stage_cost(2, 4, 1).forward_ns == 2 * op_time("F", 2, 128)


def test_csv_fallback_loads_the_same_costs(tmp_path: Path) -> None:
    """A profile written without Parquet (CSV) gives identical stage costs."""
    parquet = ProfiledCosts.load(make_profile(tmp_path / "a"), 3).stage_cost(0, 3, 1)
    csv = ProfiledCosts.load(make_profile(tmp_path / "b", parquet=False), 3).stage_cost(0, 3, 1)
    assert (tmp_path / "b" / "timings.csv").is_file() and csv == parquet


def test_optimizer_fit_recovers_the_linear_model(tmp_path: Path) -> None:
    """500 + 3 params + 20 tensors ns is recovered from three measured groups."""
    costs = ProfiledCosts.load(make_profile(tmp_path), 2)
    assert costs.optimizer_ns(10_000, 30) == pytest.approx(500 + 30_000 + 600, abs=2)


def test_vocab_shards_measured_and_scaled(tmp_path: Path) -> None:
    """2 shards are read back; 4 shards (not measured) scale from 2 as 1/shards, with a note."""
    costs = ProfiledCosts.load(make_profile(tmp_path), 2)
    assert costs.vocab_shard_ns(2) == (2000, 2000)
    assert costs.vocab_shard_ns(4) == (1000, 1000)
    assert any("4 vocabulary shards" in note for note in costs.notes())


def test_precision_mismatch_is_noted(tmp_path: Path) -> None:
    """Asking fp32 of a bf16 profile keeps the measured costs and says so."""
    costs = ProfiledCosts.load(make_profile(tmp_path), 2, precision="fp32")
    assert costs.precision == "bf16" and "measured in bf16" in costs.notes()[0]


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A profile from a newer schema names the version and asks for an upgrade."""
    with pytest.raises(ProfileError, match=f"schema_version={SCHEMA_VERSION + 1}; expected {SCHEMA_VERSION}.*upgrade"):
        ProfiledCosts.load(make_profile(tmp_path, version=SCHEMA_VERSION + 1), 2)


def test_missing_column_is_named(tmp_path: Path) -> None:
    """A timings table without median_ns fails naming that column."""
    with pytest.raises(ProfileError, match="column 'median_ns' missing"):
        ProfiledCosts.load(make_profile(tmp_path, drop="median_ns"), 2)


def test_missing_profile_and_bad_microbatch_are_refused(tmp_path: Path) -> None:
    """An empty folder has no profile.json; microbatch size 0 names the key."""
    with pytest.raises(ProfileError, match="has no profile.json"):
        ProfiledCosts.load(tmp_path, 2)
    with pytest.raises(ProfileError, match=r"nowhere' is not a folder; expected a pipescope calibrate output"):
        ProfiledCosts.load(tmp_path / "nowhere", 2)  # a mistyped folder is not one without its file
    with pytest.raises(ValueError, match="model.microbatch_size: got 0"):
        ProfiledCosts.load(make_profile(tmp_path / "p"), 0)


def add_comms(folder: Path, version: int = SCHEMA_VERSION) -> None:
    fit = [{"collective": "p2p", "world_size": 2, "lo_bytes": 1 << 15, "hi_bytes": 1 << 19, "latency_ns": 10_000.0,
            "bandwidth": 1e9, "points": 5},
           {"collective": "p2p", "world_size": 2, "lo_bytes": 1 << 20, "hi_bytes": 1 << 30, "latency_ns": 50_000.0,
            "bandwidth": 1e10, "points": 10}]
    write_json(folder / "comms.json", {"schema_version": version, "kind": "comms",
                                       "tables": {"comms_fit": write_table(folder, "comms_fit", fit)}})


def test_transfer_uses_the_p2p_fit_per_size_range(tmp_path: Path) -> None:
    """Small messages use the small-range line, large ones the large-range line, zero bytes cost nothing."""
    folder = make_profile(tmp_path)
    add_comms(folder)
    costs = ProfiledCosts.load(folder, 2)
    assert link_transfer_ns(1000, costs.p2p_link(1000)) == 10_000 + 1000
    assert link_transfer_ns(1 << 21, costs.p2p_link(1 << 21)) == 50_000 + math.ceil((1 << 21) / 10)
    assert link_transfer_ns(0, costs.p2p_link(0)) == 0


def test_transfer_without_comms_profile_uses_the_link(tmp_path: Path) -> None:
    """No comms.json: no p2p fit, so the network times transfers by the cluster's links."""
    assert ProfiledCosts.load(make_profile(tmp_path), 2).p2p_link(1 << 20) is None


def test_comms_profile_of_another_version_is_refused(tmp_path: Path) -> None:
    """A stale comms.json next to a good compute profile is an error, not silently ignored."""
    folder = make_profile(tmp_path)
    add_comms(folder, version=0)
    with pytest.raises(ProfileError, match="comms.json: schema_version=0"):
        ProfiledCosts.load(folder, 2)


def test_metadata_is_json_not_pickle(tmp_path: Path) -> None:
    """The metadata file is plain JSON and the tables are Parquet or CSV."""
    folder = make_profile(tmp_path)
    assert json.loads((folder / "profile.json").read_text())["tables"]["timings"] == "timings.parquet"


def test_fused_backward_is_the_measured_b_rows_else_i_plus_w(tmp_path: Path) -> None:
    """A fused B takes the profile's B rows (the embedding's whole backward is its W), not I + W: on a CPU the two
    differ by tens of percent either way. A profile without B rows falls back to I + W."""
    import dataclasses

    from pipescope.simulator.ir import ActionKind
    from pipescope.simulator.program import op_durations
    costs = ProfiledCosts.load(make_profile(tmp_path / "a"), microbatch_size=2)
    first, last = costs.stage_cost(0, 2, 1), costs.stage_cost(1, 2, 1)
    assert first.backward_ns == 3 * op_time("B", 2, 128) + 10 * op_time("W", 2, 128)
    assert last.backward_ns == 2 * op_time("B", 2, 128) + 3 * op_time("B", 2, 128)
    table = op_durations([first, last], recompute=True)
    assert table[1, ActionKind.B] == last.backward_ns + last.recompute_ns
    assert table[1, ActionKind.I] == last.input_grad_ns + last.recompute_ns != table[1, ActionKind.B]
    split = op_durations([dataclasses.replace(last, backward_ns=None)], recompute=False)
    assert split[0, ActionKind.B] == last.input_grad_ns + last.weight_grad_ns
    folder = make_profile(tmp_path / "b")
    import pandas as pd
    timings = pd.read_parquet(folder / "timings.parquet")
    timings[timings["op"] != "B"].to_parquet(folder / "timings.parquet")
    assert ProfiledCosts.load(folder, microbatch_size=2).stage_cost(1, 2, 1).backward_ns is None


def test_measured_op_times_replace_the_profiles_but_not_its_bytes(tmp_path: Path) -> None:
    """``op_times`` (validate --op-times stages) set F, B, I, W and the step per stage and drop the recompute (a
    measured backward ran it); bytes and parameters stay the profile's."""
    import dataclasses
    costs = ProfiledCosts.load(make_profile(tmp_path), microbatch_size=2)
    measured = dataclasses.replace(costs, op_times=({"F": 11, "B": 22, "OPT": 33}, {"F": 44, "I": 55, "W": 66}),
                                   _cache={})
    first, last = measured.stage_cost(0, 2, 1), measured.stage_cost(1, 2, 1)
    assert (first.forward_ns, first.backward_ns, first.optimizer_ns, first.recompute_ns) == (11, 22, 33, 0)
    assert (last.forward_ns, last.input_grad_ns, last.weight_grad_ns) == (44, 55, 66)
    assert last.optimizer_ns == costs.stage_cost(1, 2, 1).optimizer_ns
    assert first.activation_bytes == costs.stage_cost(0, 2, 1).activation_bytes and first.params == 3 * 700 + 50
    with pytest.raises(ProfileError, match=r"^op_times: got 2 stages' times, expected 3"):
        measured.stage_cost(0, 3, 1)  # times measured on another split


def test_link_faults_without_links_are_refused(tmp_path: Path) -> None:
    """A comms profile's p2p fit joins every pair and uniform costs have a fixed delay: neither has links, so a
    degraded or failed link would be ignored without a word. Both are one-line errors naming the key."""
    from pipescope.config import ConfigError, load_config
    from pipescope.runner import run

    folder = make_profile(tmp_path)
    add_comms(folder)
    profile = ["costs.kind=profile", f"costs.profile={json.dumps(str(folder))}", "model.microbatch_size=2",
               "schedule.stages=2"]
    assert run(load_config(None, profile)).iteration_ns > 0
    faults = {"degraded_links": "n0.nic0-leaf0:0.5", "failed_links": "n0.gpu0-n0.nvswitch0"}
    for key, value in faults.items():
        for sets, network in ((profile, "a comms profile"), (["costs.kind=uniform"], "costs.kind=uniform")):
            with pytest.raises(ConfigError, match=f"^faults.{key}: got '{value}' under {network}") as err:
                run(load_config(None, [*sets, f"faults.{key}={value}"]))
            assert "\n" not in str(err.value)


def test_a_profile_of_another_device_than_the_clusters_is_said(tmp_path: Path) -> None:
    """A CPU profile without comms would send its transfers over the cluster's GPU links, and another GPU's op
    times are not the cluster's: each is a warning in the result; a CPU profile with comms, or the same GPU, none."""
    from pipescope.config import load_config
    from pipescope.runner import run

    def warnings(device: dict, topology: str = "dgx-h100", comms: bool = False) -> list[str]:
        folder = make_profile(tmp_path / f"p{len(list(tmp_path.iterdir()))}")
        meta = json.loads((folder / "profile.json").read_text())
        write_json(folder / "profile.json", {**meta, "device": device})
        if comms:
            add_comms(folder)
        sets = ["costs.kind=profile", f"costs.profile={json.dumps(str(folder))}", "model.microbatch_size=2",
                "schedule.stages=2", f"cluster.topology={topology}"]
        return [w for w in run(load_config(None, sets)).warnings if "measured on" in w]

    cpu = {"type": "cpu", "name": "Intel(R) Xeon(R) Processor"}
    (note,) = warnings(cpu)
    assert note.startswith("costs.profile: measured on a CPU ('Intel(R) Xeon(R) Processor') without comms")
    assert warnings(cpu, comms=True) == []
    a100 = {"type": "cuda", "name": "NVIDIA A100-SXM4-80GB"}
    assert warnings(a100, "dgx-a100") == []
    (note,) = warnings(a100)
    assert note.startswith("costs.profile: measured on 'NVIDIA A100-SXM4-80GB', the cluster's GPUs are h100s")
