"""What a new user's first hour tripped on: shipped configs by name, the schedule's own chunk count, missing extras,
the size cap counting what runs, OOM as an exit code, weight versions in the output, and per-GPU precisions."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from pipescope.config import ConfigError, load_config
from pipescope.runner import run

UNIFORM = ["--set", "costs.kind=uniform"]


def test_shipped_configs_load_by_name_from_any_folder(cli, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli(["simulate", "--config", "demo", "--json"])
    assert code == 0 and json.loads(out)["schedule"] == "1f1b"
    code, _, err = cli(["simulate", "--config", "dmeo"])
    assert code == 2 and f"(looked for '{tmp_path / 'dmeo'}')" in err and "one of demo," in err


@pytest.mark.parametrize(("schedule", "chunks"), [("zb-v", 2), ("v-half", 2), ("interleaved", 2), ("1f1b", 1)])
def test_each_schedule_takes_its_own_chunk_count_by_default(schedule: str, chunks: int) -> None:
    config = load_config(None, ["costs.kind=uniform", f"schedule.name={schedule}"])
    assert config.schedule.chunks is None and run(config).schedule.chunks == chunks


def test_torch_v_schedule_needs_no_chunks_flag_and_both_refuse_other_counts(cli, torch_sched) -> None:
    code, out, _ = cli(["simulate", "--schedule", "torch:ZBVZeroBubble", *UNIFORM, "--json"])
    assert code == 0 and json.loads(out)["chunks"] == 2
    for schedule in ("torch:ZBVZeroBubble", "zb-v"):
        code, _, err = cli(["simulate", "--schedule", schedule, "--chunks", "1", *UNIFORM])
        assert code == 2 and "schedule.chunks: got 1, expected 2" in err


def test_missing_extras_name_the_pip_command(cli, monkeypatch, tmp_path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "pyarrow") else real(name, *a))
    code, _, err = cli(["simulate", "--schedule", "torch:GPipe", *UNIFORM])
    assert code == 2 and "pip install 'pipescope[calibration]'" in err and err.count("\n") == 1
    code, _, err = cli(["simulate", *UNIFORM, "--timeline", str(tmp_path / "t.parquet")])
    assert code == 2 and "needs pyarrow: pip install 'pipescope[sweep]'" in err
    assert not (tmp_path / "t.parquet").exists()


def test_iterations_is_refused_where_it_would_be_ignored(cli, tmp_path) -> None:
    csv = tmp_path / "s.csv"
    assert cli(["simulate", *UNIFORM, "--csv", str(csv)])[0] == 0
    for schedule in (f"csv:{csv}", "1f1b"):
        code, _, err = cli(["simulate", "--schedule", schedule, *UNIFORM, "--set", "iterations=2"])
        assert code == 2 and err.startswith("pipescope: error: iterations: got 2")


def test_weight_versions_and_update_rule_are_in_json_and_table(cli) -> None:
    code, out, _ = cli(["simulate", "--schedule", "pipedream", *UNIFORM, "--json"])
    data = json.loads(out)
    assert data["weight_update"] == "async-stash" and [d["weight_versions"] for d in data["per_device"]] == [4, 3, 2, 1]
    code, out, _ = cli(["simulate", "--schedule", "2bw", *UNIFORM])
    assert "weight update 2bw" in out and "versions" in out
    assert [line.split()[-1] for line in out.splitlines() if line.split()[:1] in (["0"], ["3"])] == ["2", "2"]


def test_output_suffixes_are_read_in_any_case(cli, tmp_path) -> None:
    trace, timeline = tmp_path / "t.JSON.GZ", tmp_path / "t.PARQUET"
    assert cli(["simulate", *UNIFORM, "--trace", str(trace), "--timeline", str(timeline)])[0] == 0
    assert "traceEvents" in json.loads(gzip.decompress(trace.read_bytes()))
    assert len(pd.read_parquet(timeline)) > 0


def test_precision_defaults_to_what_the_gpu_runs_and_refuses_what_it_cannot() -> None:
    h100 = run(load_config(None, []))
    v100 = run(load_config(None, ["cluster.topology=p3dn-v100"]))
    assert (h100.config.model.precision, v100.config.model.precision) == ("bf16", "fp16")
    assert v100.peak_flops_per_device == 125e12
    expected = r"^model.precision: got 'bf16', expected one of fp16, fp32 on p3dn-v100 \(V100 GPUs have no bf16 tensor"
    with pytest.raises(ConfigError, match=expected):
        run(load_config(None, ["cluster.topology=p3dn-v100", "model.precision=bf16"]))


def test_outputs_must_be_named_and_distinct(cli, tmp_path) -> None:
    code, _, err = cli(["simulate", *UNIFORM, "--trace", ""])
    assert code == 2 and "--trace: got ''" in err
    same = str(tmp_path / "a.csv")
    code, _, err = cli(["simulate", *UNIFORM, "--csv", same, "--timeline", same])
    assert code == 2 and "the file --csv writes" in err and not (tmp_path / "a.csv").exists()
    (tmp_path / "here").symlink_to(tmp_path)  # the same file through a symlinked folder
    code, _, err = cli(["simulate", *UNIFORM, "--csv", same, "--timeline", str(tmp_path / "here" / "a.csv")])
    assert code == 2 and "the file --csv writes" in err and not (tmp_path / "a.csv").exists()


def test_csv_schedules_count_against_the_run_limit(cli, tmp_path) -> None:
    csv = tmp_path / "big.csv"
    m = 300_000  # 2 devices x 300,000 microbatches: 600,000 microbatch-stages, over the 500,000 limit
    csv.write_text("\n".join(",".join([f"{d}F{i}" for i in range(m)] + [f"{d}B{i}" for i in range(m)])
                             for d in range(2)) + "\n")
    code, _, err = cli(["simulate", "--schedule", f"csv:{csv}", *UNIFORM])
    assert code == 2 and "= 600,000 microbatch-stages, expected at most 500,000" in err


def test_an_empty_preset_or_a_topology_file_in_capitals(cli, tmp_path) -> None:
    code, _, err = cli(["simulate", "--set", "model.preset="])
    assert code == 2 and "model.preset: got '', expected one of tiny," in err
    machine = tmp_path / "M.YAML"
    machine.write_text((Path(__file__).parents[1] / "topologies" / "machines" / "dgx-h100.yaml").read_text())
    assert cli(["simulate", *UNIFORM, "--set", f"cluster.topology={machine}"])[0] == 0
    code, _, err = cli(["simulate", *UNIFORM, "--set", f"cluster.topology={tmp_path / 'none.yaml'}"])
    assert code == 2 and "is not a file, expected a readable YAML file" in err


def test_the_table_headline_names_every_parallel_width() -> None:
    """w replicas multiply the devices the table lists: its headline says so, as it says t under tensor parallelism."""
    from pipescope.experiments.report import table
    sets = ["schedule.stages=2", "schedule.microbatches=2", "cluster.data_parallel=2"]
    assert table(run(load_config(None, sets))).splitlines()[0].startswith("1f1b: p=2 m=2 v=1 w=2  weight update")
    assert " w=" not in table(run(load_config(None, sets[:2]))).splitlines()[0]


def test_what_the_model_refuses_is_one_line_in_the_planner_and_under_offload(cli, tmp_path) -> None:
    """A failed link broke the planner's worker pool (its NetworkError could not be sent back) and an op past the
    time limit under offload was a traceback; each is now the one line simulate gives."""
    import pickle

    from pipescope.simulator.flows import NetworkError

    assert pickle.loads(pickle.dumps(NetworkError("no route", 3))).flow == 3
    failed = "faults.failed_links=n0.gpu0-n0.nvswitch0, n0.gpu0-n0.pcie0, n0.gpu0-n0.nic0"
    code, _, err = cli(["plan", "--global-batch", "8", "--schedules", "1f1b", "--tensor", "1", "--recompute", "none",
                        "--depths", "2", "--set", failed, "--no-progress", "--workers", "1"])
    assert code == 2 and err.startswith("pipescope: error: faults.failed_links: no route") and "Traceback" not in err
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 1048576, "n_head": 1,
                                "n_positions": 16777216, "vocab_size": 16777216}))
    code, _, err = cli(["simulate", "--set", f"model.from_hf={huge}", "--stages", "1", "--set",
                        "parallel.offload=optimizer"])
    assert code == 2 and err.startswith("pipescope: error: costs: an op would take") and "host_memory_bandwidth" in err


def test_a_memory_cap_above_the_gpus_is_said_in_simulate_and_plan(cli) -> None:
    """A cap above the GPU's memory judged out-of-memory against memory no GPU has, silently (a plan at 175 GiB
    a GPU on 80 GiB H100s)."""
    warning = ("cluster.memory 300.00 GiB is above the 80.00 GiB each a100 of dgx-a100 has: out of memory is judged "
               "against 300.00 GiB")
    result = run(load_config(None, ["cluster.topology=dgx-a100", "cluster.memory=300GiB"]))
    assert warning in result.warnings
    assert not any("is above the" in w for w in run(load_config(None, ["cluster.memory=40GiB"])).warnings)
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16", "--schedules",
                        "1f1b", "--tensor", "1", "--recompute", "none", "--microbatch-sizes", "2", "--vocab", "naive",
                        "--memory-cap", "300GiB", "--no-progress", "--workers", "1", "--json"])
    assert code == 0 and json.loads(out)["warnings"] == [warning]


def test_the_json_says_the_layout_that_ran_and_the_headline_the_sequence_length(cli, tmp_path) -> None:
    """--json had no tensor, context, ZeRO, model or topology: only gpus, from which no one can tell the split; a
    from_hf file's 131,072-token sequence ran unseen in the headline."""
    code, out, _ = cli(["simulate", "--set", "parallel.tensor=2", "--set", "parallel.context=2", "--set",
                        "parallel.distributed_optimizer=true", "--set", "cluster.data_parallel=2", "--set",
                        "cluster.nodes=4", "--json"])
    report = json.loads(out)
    assert code == 0 and report["parallel"]["tensor"] == 2 and report["parallel"]["context"] == 2
    assert report["parallel"]["zero"] == 1 and report["cluster"] == {"topology": "dgx-h100", "nodes": 4}
    assert report["model"]["name"] == "gpt-1.3b" and report["model"]["seq"] == 1024
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1024,
                                  "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2816,
                                  "vocab_size": 32000, "max_position_embeddings": 8192, "hidden_act": "silu",
                                  "tie_word_embeddings": False}))
    code, out, _ = cli(["simulate", "--set", f"model.from_hf={config}", "--stages", "2"])
    assert code == 0 and " s=8192 mb=" in out.splitlines()[0]


def test_a_straggler_of_a_replica_uniform_costs_do_not_simulate_is_refused() -> None:
    """Under uniform costs replicas only multiply the throughput: replica 1's straggler ran as if healthy."""
    sets = ["costs.kind=uniform", "schedule.stages=4", "schedule.microbatches=8", "cluster.data_parallel=2"]
    with pytest.raises(ConfigError, match=r"^faults.stragglers: a straggler runs replica 1's device 1, and uniform "
                                          r"costs simulate replica 0 only .* expected a GPU of replica 0 \(GPUs 0-3\)"):
        run(load_config(None, [*sets, "faults.stragglers=5:2"]))
    healthy = run(load_config(None, sets)).iteration_time_s
    assert run(load_config(None, [*sets, "faults.stragglers=1:2"])).iteration_time_s > healthy


def test_a_profile_run_knows_its_sequence_and_so_its_tokens(cli) -> None:
    """Under profiled costs the profile's model is the run's: --json said seq null and the text 'uniform costs know no
    model' for --train-tokens."""
    profile = Path(__file__).resolve().parent.parent / "calibration" / "profiles" / "h200" / "gpt-355m"
    flags = ["simulate", "--set", "costs.kind=profile", "--set", f"costs.profile={profile}", "--stages", "2",
             "--microbatches", "4"]
    code, out, _ = cli([*flags, "--json"])
    report = json.loads(out)
    assert code == 0 and report["model"]["seq"] == 1024 and report["tflops_per_gpu"] is None
    assert report["tokens_per_s"] == pytest.approx(report["throughput_samples_per_s"] * 1024)
    code, out, _ = cli([*flags, "--train-tokens", "1B"])
    assert code == 0 and "tokens/s (" in out and "to train on 1 B tokens:" in out and "unknown" not in out


def test_a_saved_full_graph_is_labelled_with_its_own_nodes(cli, tmp_path) -> None:
    """A saved 2-server graph ran on its 2 servers but the headline and --json said 1 (the config's default)."""
    saved = tmp_path / "two.yaml"
    assert cli(["topology", "dgx-h100", "--nodes", "2", "--save", str(saved)])[0] == 0
    flags = ["simulate", "--set", f"cluster.topology={saved}", "--set", "cluster.data_parallel=4"]
    code, out, _ = cli(flags)
    assert code == 0 and out.splitlines()[0].endswith(" x2")
    code, out, _ = cli([*flags, "--json"])
    assert json.loads(out)["cluster"]["nodes"] == 2


def test_a_csv_of_a_schedule_without_a_flush_says_how_it_reads_back(cli, tmp_path) -> None:
    """2BW's 3 iterations of 8 microbatches read back as one flush of 24, silently; every flush schedule still
    round-trips without a note."""
    path = tmp_path / "b.csv"
    code, out, _ = cli(["simulate", "--schedule", "2bw", "--stages", "4", "--microbatches", "8", *UNIFORM, "--csv",
                        str(path)])
    assert code == 0 and (f"warning: --csv: {path} holds the 3 iterations of 8 microbatches as one flush schedule of "
                          f"24 (a CSV has no weight update): it reads back as that, not as 2bw with 8") in out
    code, out, _ = cli(["simulate", "--schedule", f"csv:{path}", *UNIFORM, "--json"])
    assert code == 0 and json.loads(out)["microbatches"] == 24 and json.loads(out)["weight_update"] == "flush"
    code, out, _ = cli(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", *UNIFORM, "--csv",
                        str(tmp_path / "f.csv")])
    assert code == 0 and "--csv:" not in out


def test_an_hours_long_step_reads_in_hours_and_its_throughput_is_not_zero(cli) -> None:
    code, out, _ = cli(["simulate", *UNIFORM, "--set", "faults.stragglers=0:1000"])
    assert code == 0 and out.splitlines()[1].startswith("iteration time 6.667 h   throughput 0.000333 samples/s")
