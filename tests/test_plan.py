"""The planner (docs/planner.md): bounds that hold, the exhaustive answer, the memory cap, the CLI."""

import itertools
import json

import numpy as np
import pytest

import pipescope
from pipescope.config import ConfigError
from pipescope.experiments.plan import _allreduce_floor, _timed_reduction_floor, plan, screen
from pipescope.experiments.plan_space import (PLAN_KEYS, RECOMPUTE, Candidate, PlanRequest, base_config, candidates,
                                              check_request)
from pipescope.experiments.sweep import dask_executor
from pipescope.runner import prepare
from pipescope.simulator.simulate import simulate
from pipescope.simulator.bounds import AloneTransfers, busy_per_iteration_ns, memory_lower_bounds

SMALL = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, None, {"model": {"layers": 8}}), 16,
                    schedules=("1f1b", "gpipe", "2bw", "zb-h1", "interleaved"), microbatch_sizes=(1, 2, 4),
                    tensor=(1, 2), top=3)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "2bw", "pipedream", "zb-h1", "zb-v", "v-half", "interleaved"])
def test_bounds_hold_against_simulation(name: str) -> None:
    """The busiest device's compute never exceeds the simulated iteration time, and the order-only stash never
    exceeds a device's simulated peak (with data parallelism and recompute too)."""
    for p, m, dp, recompute in itertools.product([2, 4], [8], [1, 2], ["none", "selective", "full"]):
        config = pipescope.load_config(raw={
            "schedule": {"name": name, "stages": p, "microbatches": m, "recompute": recompute},
            "model": {"preset": "gpt-355m", "microbatch_size": 2, "attention": "eager"},
            "cluster": {"topology": "dgx-a100", "nodes": 2, "data_parallel": dp},
            "parallel": {"tensor": 2, "sequence": dp > 1}})
        built = prepare(config)
        costs = built.stage_costs()
        result = pipescope.run(config)
        assert max(busy_per_iteration_ns(built.schedule, costs)) <= result.iteration_time_s * 1e9 + 1
        assert _allreduce_floor(built, costs) <= result.iteration_time_s * 1e9 + 1
        if name not in ("2bw", "pipedream"):  # a flush schedule runs no faster than plan.refine's replay says
            assert _refined_floor(built) <= result.iteration_time_s * 1e9 + 1
        buffers = 2 if name == "2bw" and dp > 1 else 1  # 2BW with replicas keeps a second gradient buffer
        bounds = memory_lower_bounds(built.schedule, costs, built.config.model.precision, gradient_buffers=buffers,
                                     overhead_bytes=built.overheads.total)
        peaks = [row["peak_memory_bytes"] for row in result.summary()["per_device"]]
        assert all(b <= peak for b, peak in zip(bounds, peaks))
        assert all(b >= 0.9 * peak for b, peak in zip(bounds, peaks))  # and close: only p2p buffers are left out


def _refined_floor(built) -> int:
    """``plan.refine``'s floor: one replica with each transfer alone, and the reductions timed by their start."""
    network = built.network()
    replay = simulate(built.schedule, built.costs, AloneTransfers(network))
    return max(replay.makespan_ns, _timed_reduction_floor(built, replay, network))


@pytest.mark.parametrize("name, stages, tensor, zero", [("1f1b", 16, 1, 0), ("interleaved", 4, 2, 0),
                                                       ("zb-h1", 4, 1, 1), ("gpipe", 8, 1, 0), ("zb-v", 4, 2, 0)])
def test_the_refined_floor_holds_and_is_close_where_the_reductions_bind(name: str, stages: int, tensor: int,
                                                                         zero: int) -> None:
    """On 8 p3.16xlarge (one 25 Gbit/s NIC per 8 V100s), replicas of GPT 2.2B whose gradient reductions cross the
    shared NIC: the floor of ``plan.refine`` (each reduction's bytes through its group and into each server, from
    when its stage's last weight-gradient op may start) stays under the simulated iteration, and within 10% of it
    (the busy time and the all-reduce's bytes alone were up to 1.4 times under)."""
    width = 64 // (stages * tensor)
    config = pipescope.load_config(raw={
        "schedule": {"name": name, "stages": stages, "microbatches": 16},
        "model": {"preset": "gpt-2.2b", "microbatch_size": 1},
        "cluster": {"topology": "p3.16xlarge", "nodes": 8, "data_parallel": width},
        "parallel": {"tensor": tensor, "zero": zero}})
    built = prepare(config)
    simulated = pipescope.run(config).iteration_time_s * 1e9
    floor = _refined_floor(built)
    assert 0.9 * simulated <= floor <= simulated + 1


def test_allreduce_floor_binds_on_a_slow_network() -> None:
    """On 8 p3.16xlarge (one 25 Gbit/s NIC per 8 V100s) with 8 replicas of a 2-stage GPT 2.2B, the all-reduce
    floor is above the compute bound, and the simulated 2BW iteration respects it."""
    config = pipescope.load_config(raw={
        "schedule": {"name": "2bw", "stages": 8, "microbatches": 8},
        "model": {"preset": "gpt-2.2b", "microbatch_size": 1, "precision": "fp16"},
        "cluster": {"topology": "p3.16xlarge", "nodes": 8, "data_parallel": 8}})
    built = prepare(config)
    costs = built.stage_costs()
    floor, busiest = _allreduce_floor(built, costs), max(busy_per_iteration_ns(built.schedule, costs))
    assert floor > busiest
    assert pipescope.run(config).iteration_time_s * 1e9 >= floor


def test_a_flush_schedules_floor_counts_every_group_through_a_shared_nic() -> None:
    """8 replicas of a 2-stage, t = 4 GPT 2.2B on 8 p3.16xlarge: each server's one NIC takes both stages' gradient
    shards, 4 lanes each. The floor counts them together (the server floor) and the simulation respects it: a flush
    schedule's one iteration holds them all, and 2BW's 3-iteration run is at least its busiest link's bytes over its
    rate per iteration (before that floor, its run ended before the NIC's backlog bound and came out below the
    server floor)."""
    from pipescope.experiments.plan import _server_floor

    def floors(name: str) -> tuple[int, int, float]:
        config = pipescope.load_config(raw={
            "schedule": {"name": name, "stages": 2, "microbatches": 8},
            "model": {"preset": "gpt-2.2b", "microbatch_size": 1, "precision": "fp16"},
            "cluster": {"topology": "p3.16xlarge", "nodes": 8, "data_parallel": 8}, "parallel": {"tensor": 4}})
        built = prepare(config)
        costs = built.stage_costs()
        return (_allreduce_floor(built, costs), _server_floor(built, costs, built.network()),
                pipescope.run(config).iteration_time_s * 1e9)

    from pipescope.experiments import plan as plan_module
    plan_module._RATES.clear()  # rates are cached per worker: t = 1 must not reuse t = 4's
    t1 = pipescope.load_config(raw={"schedule": {"name": "2bw", "stages": 8, "microbatches": 8},
                                    "model": {"preset": "gpt-2.2b", "microbatch_size": 1, "precision": "fp16"},
                                    "cluster": {"topology": "p3.16xlarge", "nodes": 8, "data_parallel": 8}})
    alone = _allreduce_floor(prepare(t1), prepare(t1).stage_costs())
    floors("2bw")  # t = 4 measured after t = 1 ...
    plan_module._RATES.clear()
    floors("2bw")  # ... and before it
    assert _allreduce_floor(prepare(t1), prepare(t1).stage_costs()) == alone
    floor, server, simulated = floors("1f1b")
    assert floor == server <= simulated
    floor, server, simulated = floors("2bw")
    assert floor == server <= simulated


def _exhaustive(request: PlanRequest) -> list[tuple[float, int, tuple]]:
    """Every candidate that runs and fits, simulated one by one in this process: (throughput, peak, key)."""
    out = []
    for candidate in candidates(request, 8):
        screened = screen(request, candidate)
        if screened.run is None:
            continue
        result = pipescope.run(screened.run.config)
        if not result.oom:
            out.append((result.throughput_samples_per_s, result.peak_memory_bytes,
                        tuple(candidate.as_dict().values())))
    return sorted(out, key=lambda row: (-row[0], row[1]))


def test_planner_finds_the_exhaustive_best() -> None:
    """Its ranked top 3 are an exhaustive simulation's top 3 (same throughputs; ties ranked by memory), and it
    simulated fewer candidates than exist."""
    report = plan(SMALL, workers=2, progress=False)
    every = _exhaustive(SMALL)
    assert [r["throughput_samples_per_s"] for r in report.ranked[:3]] == pytest.approx([t for t, _, _ in every[:3]])
    assert tuple(report.best[k] for k in PLAN_KEYS) == every[0][2]
    assert report.simulated < report.candidates
    assert len(report.ranked) + len(report.rejected) == report.candidates


def test_a_tighter_cap_moves_the_plan_to_less_memory() -> None:
    """The best plan fits its cap; under a cap below that plan's peak the planner picks another that fits, with
    recompute, a smaller microbatch or a deeper pipeline."""
    request = PlanRequest(base_config("gpt-1.3b", "dgx-h100", 1, None), 32, schedules=("1f1b", "gpipe"),
                          microbatch_sizes=(1, 2, 4, 8), tensor=(1,), top=1)
    loose = plan(request, workers=2, progress=False).best
    cap = int(loose["peak_memory_bytes"] * 0.6)
    tight = plan(PlanRequest(base_config("gpt-1.3b", "dgx-h100", 1, cap), 32, schedules=("1f1b", "gpipe"),
                             microbatch_sizes=(1, 2, 4, 8), tensor=(1,), top=1), workers=2, progress=False).best
    assert tight["peak_memory_bytes"] <= cap < loose["peak_memory_bytes"]
    saves = RECOMPUTE.index(tight["recompute"]) > RECOMPUTE.index(loose["recompute"])
    assert saves or tight["microbatch_size"] < loose["microbatch_size"] or tight["depth"] > loose["depth"]


def test_tensor_parallelism_is_searched() -> None:
    """With tensor widths on offer, candidates at t = 2 and 4 (with and without sequence parallelism) are screened,
    a t that does not divide the heads (12 here) is rejected with the parallel key's reason, and under a cap too
    small for any t = 1 plan the best plan splits the layers."""
    request = PlanRequest(base_config("gpt-3.8b", "dgx-a100", 1, 24 << 30, {"model": {"heads": 12}}), 8,
                          schedules=("1f1b",), microbatch_sizes=(1,), recompute=("none",), tensor=(1, 2, 4, 8), top=1)
    report = plan(request, workers=2, progress=False)
    assert report.best is not None and report.best["tensor"] > 1
    assert {(r["tensor"], r["sequence"]) for r in report.rejected + report.ranked} >= {(2, True), (4, False)}
    assert any(r["tensor"] == 8 and "parallel.tensor" in r["reason"] for r in report.rejected)


def test_depths_restrict_the_search() -> None:
    """``depths=(1,)`` plans tensor and data parallelism only: every candidate has depth 1."""
    request = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, None), 16, schedules=("1f1b",),
                          microbatch_sizes=(1, 2), depths=(1,), top=1)
    report = plan(request, workers=1, progress=False)
    assert {r["depth"] for r in report.ranked + report.rejected} == {1}
    assert {r["tensor"] for r in report.ranked + report.rejected} == {1, 2, 4, 8}



def test_without_pipelining_one_schedule_is_planned_and_gpipe_is_not_1f1b() -> None:
    """d = 1 is planned once: as 1F1B when it is named, else as the first schedule. GPipe's d = 1 run is not the
    same as 1F1B's: every forward comes first, so it stashes all m microbatches (docs/planner.md, "The search
    space"; the 2BW redo's "best GPipe plan" for GPT 2.2B is such a run)."""
    both = PlanRequest(SMALL.base, 16, schedules=("gpipe", "1f1b"), microbatch_sizes=(1,), tensor=(1,),
                       recompute=("none",), depths=(1,))
    assert [c.schedule for c in candidates(both, 8)] == ["1f1b"]
    alone = PlanRequest(SMALL.base, 16, schedules=("gpipe",), microbatch_sizes=(1,), tensor=(1,),
                        recompute=("none",), depths=(1,))
    assert [c.schedule for c in candidates(alone, 8)] == ["gpipe"]
    gpipe, flush = (screen(alone, Candidate(name, 1, 8, 1, 1, "none")) for name in ("gpipe", "1f1b"))
    assert gpipe.reason is None and flush.reason is None  # m = 16 / 8 = 2 microbatches per replica
    assert gpipe.memory_bound_bytes > flush.memory_bound_bytes

def test_rejections_name_their_reason() -> None:
    """OOM names the device and the bytes; an indivisible batch and a schedule's own constraint are one line."""
    report = plan(PlanRequest(base_config("gpt-1.3b", "dgx-h100", 1, 8 << 30), 8, schedules=("gpipe", "2bw"),
                              microbatch_sizes=(2, 32), top=1), workers=2, progress=False)
    reasons = [r["reason"] for r in report.rejected]
    assert any(r.startswith("OOM on device") and "bytes" in r for r in reasons)
    assert any("not divisible by width x microbatch size" in r for r in reasons)
    assert any("expected at least schedule.stages" in r for r in reasons)
    assert all("\n" not in r for r in reasons)


def test_dask_and_the_process_pool_agree() -> None:
    """The same plan on a Dask LocalCluster (the sweep's executor path) as on the process pool, rejections in the
    same order (the candidates', not the workers' finishing order)."""
    with dask_executor("local", workers=2) as (executor, threads):
        on_dask = plan(SMALL, executor, threads, progress=False)
    on_pool = plan(SMALL, workers=2, progress=False)
    assert on_dask.ranked == on_pool.ranked
    assert on_dask.rejected == on_pool.rejected


def test_cli_json_and_errors(cli) -> None:
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16",
                        "--schedules", "1f1b,2bw", "--microbatch-sizes", "1,2", "--memory-cap", "40GiB",
                        "--tensor", "1", "--workers", "2", "--no-progress", "--json", "--top", "2"])
    assert code == 0
    data = json.loads(out)
    assert set(data["best"]) >= {"schedule", "tensor", "width", "depth", "microbatch_size", "recompute"}
    assert data["best"]["peak_memory_bytes"] <= 40 << 30
    assert len(data["ranked"]) >= 2 and all("reason" in r for r in data["rejected"])
    for flags, key in [(["--global-batch", "0"], "--global-batch"), (["--global-batch", "8", "--schedules", "nope"],
                       "--schedules"), (["--global-batch", "8", "--recompute", "half"], "--recompute"),
                       (["--global-batch", "8", "--memory-cap", "lots"], "--memory-cap"),
                       (["--global-batch", "8", "--set", "cluster.fabric=mesh"], "cluster.fabric"),
                       (["--global-batch", "8", "--set", "schedule.stages=4"],
                        "--set: schedule.stages is what the planner searches, expected --depths instead"),
                       (["--global-batch", "8", "--set", "model.preset=gpt-355m"], "expected --model instead"),
                       (["--global-batch", "8", "--schedules", "1f1b,csv:x.csv"], "--schedules: got 'csv:x.csv', "
                        "expected generator names (a csv: or torch: schedule has its size fixed"),
                       (["--global-batch", "8", "--memory-cap", "16"], "--memory-cap: got 16 B, expected a size from "
                        "1.00 MiB"),
                       (["--global-batch", "8", "--memory-cap", "2PiB"], "--memory-cap: got 2.00 PiB, expected a size "
                        "from 1.00 MiB to 1.00 PiB"),
                       (["--global-batch", "8", "--schedules", "1f1b,,gpipe"], "--schedules: got '1f1b,,gpipe', "
                        "expected a comma-separated list without empty items"),
                       (["--global-batch", "8", "--set", "costs.kind=uniform"], "costs.kind: got uniform, expected "
                        "analytic or profile")]:
        code, out, err = cli(["plan", "--no-progress", *flags])
        assert code == 2 and err.count("\n") == 1 and key in err


def test_a_winner_without_a_flush_says_what_it_changes_in_training(cli) -> None:
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16",
                        "--schedules", "2bw", "--microbatch-sizes", "2", "--tensor", "1", "--depths", "2",
                        "--workers", "1", "--no-progress"])
    assert code == 0 and "\nbest: 2bw," in out
    assert "\nnote: 2bw updates the weights with a one-step delay" in out and "steady state" in out


def test_nothing_fits_is_a_finding(cli) -> None:
    code, out, _ = cli(["plan", "--model", "gpt-3.8b", "--topology", "dgx-a100", "--global-batch", "8",
                        "--memory-cap", "1GiB", "--schedules", "1f1b", "--workers", "1", "--no-progress"])
    assert code == 1 and "nothing fits" in out and "OOM" in out
    examples = [line for line in out.splitlines() if line.startswith("rejected ")]
    assert examples and all(" sp=off " in line or " sp=on " in line for line in examples)  # never left to absence


@pytest.mark.parametrize("flags", [
    # the search for what would fit tries ZeRO-3, which 2BW does not run: that search's refusal is not the user's
    ["--model", "gpt-1.3b", "--schedules", "2bw", "--memory-cap", "1GiB"],
    # ZeRO-3 needs replicas, and tensor 8 on 8 GPUs leaves one: not a --vocab error
    ["--model", "gpt-3.8b", "--schedules", "1f1b", "--tensor", "8", "--vocab", "naive", "--memory-cap", "2GiB"],
])
def test_nothing_fits_names_no_flag_the_user_did_not_pass(cli, flags: list[str]) -> None:
    code, out, err = cli(["plan", "--global-batch", "16", "--tensor", "1", "--microbatch-sizes", "1", "--recompute",
                          "full", "--workers", "1", "--no-progress", *flags])
    assert code == 1 and "nothing fits" in out and "error" not in err, err


def test_bad_request_is_a_config_error_naming_the_field() -> None:
    """From Python the field, not the flag (the command maps one to the other: test_bad_flags_are_one_line_errors)."""
    with pytest.raises(ConfigError, match="^top: got 0, expected a positive integer$"):
        plan(PlanRequest(SMALL.base, 16, top=0), workers=1, progress=False)
    with pytest.raises(ConfigError, match=r"^tensor: got 3, expected a width that divides the 8 GPUs$"):
        plan(PlanRequest(SMALL.base, 16, tensor=(3,)), workers=1, progress=False)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"global_batch": "16"}, "global_batch: got '16' (str), expected a positive integer"),
    ({"global_batch": 16.5}, "global_batch: got 16.5 (float), expected a positive integer"),
    ({"global_batch": True}, "global_batch: got True (bool), expected a positive integer"),
    ({"schedules": "1f1b"}, "schedules: got '1f1b', expected a tuple of schedule names"),  # not '1', 'f', ...
    ({"tensor": (1, 2.0)}, "tensor: got (1, 2.0), expected a tuple of positive integers"),
    ({"sequence": (0,)}, "sequence: got (0,), expected a tuple of booleans"),
    ({"base": ["model"]}, "base: got ['model'], expected a mapping of config sections"),
])
def test_a_request_built_in_python_with_a_wrong_type_names_the_field(fields: dict, expected: str) -> None:
    """From Python nothing converted the values: a wrong type is a ConfigError naming the field, not a TypeError
    deep in the planner or a plan of nothing."""
    request = PlanRequest(**{"base": SMALL.base, "global_batch": 16, **fields})
    with pytest.raises(ConfigError) as err:
        plan(request, workers=1, progress=False)
    assert str(err.value) == expected
    check_request(PlanRequest(SMALL.base, np.int64(16), tensor=(np.int64(1),)))  # numpy's integers are integers


def test_every_key_the_planner_sets_is_refused_with_set() -> None:
    """plan_cmd.SEARCHED_BY names a flag for each key a candidate sets or the flags write, no more and no fewer: a key
    added to either without a flag would be overridden silently again."""
    from pipescope.experiments.plan_cmd import SEARCHED_BY
    candidate = Candidate("1f1b", tensor=2, width=2, depth=2, microbatch_size=1, recompute="none", sequence=True)
    flags = base_config("gpt-355m", "dgx-h100", 1, 1 << 30)
    written = {f"{section}.{key}" for section, keys in flags.items() for key in keys}
    assert set(SEARCHED_BY) == set(candidate.overrides(8)) | written


@pytest.mark.parametrize(("flags", "expected"), [
    (["--tensor", "3"], "--tensor: got 3, expected a width that divides the 8 GPUs"),
    (["--tensor", "2", "--depths", "8"], "--depths: got 8, expected some of 1,2,4 (the depths that use all 8 "
                                         "GPUs at tensor width 2)"),
    (["--depths", "2", "--vocab", "vocab-1", "--schedules", "zb-h1"], "--vocab: got vocab-1, expected a method "
                                                                        "these schedules and widths run"),
    # every depth: the pure data-parallel points alone are not the space that was asked for
    (["--vocab", "vocab-2", "--schedules", "gpipe"], "--vocab: got vocab-2, expected a method these schedules "
                                                     "and widths run (schedule.vocab: vocab-2 is defined with "
                                                     "schedule.name 1f1b or v-half, got schedule.name 'gpipe')"),
    (["--vocab", "interlaced", "--schedules", "v-half"], "--vocab: got interlaced, expected a method these "
                                                         "schedules and widths run (schedule.vocab: interlaced is "
                                                         "defined with schedule.name 1f1b"),
    (["--vocab", "vocab-2", "--schedules", "gpipe,1f1b", "--tensor", "2"],  # 1f1b runs it: the width is at fault
     "--vocab: got vocab-2, expected a method these schedules and widths run (the sharded methods run without "
     "tensor parallelism only)"),
    # sharding and offload need a flush and replicas: the flag that left no pipeline is named, not --vocab
    (["--schedules", "pipedream", "--zero", "1"], "--zero: got 1, expected a setting these schedules and widths"),
    (["--schedules", "1f1b", "--offload", "parameters"], "--offload: got parameters, expected a setting these"),
    # two flags naming the model: neither is dropped silently
    (["--model", "gpt-355m", "--set", "model.from_hf=x.json"], "--model: got 'gpt-355m' beside --set model.from_hf"),
    # a context degree that does not divide the GPUs is the context's fault, not the tensor width's
    (["--context", "3", "--model", "llama3-8b"], "--context: got 3, expected a degree that divides the 8 GPUs"),
    # every candidate refused by the config, none for memory: that reason, not where more memory would help
    (["--schedules", "1f1b", "--context", "2", "--set", "model.attention=eager", "--vocab", "naive"],
     "parallel.context: got 2 with model.attention eager, expected flash"),
])
def test_a_space_with_no_candidate_names_the_flag(cli, flags: list[str], expected: str) -> None:
    """A search space that leaves no candidate on the cluster is a usage error naming the flag, not a plan of
    nothing that says nothing fits and gives no reason."""
    code, out, err = cli(["plan", "--global-batch", "64", "--no-progress", *flags])
    assert (code, out) == (2, "") and err.startswith(f"pipescope: error: {expected}") and err.count("\n") == 1


def test_sigterm_stops_a_plan_as_ctrl_c_and_leaves_no_worker() -> None:
    """`kill PID` on a plan: exit 130 and its pool's workers stopped (they were left running, parented to init)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipescope.experiments.cli", "plan", "--model", "gpt-1.3b",
                             "--topology", "dgx-a100", "--nodes", "4", "--global-batch", "512", "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(psutil.Process(proc.pid).children(recursive=True)) < 3:
            time.sleep(0.05)  # the forkserver and its two workers: the pool is working
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130

    def left() -> list:
        return [p.info["cmdline"] for p in psutil.process_iter(["cmdline", "create_time"])
                if p.info["create_time"] >= started and "multiprocessing" in " ".join(p.info["cmdline"] or [])]
    deadline = time.monotonic() + 15  # stopped workers take a moment to go on a loaded machine; left running, never
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


def test_a_parallel_setting_from_the_config_that_every_plan_runs_with_is_said(cli) -> None:
    """--set parallel.zero=3 applies to every candidate, whose rows say zero null (not searched): the plan names it
    once, in the text and in --json."""
    flags = ["plan", "--global-batch", "16", "--set", "parallel.zero=3", "--schedules", "1f1b", "--tensor", "1",
             "--microbatch-sizes", "1", "--recompute", "none", "--depths", "4", "--workers", "1", "--no-progress"]
    code, out, _ = cli(flags)
    assert code == 0 and "every plan runs with, from the config: parallel.zero=3" in out
    code, out, _ = cli([*flags, "--json"])
    assert code == 0 and json.loads(out)["config_fixed"] == {"parallel.zero": 3}
    # stage 3's own choices are said too, as --set writes them, where they are not their defaults
    code, out, _ = cli([*flags, "--set", "parallel.reshard_after_forward=false"])
    assert code == 0 and ("every plan runs with, from the config: parallel.zero=3, parallel.reshard_after_forward="
                          "false") in out


def test_the_ranked_table_keeps_a_space_between_wide_values() -> None:
    """Microbatch 32 beside m = 32768 printed '3232768', and an MFU ran into a 203418.500 s iteration."""
    from pipescope.experiments.plan_cmd import _ranked_table

    row = {"schedule": "1f1b", "tensor": 8, "sequence": True, "width": 1, "depth": 1, "microbatch_size": 32,
           "microbatches": 32768, "recompute": "full", "vocab": "naive", "throughput_samples_per_s": 5.2,
           "tokens_per_s": 42_200.0, "tflops_per_gpu": 305.7, "mfu": 0.309, "iteration_time_s": 203418.5,
           "peak_memory_bytes": 54 << 30, "bubble_rate": 0.0}
    head, line = _ranked_table([row]).splitlines()
    assert line.split() == ["1", "1f1b", "8", "yes", "1", "1", "32", "32768", "full", "naive", "5.2", "42.2", "k",
                            "305.7", "30.9%", "56.505", "h", "54.00", "0.0%"]
    assert head.split()[:9] == ["#", "schedule", "t", "sp", "w", "d", "mb", "m", "recompute"]
    assert line.index(" 32768 ") + 6 == head.index(" m ") + 2  # right-aligned under its title
