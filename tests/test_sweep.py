"""``pipescope sweep``: the grid is validated before anything runs, a process pool and a Dask LocalCluster give the
same rows, a killed sweep resumes without running a finished run again, and failing runs are kept as rows."""

from __future__ import annotations

import errno
import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from pipescope.experiments import sweep
from pipescope.experiments.sweep import SweepPlan, dask_executor, expand, read_rows, run_sweep

ROOT = Path(__file__).resolve().parents[1]
UNIFORM = {"kind": "uniform", "forward": "1ms", "backward_input": "1ms", "backward_weight": "1ms", "p2p": 0}
COLUMNS = ["run_id", "status", "error", "schedule.name", "schedule.stages", "schedule.microbatches", "model.preset",
           "costs.forward", "iteration_time_s", "throughput_samples_per_s", "bubble_rate", "peak_memory_bytes",
           "mfu", "oom", "gpus", "run_wall_s"]


def experiment(tmp_path: Path, **grid) -> str:
    """A uniform-cost experiment file with the given ``sweep``/``zip`` sections (or overridden base sections)."""
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"schedule": {"name": "1f1b", "stages": 2, "microbatches": 4}, "costs": UNIFORM,
                                    **grid}, sort_keys=False))
    return str(path)


def small_grid() -> dict:
    """3 schedules x 2 stage counts x 2 zipped (microbatches, forward time) pairs = 12 runs."""
    return {"sweep": {"schedule.name": ["gpipe", "1f1b", "zb-h1"], "schedule.stages": [2, 4]},
            "zip": {"schedule.microbatches": [4, 8], "costs.forward": ["1ms", "2ms"]}}


def listening_addresses() -> set[str]:
    """IP addresses this process and its children listen on (TCP)."""
    me = psutil.Process()
    found = set()
    for proc in [me, *me.children(recursive=True)]:
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return found


def test_expand_crosses_sweep_keys_and_zips_zip_keys(tmp_path) -> None:
    """sweep is a product, zip varies its lists together; each run's config holds its values."""
    plan = expand(experiment(tmp_path, **small_grid()))
    assert (plan.combinations, len(plan.runs)) == (12, 12)
    assert plan.keys == ("schedule.name", "schedule.stages", "schedule.microbatches", "costs.forward")
    pairs = {(r.config.schedule.microbatches, r.config.costs.forward) for r in plan.runs}
    assert pairs == {(4, 0.001), (8, 0.002)}
    assert len({r.run_id for r in plan.runs}) == 12


def test_a_file_without_grid_is_one_run(tmp_path) -> None:
    """A plain config is a one-run plan: every shipped config can go through expand."""
    plan = expand(experiment(tmp_path))
    assert (plan.combinations, plan.keys, len(plan.runs)) == (1, (), 1)
    assert plan.runs[0].config.schedule.stages == 2


def test_a_runs_warnings_are_a_column(tmp_path) -> None:
    """What simulate prints as warnings is each row's ``warnings`` cell: eager attention on an H100 (no measured
    eager rate) says so, flash says nothing."""
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"schedule": {"name": "1f1b", "stages": 2, "microbatches": 4},
                                    "model": {"preset": "tiny"}, "sweep": {"model.attention": ["flash", "eager"]}}))
    run_sweep(expand(str(path)), tmp_path / "out", workers=1, progress=False)
    table = pd.read_parquet(tmp_path / "out" / "results.parquet").set_index("model.attention")
    assert table.loc["flash", "warnings"] == ""
    assert table.loc["eager", "warnings"].startswith("model.attention: eager on H100")


def test_a_line_torn_by_a_kill_is_dropped_and_its_run_runs_again(tmp_path) -> None:
    """A last line without its newline (the process died mid-write) is not a finished run: the next sweep cuts it,
    runs that run again, and leaves a log whose every line is a whole JSON object."""
    plan = expand(experiment(tmp_path, sweep={"schedule.stages": [2, 4, 8]}))
    log = tmp_path / "out" / "runs.jsonl"
    run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    whole = log.read_bytes()
    log.write_bytes(whole[:whole.rindex(b"\n", 0, len(whole) - 1) + 40])
    again = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    assert (again.ran, again.skipped) == (1, 2)
    lines = log.read_bytes().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["status"] == "ok" for line in lines)


def test_damaged_lines_are_counted_and_their_runs_run_again(tmp_path) -> None:
    """Lines of runs.jsonl damaged after the fact (NUL bytes, a JSON value that is no run) are skipped, their runs
    run again, and the summary says how many lines it could not read."""
    from pipescope.experiments.sweep_cmd import summary

    plan = expand(experiment(tmp_path, sweep={"schedule.stages": [2, 4, 8]}))
    log = tmp_path / "out" / "runs.jsonl"
    run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + b"\x00\x00garbage\n" + b"[1, 2]\n\n" + lines[2])
    again = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    assert (again.ran, again.skipped, again.unreadable) == (1, 2, 2)
    assert "warning: 2 lines of" in summary(plan, again) and len(again.frame) == 3


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[SweepPlan, Path]:
    """A 3-run sweep's plan and its finished folder (copy it before changing it)."""
    folder = tmp_path_factory.mktemp("logged")
    plan = expand(experiment(folder, sweep={"schedule.stages": [2, 4, 8]}))
    run_sweep(plan, folder / "out", workers=1, progress=False)
    return plan, folder / "out"


def _set(key: str, value: object):
    return lambda row: json.dumps({**row, key: value}).encode()


def _without(key: str):
    return lambda row: json.dumps({k: v for k, v in row.items() if k != key}).encode()


@pytest.mark.parametrize("damage", [
    _set("iteration_time_s", "fast"), _set("schedule.name", {"a": 1}), _set("schedule.stages", [1, 2]),
    _set("oom", 1), _set("schedule.microbatches", 2**70), lambda row: b"[" * 100_000,
    _set("schedule.name", "gpipe"), _set("costs.forward", 0.002), _set("iteration_time_s", math.nan),
    _set("bubble_rate", -math.inf), _set("iteration_time_s", None), _set("status", "error"), _set("error", "x"),
    _set("iterations", 2**64), _set("a", 1), _without("gpus"),
    lambda row: json.dumps({**row, "pad": "x" * 100_000}).encode(),
    _set("iteration_time_s", -1.0), _set("bubble_rate", 5), _set("gpus", 0), _set("warnings", None),
], ids=["str-metric", "dict", "list", "int-oom", "int-overflow", "nested", "other-schedule", "other-costs", "nan",
        "-inf", "null-time", "error-with-metrics", "ok-with-error", "filled-overflow",
        "extra-key", "missing-key", "too-long", "negative-time", "bubble-above-1", "no-gpus", "null-warnings"])
def test_a_logged_row_that_is_not_its_run_is_damaged(logged, tmp_path, damage) -> None:
    """A row changed after it was logged, keeping its run_id (a value of another type, beyond int64, NaN, a
    config that is not the run's, a key added or dropped, a line nested past the parser's recursion limit) is
    skipped and counted, and its run runs again. These stopped the tables being written (ArrowTypeError,
    OverflowError, RecursionError: a traceback on every re-run), or went into them silently."""
    plan, finished = logged
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    lines = (out / "runs.jsonl").read_bytes().splitlines(keepends=True)
    (out / "runs.jsonl").write_bytes(damage(json.loads(lines[0])) + b"\n" + b"".join(lines[1:]))
    with ThreadPoolExecutor(1) as executor:
        again = run_sweep(plan, out, executor, 1, progress=False)
    assert (again.ran, again.skipped, again.unreadable) == (1, 2, 1)
    frame = pd.read_parquet(out / "results.parquet")
    expected = pd.read_parquet(finished / "results.parquet")
    columns = ["run_id", "schedule.name", "costs.forward", "iteration_time_s", "bubble_rate", "oom", "gpus"]
    pd.testing.assert_frame_equal(frame[columns], expected[columns])


def test_an_untouched_log_is_read_whole(logged, tmp_path) -> None:
    """The checks pass every row a run wrote, filled-in keys included (precision, iterations): nothing re-runs."""
    plan, finished = logged
    shutil.copytree(finished, tmp_path / "out")
    with ThreadPoolExecutor(1) as executor:
        again = run_sweep(plan, tmp_path / "out", executor, 1, progress=False)
    assert (again.ran, again.skipped, again.unreadable) == (0, 3, 0)
    assert plan.runs[0].config.model.precision is None and list(again.frame["model.precision"]) == ["bf16"] * 3


def test_an_analytic_log_with_keys_the_runs_resolve_is_read_whole(tmp_path) -> None:
    """Rows hold the run's own columns with only its unset keys filled in (precision, shape, preset, iterations), so
    a re-run reads every one: pipedream at iterations 1 (run as 3 once, its row then refused on every re-run), and
    the run's precision where the file left it unset."""
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({"schedule": {"name": "pipedream", "stages": 2, "microbatches": 2},
                                    "model": {"layers": 4}, "sweep": {"iterations": [1, 2]}}))
    plan = expand(str(path))
    first = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    again = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    assert (first.ran, again.ran, again.skipped, again.unreadable) == (2, 0, 2, 0)
    assert sorted(again.frame["iterations"]) == [1, 2] and set(again.frame["model.precision"]) == {"bf16"}
    assert set(again.frame["model.preset"]) == {"gpt-1.3b"} and set(again.frame["model.hidden"]) == {2048}


@pytest.mark.parametrize("kind", ["character device", "FIFO", "folder", "bytes"])
def test_a_log_that_is_no_file_or_too_big_is_refused(cli, tmp_path, kind: str) -> None:
    """runs.jsonl as a device (/dev/zero: MemoryError at 7.7 GB after 12 to 33 s; /dev/null: fsync failed, blamed on
    --dask), a FIFO, a folder, or a (sparse) file past MAX_LOG_BYTES (6 GiB: read whole, 6.4 GB) is one line
    naming it, exit 2, before anything runs."""
    log = tmp_path / "out" / "runs.jsonl"
    log.parent.mkdir()
    if kind == "character device":
        log.symlink_to("/dev/null")
    elif kind == "FIFO":
        os.mkfifo(log)
    elif kind == "folder":
        log.mkdir()
    else:
        with open(log, "wb") as handle:
            handle.truncate(sweep.MAX_LOG_BYTES + 1)
    code, out, err = cli(["sweep", experiment(tmp_path), "--out", str(log.parent), "--workers", "1"])
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    shown = f"{sweep.MAX_LOG_BYTES + 1:,} bytes, expected at most" if kind == "bytes" else f"is a {kind}, expected"
    assert err.startswith(f"pipescope: error: --out: '{log}' ") and shown in err, err


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_out_folder_name_is_refused(name: str, cli, tmp_path) -> None:
    """``--out ""`` wrote runs.jsonl and the results into the working folder (Path("") is "."), unlike every other
    empty file name, which is refused."""
    code, out, err = cli(["sweep", experiment(tmp_path), "--out", name, "--workers", "1"])
    assert (code, out, err) == (2, "", f"pipescope: error: --out: got {name!r}, expected a folder name (made if "
                                       f"missing)\n")


def test_long_lines_and_torn_tails_are_read_in_bounded_memory(logged, tmp_path) -> None:
    """A 20 MB line (NULs) amid the rows is one damaged line, and a 20 MB last line without its newline is cut;
    neither is held in memory (both were read whole: a 6 GiB one took 6.4 GB)."""
    plan, finished = logged
    log = tmp_path / "runs.jsonl"
    lines = (finished / "runs.jsonl").read_bytes().splitlines(keepends=True)
    with open(log, "wb") as handle:
        handle.write(lines[0])
        handle.truncate(handle.tell() + (20 << 20))  # a hole of NULs: no disk used
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n" + b"".join(lines[1:]))
        whole = handle.tell()
        handle.truncate(whole + (20 << 20))
    tracemalloc.start()
    try:
        with sweep.RunLog(log) as run_log:
            done, unreadable = run_log.finished_ids(plan.runs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (len(done), unreadable, log.stat().st_size) == (3, 1, whole)
    assert peak < 2 << 20, peak


def test_rows_read_without_their_plan_still_make_tables(logged, tmp_path) -> None:
    """``write_results`` without the plan cannot check rows against their runs: a column of mixed types (a precision
    of 16 beside 'bf16') is written as text rather than stopping with ArrowInvalid; a NaN metric is still damage."""
    _, finished = logged
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    rows = {row["schedule.stages"]: row for row in map(json.loads, (out / "runs.jsonl").read_bytes().splitlines())}
    rows[2]["model.precision"], rows[4]["bubble_rate"] = 16, math.nan  # keyed: the log is in the order runs ended
    (out / "runs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    frame = sweep.write_results(out)
    assert dict(zip(frame["schedule.stages"], frame["model.precision"])) == {2: "16", 8: "bf16"}
    assert sorted(pd.read_parquet(out / "results.parquet")["schedule.stages"]) == [2, 8]


def _fail(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EIO, "Input/output error")


def test_only_a_dask_failure_blames_dask(cli, tmp_path, monkeypatch) -> None:
    """A log that cannot be synced (a full disk, /dev/null) names the file; worker processes that cannot start
    name the command; only a scheduler that cannot be reached names --dask. Every OSError blamed --dask
    ('--dask: None: [Errno 22] Invalid argument, expected a running Dask scheduler')."""
    import distributed

    from pipescope.experiments import plan as plan_module

    path, out = experiment(tmp_path), tmp_path / "out"
    monkeypatch.setattr(os, "fsync", _fail)
    code, _, err = cli(["sweep", path, "--out", str(out), "--workers", "1"])
    assert (code, err.split("\r")[-1].splitlines()[-1]) == (  # after the progress bar
        2, f"pipescope: error: --out: cannot write '{out / 'runs.jsonl'}' (Input/output error)")
    monkeypatch.setattr(sweep, "process_pool", _fail)
    code, _, err = cli(["sweep", path, "--out", str(tmp_path / "again"), "--workers", "1"])
    assert (code, err) == (2, "pipescope: error: sweep: [Errno 5] Input/output error\n")
    monkeypatch.setattr(plan_module, "process_pool", _fail)
    flags = ["--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16", "--no-progress"]
    code, _, err = cli(["plan", *flags])
    assert (code, err) == (2, "pipescope: error: plan: [Errno 5] Input/output error\n")
    monkeypatch.setattr(distributed, "Client", lambda *args, **kwargs: _fail())
    for command in (["sweep", path, "--out", str(tmp_path / "dask")], ["plan", *flags]):
        code, _, err = cli([*command, "--dask", "tcp://127.0.0.1:1"])
        assert (code, err) == (2, "pipescope: error: --dask: 'tcp://127.0.0.1:1': [Errno 5] Input/output error, "
                                  "expected a running Dask scheduler\n")


def test_a_swept_section_shows_the_keys_its_values_set(tmp_path) -> None:
    """``costs: [{kind: uniform}, {kind: analytic, efficiency: 0.4}]`` runs both sections, and the summary's table
    has a column for each key they set (not none, as for an unknown column, nor every costs key)."""
    from pipescope.experiments.sweep_cmd import summary

    plan = expand(experiment(tmp_path, sweep={"costs": [{"kind": "uniform"}, {"kind": "analytic", "efficiency": 0.4}]}))
    report = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    header = summary(plan, report).splitlines()[1].split()
    assert header[:3] == ["costs.kind", "costs.efficiency", "status"]
    assert list(report.frame["costs.kind"]) == ["uniform", "analytic"]


def test_process_pool_and_dask_local_cluster_give_identical_rows(tmp_path) -> None:
    """The same plan over a process pool and over a Dask LocalCluster (2 worker processes of 1 thread, on
    127.0.0.1 only) gives the same rows, in grid order; only the wall times differ."""
    plan = expand(experiment(tmp_path, **small_grid()))
    pool = run_sweep(plan, tmp_path / "pool", workers=2, chunk_size=3, progress=False).frame
    with dask_executor("local", workers=2) as (executor, threads):
        assert threads == 2
        assert listening_addresses() <= {"127.0.0.1"}
        dask = run_sweep(plan, tmp_path / "dask", executor, threads, chunk_size=3, progress=False).frame
    assert list(pool["run_id"]) == [r.run_id for r in plan.runs]
    assert (pool["status"] == "ok").all()
    pd.testing.assert_frame_equal(pool.drop(columns="run_wall_s"), dask.drop(columns="run_wall_s"))


def _refuse_to_start() -> None:
    raise RuntimeError("this worker never starts")


def test_runs_of_a_broken_executor_are_lost_not_logged_and_run_again(tmp_path) -> None:
    """When the executor itself fails (a pool whose workers die at start), the runs are reported lost and not
    logged, so the next sweep into the folder runs them."""
    plan = expand(experiment(tmp_path, sweep={"schedule.stages": [2, 4, 8]}))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"),
                             initializer=_refuse_to_start) as bad:
        report = run_sweep(plan, tmp_path / "out", bad, workers=1, progress=False)
    assert sorted(rid for rid, _ in report.lost) == sorted(r.run_id for r in plan.runs)
    assert all("BrokenProcessPool" in why for _, why in report.lost)
    assert read_rows(tmp_path / "out" / "runs.jsonl") == [] and len(report.frame) == 0
    again = run_sweep(plan, tmp_path / "out", workers=1, progress=False)
    assert (again.ran, again.skipped, again.lost) == (3, 0, [])


def test_killed_sweep_resumes_without_repeating_finished_runs(tmp_path) -> None:
    """A `pipescope sweep` killed (SIGKILL, pool included) after its first lines keeps them; the re-run logs each
    other run once and none of the finished ones again."""
    path = experiment(tmp_path, schedule={"name": "1f1b", "stages": 8, "microbatches": 64},
                      sweep={"seed": list(range(40))})
    out = tmp_path / "out"
    command = [sys.executable, "-m", "pipescope.experiments.cli", "sweep", path, "--out", str(out), "--workers", "2",
               "--chunk-size", "1"]
    proc = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_lines(out)) < 3:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_rows(out / "runs.jsonl")
    assert 3 <= len(before) < 40, "the sweep must be killed mid-run"
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{40 - len(before)} run now, {len(before)} already logged, 40 ok" in done.stdout
    after = read_rows(out / "runs.jsonl")
    assert after[:len(before)] == before
    assert len(after) == 40 and len({row["run_id"] for row in after}) == 40
    assert len(pd.read_parquet(out / "results.parquet")) == 40


def test_sigterm_stops_a_sweep_as_ctrl_c_and_leaves_no_worker(tmp_path) -> None:
    """`kill PID` (the sweep alone, not its group): the chunks running are logged, the tables hold what is logged,
    the pool is shut down, and no worker is left behind parented to init, as the default SIGTERM left them."""
    import psutil
    path = experiment(tmp_path, schedule={"name": "1f1b", "stages": 8, "microbatches": 64},
                      sweep={"seed": list(range(40))})
    out = tmp_path / "out"
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipescope.experiments.cli", "sweep", path, "--out", str(out),
                             "--workers", "2", "--chunk-size", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_lines(out)) < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "pipescope: stopping: logging the" in err
    logged = read_rows(out / "runs.jsonl")
    assert 3 <= len(logged) < 40
    assert f"wrote {out / 'results.parquet'} and results.csv with the {len(logged)} of 40 runs logged" in err
    assert sorted(pd.read_csv(out / "results.csv")["run_id"]) == sorted(row["run_id"] for row in logged)
    time.sleep(1)
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline", "create_time"])
            if p.info["create_time"] >= started and "multiprocessing" in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_a_second_stop_kills_the_workers_instead_of_waiting_for_their_runs(tmp_path) -> None:
    """Two SIGTERMs (as two Ctrl-Cs): the first waits for the running chunks to log them, the second stops the
    workers at once; the sweep exits 130 long before their runs of about 10 s would end, and leaves no worker."""
    import psutil
    path = experiment(tmp_path, schedule={"name": "1f1b", "stages": 8, "microbatches": 60000},
                      sweep={"seed": list(range(6))})
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipescope.experiments.cli", "sweep", path, "--out",
                             str(tmp_path / "out"), "--workers", "2", "--chunk-size", "1"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(4)  # the pool started, both workers well inside their first run
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    second = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Ctrl-C again to stop them unlogged" in err, err[-2000:]
    assert time.monotonic() - second < 4
    time.sleep(1)
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline", "create_time"])
            if p.info["create_time"] >= started and "multiprocessing" in " ".join(p.info["cmdline"] or [])]
    assert left == []


def _lines(out: Path) -> list[bytes]:
    path = out / "runs.jsonl"
    return [line for line in path.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")] \
        if path.exists() else []


def test_cli_sweep_writes_parquet_csv_and_keeps_failing_runs(cli, tmp_path) -> None:
    """A run that fails (2bw needs m >= p) is a row with its error and the others still run; exit 1 says some
    failed. The tables have the documented columns, and the summary counts both."""
    path = experiment(tmp_path, sweep={"schedule.name": ["1f1b", "2bw"], "schedule.stages": [2, 8]})
    code, out, err = cli(["sweep", path, "--out", str(tmp_path / "out"), "--workers", "2"])
    assert code == 1, err
    assert "4 runs (4 combinations): 4 run now, 0 already logged, 3 ok, 1 error, 0 lost" in out
    frame = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert set(COLUMNS) <= set(frame.columns)
    failed = frame[frame["status"] == "error"]
    assert list(failed["schedule.name"]) == ["2bw"] and list(failed["schedule.stages"]) == [8]
    assert "schedule.microbatches" in failed["error"].iloc[0] and "2bw" in failed["error"].iloc[0]
    assert failed["iteration_time_s"].isna().all()
    csv = pd.read_csv(tmp_path / "out" / "results.csv")
    assert list(csv.columns) == list(frame.columns) and len(csv) == 4
    ok = frame[frame["status"] == "ok"].set_index(["schedule.name", "schedule.stages"])
    assert ok.loc[("1f1b", 2), "iteration_time_s"] == pytest.approx(5 * 3e-3)  # (m + p - 1)(F + I + W) / p stages


@pytest.mark.parametrize("order", ["section first", "key first"])
def test_a_key_inside_a_swept_section_that_its_values_leave_unset_applies_to_each(tmp_path, order: str) -> None:
    """`cluster: [...]` beside `cluster.nodes: [...]`: 2 x 2 runs whatever the order of the keys (the section is
    applied first); a key the section's values also set is refused (test_bad_grid_fails_before_any_run)."""
    grid = {"cluster": [{"topology": "dgx-h100"}, {"topology": "dgx-a100"}], "cluster.nodes": [1, 2]}
    plan = expand(experiment(tmp_path, sweep=grid if order == "section first" else dict(reversed(grid.items()))))
    assert sorted((r.config.cluster.topology, r.config.cluster.nodes) for r in plan.runs) == [
        ("dgx-a100", 1), ("dgx-a100", 2), ("dgx-h100", 1), ("dgx-h100", 2)]


@pytest.mark.parametrize(("grid", "named"), [
    ({"sweep": {"schedule.stagez": [2, 4]}}, "schedule.stagez: unknown key"),
    ({"sweep": {"schedule.stages": [2, 4, 0]}}, "schedule.stages: got 0"),
    ({"sweep": {"model.preset": ["gpt-1.3b", "gpt-9"]}}, "model.preset: got 'gpt-9'"),
    ({"sweep": {"schedule.name": ["1f1b", "zbv"]}}, "schedule.name: got 'zbv'"),
    ({"sweep": {"schedule.stages": 4}}, "sweep.schedule.stages: got 4, expected a non-empty list"),
    ({"sweep": None}, "sweep: is empty, expected a mapping of dotted keys to lists"),  # a grid left empty
    ({"sweep": {"schedule.stages": [1, 2], "schedule": [{"stages": 3}]}},
     "sweep.schedule.stages: also set by a value of sweep.schedule, expected each config key in one place"),  # 3 won
    ({"sweep": {"seed": [1, 2]}, "zip": {"seed": [1, 2]}}, "zip.seed: also in sweep"),
    ({"iterations": 4, "sweep": {"schedule.name": ["2bw", "1f1b"]}},
     "iterations: got 4, expected none: 1f1b has a flush"),
    ({"zip": {"schedule.stages": [2, 4], "seed": [1]}}, "zip: lists of different lengths"),
    ({"sweep": {"seed": list(range(1000)), "schedule.microbatches": list(range(1, 102))}},
     "sweep: 1000 x 101 = 101,000 runs, expected at most 100,000"),
], ids=["key", "value", "preset", "schedule", "not-a-list", "empty-grid", "section-and-key", "sweep-and-zip",
        "iterations", "zip-lengths", "too-many"])
def test_bad_grid_fails_before_any_run(cli, tmp_path, grid: dict, named: str) -> None:
    """A bad key or value anywhere in the grid (the last run's included) is one line naming it, exit 2, and nothing
    ran: no runs.jsonl."""
    code, out, err = cli(["sweep", experiment(tmp_path, **grid), "--out", str(tmp_path / "out")])
    assert code == 2
    assert named in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "runs.jsonl").exists()


@pytest.mark.parametrize(("flags", "named"), [
    (["--workers", "0"], "--workers: got '0'"),
    (["--chunk-size", "x"], "--chunk-size: got 'x'"),
    (["--dask", "http://evil:80"], "--dask: got 'http://evil:80', expected local or tcp://HOST:PORT"),
    (["--dask", "tcp://10.0.0.1:8786", "--workers", "2"], "--workers: got 2 with --dask"),
])
def test_bad_flags_are_one_line_errors(cli, tmp_path, flags: list[str], named: str) -> None:
    """Flags are checked before the grid and before any connection: one line, exit 2."""
    code, _, err = cli(["sweep", experiment(tmp_path), "--out", str(tmp_path / "out"), *flags])
    assert code == 2 and named in err and err.count("\n") == 1


def test_an_error_without_a_message_is_still_an_error_row() -> None:
    """An exception that says nothing made an ok row with error "" (and, now that rows are checked, a damaged one
    that ran again forever): its type stands in for the message."""
    assert sweep.one_line(RuntimeError()) == "RuntimeError" and sweep.one_line(ValueError("  ")) == "ValueError"
    row = sweep._row("id", {}, None, sweep.one_line(KeyError()), 0.1)
    assert (row["status"], row["error"]) == ("error", "KeyError")


def test_a_from_hf_runs_row_names_its_architecture(tmp_path) -> None:
    """The table left model.family, kv_heads and ffn_hidden empty for a from_hf run: with no preset, a reader could
    not tell the model apart from a GPT of the same shape."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 1024,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 2816,
                                  "vocab_size": 32000, "max_position_embeddings": 2048, "hidden_act": "silu",
                                  "tie_word_embeddings": False}))
    plan = expand({"model": {"from_hf": str(config)}, "schedule": {"stages": 2},
                   "sweep": {"schedule.microbatches": [4]}})
    row = sweep._run_row(plan.runs[0])
    assert row["status"] == "ok", row["error"]
    assert (row["model.family"], row["model.kv_heads"], row["model.ffn_hidden"], row["model.seq"]) == (
        "llama", 2, 2816, 2048)
