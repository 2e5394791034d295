"""The CLI: JSON fields, outputs, and one-line usage errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from pipescope.experiments.cli import main

UNIFORM = ["--set", "costs.kind=uniform", "--set", "costs.forward=1", "--set", "costs.backward_input=1",
           "--set", "costs.backward_weight=1", "--set", "costs.p2p=0"]


def test_simulate_json_has_every_design_field(cli) -> None:
    """simulate --json prints one object with docs/cli.md's fields; bubble_rate matches the closed form."""
    code, out, _ = cli(["simulate", "--json", "--schedule", "gpipe", "--stages", "4", "--microbatches", "8",
                            *UNIFORM])
    assert code == 0
    data = json.loads(out)
    for key in ("schedule", "stages", "devices", "microbatches", "iteration_time_s", "bubble_rate",
                "throughput_samples_per_s", "peak_memory_bytes", "sim_wall_s", "ops", "per_device"):
        assert key in data
    assert data["bubble_rate"] == pytest.approx(3 / 11)
    assert data["iteration_time_s"] == pytest.approx(11 * 3.0)
    assert data["ops"] == 4 * 8 * 2
    assert [d["peak_activations"] for d in data["per_device"]] == [8, 8, 8, 8]
    assert set(data["per_device"][0]) >= {"device", "busy_s", "span_s", "idle_fraction", "peak_memory_bytes"}


def test_config_file_and_set_override(tmp_path, cli) -> None:
    """--set overrides the YAML file, and short flags override --set."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("schedule:\n  name: gpipe\n  stages: 2\n  microbatches: 2\ncosts:\n  kind: uniform\n")
    code, out, _ = cli(["simulate", "--json", "--config", str(cfg), "--set", "schedule.stages=3",
                            "--microbatches", "5", "--set", "costs.forward=18.5ms"])
    data = json.loads(out)
    assert code == 0 and data["stages"] == 3 and data["microbatches"] == 5
    assert data["per_device"][0]["busy_s"] == pytest.approx(5 * (0.0185 + 2.0))


def test_analytic_run_reports_memory_and_mfu(cli) -> None:
    """The default analytic run reports a positive MFU below 1 and per-device memory."""
    code, out, _ = cli(["simulate", "--json"])
    data = json.loads(out)
    assert code == 0 and 0 < data["mfu"] < 1
    assert data["peak_memory_bytes"] == max(d["peak_memory_bytes"] for d in data["per_device"])
    assert data["oom"] == []


def test_oom_is_reported_with_device_and_bytes_and_exits_3(cli) -> None:
    """A 1 GiB device cannot hold GPT 1.3B's stages: OOM names device and bytes, exit 3 unless --allow-oom."""
    code, out, err = cli(["simulate", "--set", "cluster.memory=1GiB"])
    assert code == 3
    assert "OOM: device 0 needs" in out and "of 1.00 GiB" in out
    assert err.count("\n") == 1 and "OOM on 4 of 4 devices: device 0 needs" in err and "1,073,741,824" in err
    code, out, err = cli(["simulate", "--set", "cluster.memory=1GiB", "--allow-oom", "--json"])
    assert code == 0 and err == "" and len(json.loads(out)["oom"]) == 4



def test_table_of_a_data_parallel_2bw_run_counts_each_replicas_versions(cli) -> None:
    """The table names every replica's devices: with 2 replicas of a 2-stage 2BW pipeline, devices 0-3 each
    hold 2 weight versions (it once indexed the pipeline's versions by the replica-wide device id and crashed)."""
    code, out, err = cli(["simulate", "--schedule", "2bw", "--stages", "2", "--microbatches", "2",
                          "--set", "model.preset=tiny", "--set", "cluster.data_parallel=2"])
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert [row[-1] for row in rows] == ["2", "2", "2", "2"]

@pytest.mark.parametrize(("args", "expected"), [
    (["--schedule", "nope"], "schedule.name: got 'nope', expected one of"),
    (["--stages", "0"], "schedule.stages: got 0, expected an integer from 1 to 100,000"),
    (["--microbatches", "0"], "schedule.microbatches: got 0, expected an integer from 1 to 500,000"),
    (["--set", "schedule.stages"], "--set 'schedule.stages': expected dotted.key=value"),
    (["--set", "costs.forward=3fortnights"], "costs.forward: got '3fortnights': unknown unit 'fortnights'"),
    (["--config", "/nonexistent/x.yaml"], "--config: '/nonexistent/x.yaml' is not a file (looked for '/nonexistent/x"),
    (["--set", "schedule.colour=red"], "schedule.colour: unknown key"),
    (["--set", "model.preset=gpt-9t"], "model.preset: got 'gpt-9t', expected one of tiny,"),
    (["--set", "cluster.topology=moon"], "cluster.topology: got 'moon', expected a .yaml, .yml or .graphml file or "
     "one of dgx-a100"),
    (["--stages", "two"], "schedule.stages: got 'two', expected a plain decimal integer"),
    (["--stages", "32", "--set", "cluster.nodes=4"], "model.layers: got 24, expected at least one layer per stage"),
    (["--stages", "3000"], "cluster.nodes: the run needs 3,000 GPUs (stages x data_parallel) but 1 x 8 GPUs of "
     "dgx-h100 give 8; expected cluster.nodes >= 375"),
    (["--microbatches", "200000"], "microbatch-stages, expected at most 500,000"),
    (["--microbatches", "100000000"], "schedule.microbatches: got 100000000, expected an integer from 1 to 500,000"),
    (["--schedule", "2bw", "--microbatches", "200", "--set", "iterations=1000"],
     "microbatch-stages, expected at most 500,000"),
    (["--schedule", "2bw", "--microbatches", "50000"], "= 600,000 microbatch-stages"),  # 3 iterations by default
    (["--schedule", "1f1b", "--microbatches", "125001"], "= 500,004 microbatch-stages"),  # 1F1B runs one
    (["--set", "costs.forward=.nan"], "costs.forward: got nan, expected a finite time"),
    (["--set", "model.hidden=1000000000", "--set", "model.heads=1"],
     "model.hidden: got 1000000000, expected an integer from 1 to 1,048,576"),
    (["--set", "model.hidden=1048576", "--set", "model.heads=1", "--set", "model.seq=16777216"],
     "costs: an op would take"),
    (["--set", "model.hidden=7"], "model.heads: got 16, expected a divisor of model.hidden (=7)"),
    (["--set", "costs.efficiency=true"], "costs.efficiency: got True, expected a finite number"),
    (["--set", "costs.p2p=1e30"], "costs.p2p: got 1e+30 s, expected 0 or 1 ns (the clock's resolution) to 1e+06 s"),
    (["--set", "cluster.memory=16"], "cluster.memory: got 16 B, expected a size from 1.00 MiB to 1.00 PiB (a number "
                                   "without a unit is bytes"),
    (["--set", "schedule=5"], "schedule: got 5, expected a mapping of keys"),
    (["--gantt", "out.xyz"], "--gantt: got 'out.xyz', expected a file name ending in .png or .svg or .pdf"),
    (["--trace", "/proc/x.json"], "--trace: cannot write '/proc/x.json'"),
    (["--timeline", "/proc/nope/t.csv"], "--timeline: cannot write '/proc/nope/t.csv'"),  # checked, or at writing
    (["--schedule", "csv:/nonexistent.csv"], "schedule.name: csv file '/nonexistent.csv' cannot be read"),
    (["--set", "cluster.nodes=0"], "cluster.nodes: got 0, expected an integer from 1 to 4,096"),
    (["--set", "model.precision=fp8"], "model.precision: got 'fp8', expected one of bf16, fp16, fp32"),
    (["--schedule", "zb-h2", "--stages", "4", "--microbatches", "2"], "schedule.microbatches"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], expected: str, cli) -> None:
    """Each bad input exits 2 with a single line naming the key and the value."""
    code, out, err = cli(["simulate", *args])
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pipescope: error: ")
    assert expected in err


def test_check_command(tmp_path, cli) -> None:
    """pipescope check accepts a good CSV (exit 0) and names the problem of a bad one (exit 1)."""
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("0F0,0B0\n1F0,1B0\n")
    bad.write_text("0F0,0B0\n1F0\n")
    code, out, _ = cli(["check", str(good)])
    assert code == 0 and "ok: 2 devices" in out and "4 unit-time steps (6 with send/recv" in out
    one = tmp_path / "one.csv"
    one.write_text("0F0,0B0\n")
    code, out, _ = cli(["check", str(one)])  # counted in the singular where it is one
    assert code == 0 and "ok: 1 device, 1 stage, 1 microbatch, 2 ops, 2 unit-time steps" in out
    pytest.importorskip("torch")
    blocking = tmp_path / "blocking.csv"  # pipescope posts receives without blocking; torch's dry run blocks on them
    blocking.write_text("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n")
    code, out, err = cli(["check", str(blocking)])
    assert code == 1 and out.startswith(f"{blocking}: valid for pipescope, not for torch: 2 devices")
    assert err.startswith(f"{blocking}: torch's dry run refuses it:")
    code, _, err = cli(["check", str(bad)])
    assert code == 1 and "stage 1 microbatch 0: missing B (or I and W)" in err
    code, _, err = cli(["check", str(tmp_path / "absent.csv")])
    assert code == 2 and "does not exist" in err


def test_schedules_lists_generators(cli) -> None:
    """pipescope schedules names every generator with a description."""
    code, out, _ = cli(["schedules"])
    assert code == 0
    assert out.startswith("gpipe") or "gpipe " in out
    assert "1f1b" in out and "aliases: flush" in out and "torch:<Name>" in out


def test_an_unknown_flag_points_at_the_subcommands_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--bogus"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == ("pipescope: error: unrecognized arguments: --bogus (see 'pipescope "
                                                 "simulate --help')\n")


def test_version_and_every_commands_help_says_what_it_does(capsys) -> None:
    """``--version`` prints the package's version; each command's --help opens with a paragraph of its own, not
    just the flags."""
    import pipescope
    from pipescope.experiments.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"pipescope {pipescope.__version__}\n"
    commands = build_parser()._subparsers._group_actions[0].choices
    assert len(commands) >= 12
    for name, parser in commands.items():
        assert parser.description and len(parser.description) > 60, name


def test_console_script_argparse_error_is_one_line() -> None:
    """An unknown command through the real entry point: exit 2, one line."""
    proc = subprocess.run([sys.executable, "-m", "pipescope.experiments.cli", "frobnicate"], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "invalid choice: 'frobnicate'" in proc.stderr


def test_csv_output_is_torch_compute_only(tmp_path, cli) -> None:
    """simulate --csv writes the schedule it ran; check accepts it."""
    path = tmp_path / "s.csv"
    code, _, _ = cli(["simulate", "--schedule", "1f1b", "--stages", "3", "--microbatches", "4", "--csv",
                          str(path), *UNIFORM])
    assert code == 0
    assert path.read_text().splitlines()[2] == "2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3"
    assert main(["check", str(path)]) == 0


@pytest.mark.parametrize(("text", "expected"), [
    ("device: b200\ngpus_per_node: 8\nintra_node: {bandwidth: 1GB/s, latency: 1us}\n"
     "inter_node: {bandwidth: 1GB/s, latency: 1us}\n", "device: got 'b200', expected one of"),
    ("device: h100\ngpus_per_node: 8\nintra_node: {bandwidth: 0, latency: 1us}\n"
     "inter_node: {bandwidth: 1GB/s, latency: 1us}\n", "intra_node: bandwidth: got 0, expected 1MB/s to 1PB/s"),
    ("device: h100\ngpus_per_node: 8.5\nintra_node: {bandwidth: 1GB/s, latency: 1us}\n"
     "inter_node: {bandwidth: 1GB/s, latency: 1us}\n", "gpus_per_node: got 8.5, expected an integer from 1 to 256"),
    ("device: [unclosed\n", "line 2: expected ',' or ']', but got '<stream end>'"),
    ("device: h100\n", "gpus is missing, expected keys device, gpus"),
])
def test_bad_topology_file(text: str, expected: str, tmp_path, cli) -> None:
    """A broken topology YAML is one line naming the file and the problem, exit 2."""
    path = tmp_path / "machine.yaml"
    path.write_text(text)
    code, _, err = cli(["simulate", "--set", f"cluster.topology={path}"])
    assert code == 2 and err.count("\n") == 1 and expected in err


def test_simulate_reports_a_deadlocking_csv(tmp_path, cli) -> None:
    """simulate on a deadlocking CSV exits 1 naming each stuck op and what it waits for."""
    path = tmp_path / "dead.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    code, out, err = cli(["simulate", "--schedule", f"csv:{path}", "--set", "costs.kind=uniform"])
    assert code == 1 and out == ""
    assert "deadlock: cannot place sends/recvs: device 0 position 1: 0B0 waits for 0RECV_B0 or 1I0 or 1B0" in err
    assert "device 1 position 0: 1F1 waits for 1RECV_F1 or 0F1" in err


def test_csv_schedule_honours_given_sizes_and_recompute(tmp_path, capsys) -> None:
    """With csv:, a disagreeing --stages is refused, --microbatches is what the file must cover, and
    --recompute adds a forward to every backward."""
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n")
    base = ["simulate", "--json", "--schedule", f"csv:{path}", "--set", "costs.kind=uniform"]
    assert main([*base, "--stages", "4"]) == 2
    assert "schedule.stages: got 4, expected 2: the devices" in capsys.readouterr().err
    assert main([*base, "--microbatches", "2"]) == 1
    assert "stage 0 microbatch 1: missing F (0F1)" in capsys.readouterr().err
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["iteration_time_s"]
    assert main([*base, "--recompute"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] == pytest.approx(plain + 2.0)
