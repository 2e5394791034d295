"""The real executor: the lowered program run over torch.distributed (gloo, one thread per rank), with its optimizer
step, weight versions, data parallelism and measured memory. Launches cost 3-5 s, so the 2-rank specs share one
launch (a module fixture) and the 4-rank ones another."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from pipescope.executor.run import RunError, RunSpec, execute_all, reference_step  # noqa: E402
from pipescope.executor.state import batch, build_modules, stage_modules  # noqa: E402
from pipescope.calibration.memory import saved_tensor_bytes  # noqa: E402
from pipescope.calibration.presets import Shape  # noqa: E402
from pipescope.simulator.ir import ActionKind  # noqa: E402
from pipescope.simulator.schedules import build  # noqa: E402

SHAPE = Shape("test", layers=4, hidden=32, heads=2, seq=16, vocab=64)
FLUSH = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("v-half", 2),
         ("dualpipev", 2))
COMPUTE = {k.value for k in (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B)}


def _spec(name: str, m: int = 4, chunks: int | None = None, **options) -> RunSpec:
    iterations = options.pop("schedule_iterations", None)
    recompute = options.pop("recompute", False)
    schedule = build(name, 2, m, chunks=chunks, recompute=recompute,
                     **({"iterations": iterations} if iterations else {}))
    return RunSpec(schedule, SHAPE, microbatch_size=2, seed=3, **options)


TWO_RANKS = {
    **{name: _spec(name, chunks=chunks, iterations=2, clip_norm=0.5) for name, chunks in FLUSH},
    "uneven": _spec("1f1b", layers_per_stage=(1, 3), iterations=2),
    "sgd": _spec("1f1b", optimizer="sgd", lr=0.5, clip_norm=0.05),
    "2bw": _spec("2bw", m=2, schedule_iterations=3, optimizer="sgd", lr=0.5, clip_norm=None, iterations=2),
    "pipedream": _spec("pipedream", m=2, schedule_iterations=2, iterations=2),
    # recompute: fused B, I/W split, and a V whose turn hands the output to a stage on the same rank
    **{f"{name} recompute": _spec(name, chunks=chunks, iterations=2, recompute=True)
       for name, chunks in (("gpipe", 1), ("zb-h1", 1), ("zb-v", 2))},
}


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """Every 2-rank spec, run in one launch: name -> (spec, result, one-process reference)."""
    results = execute_all(list(TWO_RANKS.values()))
    return {name: (spec, result, reference_step(spec)) for (name, spec), result in zip(TWO_RANKS.items(), results)}


def _assert_matches(result, reference, name: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert result.losses == pytest.approx(reference.losses, rel=rtol), name
    assert set(result.grads) == set(reference.grads) == set(result.weights[0]), name
    for key, grad in reference.grads.items():
        torch.testing.assert_close(result.grads[key], grad, rtol=rtol, atol=atol, msg=f"{name} grad {key}")
    for key, weight in reference.weights.items():
        torch.testing.assert_close(result.weights[0][key], weight, rtol=rtol, atol=atol, msg=f"{name} weight {key}")


@pytest.mark.parametrize("name", [name for name, _ in FLUSH] + ["uneven"])
def test_flush_schedules_train_as_one_process_and_time_one_optimizer_row_per_stage(two_ranks, name):
    """Two AdamW steps with the gradient norm clipped over the pipeline: every loss, the last gradients and the final
    weights are those of one process on the same batch."""
    spec, result, reference = two_ranks[name]
    assert len(reference.losses) == 2 and reference.losses[1] < reference.losses[0]
    _assert_matches(result, reference, name)
    for device, rows in enumerate(result.rows[-1]):
        program = [a for a in spec.schedule.device_actions[device] if a is not None]
        assert [r[0] for r in rows if r[1] in COMPUTE] == [str(a) for a in program]  # the schedule's compute order
        stages = sorted(s for s, d in enumerate(spec.schedule.stage_to_device) if d == device)
        assert [r[0] for r in rows if r[1] == "OPT"] == [f"{s}OPT3" for s in stages]  # named by the last microbatch
        assert rows[-len(stages):] == [r for r in rows if r[1] == "OPT"]  # after the program
        assert all(r[4] <= r[5] for r in rows)


def test_sgd_step_is_the_weight_minus_lr_times_the_clipped_gradient(two_ranks):
    spec, result, _ = two_ranks["sgd"]
    initial = {f"{i}.{n}": p.detach() for i, m in build_modules(SHAPE, spec.seed).items() for n, p in
               m.named_parameters()}
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in result.grads.values())).item()
    scale = spec.clip_norm / (norm + 1e-6)
    assert scale < 1  # clipping acted
    for key, weight in initial.items():
        torch.testing.assert_close(result.weights[0][key], weight - spec.lr * scale * result.grads[key])


def test_2bw_follows_the_delayed_update_of_a_hand_written_recurrence(two_ranks):
    """W(t+1) = W(t) - lr * grad f_t(W(max(t-1, 0))), written out here in one process, over 2 runs of 3 iterations
    (the recurrence goes on across runs)."""
    spec, result, reference = two_ranks["2bw"]
    _assert_matches(result, reference, "2bw")
    m, k = spec.schedule.num_microbatches, spec.schedule.iterations
    modules = build_modules(SHAPE, spec.seed)
    names = [(i, n) for i, module in modules.items() for n, _ in module.named_parameters()]
    versions = [[p.detach().clone() for module in modules.values() for p in module.parameters()]]
    data = batch(SHAPE, spec.microbatch_size, k * m, spec.seed)
    for step in range(2 * k):
        used = [w.clone().requires_grad_() for w in versions[max(step - 1, 0)]]
        loss = sum(_loss(modules, names, used, *data[(step % k) * m + i]) for i in range(m)) / m
        grads = torch.autograd.grad(loss, used)
        versions.append([w - spec.lr * g for w, g in zip(versions[-1], grads)])
    for (i, n), weight in zip(names, versions[-1]):
        torch.testing.assert_close(result.weights[0][f"{i}.{n}"], weight, rtol=1e-5, atol=1e-6)
    assert [m.category_peaks["weights"] for m in result.memory] == [2 * _param_bytes(spec, d) for d in (0, 1)]


def _loss(modules, names, tensors, ids, targets):
    from torch.func import functional_call
    x = ids
    for index, module in modules.items():
        params = {n: t for (i, n), t in zip(names, tensors) if i == index}
        x = functional_call(module, params, (x, targets) if index == SHAPE.layers + 1 else (x,))
    return x


def test_pipedream_runs_each_backward_on_its_forwards_weights_and_holds_p_minus_r_versions(two_ranks):
    spec, result, reference = two_ranks["pipedream"]
    _assert_matches(result, reference, "pipedream")
    stashed = 0
    for seen in result.versions:
        forwards = {(s, mb): (v, writes) for kind, s, mb, v, _, writes in seen if kind == "F"}
        backwards = {(s, mb): (v, writes) for kind, s, mb, v, _, writes in seen if kind == "B"}
        assert backwards == forwards  # the same version id, and no write into that buffer in between
        stashed += sum(v < newest for kind, _, _, v, newest, _ in seen if kind == "B")
    assert stashed > 0  # some backward ran on an older version than the newest: the stash mattered
    assert [m.category_peaks["weights"] for m in result.memory] == [2 * _param_bytes(spec, 0), _param_bytes(spec, 1)]
    assert [r[0] for r in result.rows[-1][1] if r[1] == "OPT"] == [f"1OPT{j}" for j in range(4)]  # one per backward


def _param_bytes(spec: RunSpec, device: int) -> int:
    parts = stage_modules(SHAPE, spec.schedule.num_stages, spec.layers_per_stage)
    wanted = {i for s, d in enumerate(spec.schedule.stage_to_device) if d == device for i in parts[s]}
    return sum(p.numel() * 4 for m in build_modules(SHAPE, 0, wanted).values() for p in m.parameters())


def test_memory_is_tracked_exactly(two_ranks):
    """GPipe's last stage peaks after its last forward: weights, gradients, AdamW's two moments and step counters,
    and m microbatches of what autograd saves (counted here in one process) plus each loss."""
    spec, result, _ = two_ranks["gpipe"]
    parts = stage_modules(SHAPE, 2, None)
    modules = build_modules(SHAPE, spec.seed, set(parts[1]))
    params = [p for m in modules.values() for p in m.parameters()]
    x = torch.randn(2, SHAPE.seq, SHAPE.hidden, requires_grad=True)
    targets = torch.randint(SHAPE.vocab, (2, SHAPE.seq))

    def forward():
        y = x
        for index in parts[1]:
            y = modules[index](y, targets) if index == SHAPE.layers + 1 else modules[index](y)
        return y

    saved, _ = saved_tensor_bytes(forward, params)
    weights = sum(p.numel() * 4 for p in params)
    memory = result.memory[1]
    assert memory.peak_bytes == 4 * weights + 4 * len(params) + 4 * (saved + 4)
    assert (memory.at_peak["weights"], memory.at_peak["gradients"], memory.at_peak["optimizer"]) == (
        weights, weights, 2 * weights + 4 * len(params))
    assert memory.peak_category == "outputs" and memory.timeline[-1][1] == 4 * weights + 4 * len(params)
    assert two_ranks["sgd"][1].memory[1].category_peaks["optimizer"] == 0


@pytest.mark.parametrize("name", ["gpipe", "zb-h1", "zb-v"])
def test_recompute_trains_as_one_process_and_keeps_only_stage_inputs_between_forward_and_backward(two_ranks, name):
    """Under schedule.recompute a forward runs under no_grad and keeps its stage input; the backward (I, or B) runs
    the forward again with autograd first. Training is unchanged, and what a rank holds for its microbatches in
    flight is their inputs, plus one microbatch's saved tensors during its backward."""
    spec, result, reference = two_ranks[f"{name} recompute"]
    _assert_matches(result, reference, f"{name} recompute")
    plain = two_ranks[name][1]
    boundary = spec.microbatch_size * SHAPE.seq * SHAPE.hidden * 4
    for device, (memory, without) in enumerate(zip(result.memory, plain.memory)):
        assert memory.category_peaks["saved"] <= without.category_peaks["saved"], (name, device)
    # device 0 has several microbatches in flight (a last stage with one at a time saves as much either way)
    assert result.memory[0].category_peaks["saved"] < plain.memory[0].category_peaks["saved"], name
    if name == "gpipe":  # the last stage: m inputs held at once, at most one microbatch's saved tensors besides
        assert 4 * boundary <= result.memory[1].category_peaks["saved"] < 4 * boundary + \
            plain.memory[1].category_peaks["saved"] / 4
    for device, rows in enumerate(result.rows[-1]):
        program = [a for a in spec.schedule.device_actions[device] if a is not None]
        assert [r[0] for r in rows if r[1] in COMPUTE] == [str(a) for a in program]


def test_run_spec_refuses_bad_values_in_one_line():
    schedule = build("1f1b", 2, 4)
    for field, value, expected in (("optimizer", "adam", "one of adamw, sgd"), ("lr", 0.0, "positive finite"),
                                   ("clip_norm", -1.0, "None or a positive"), ("data_parallel", 0, "integer >= 1"),
                                   ("device", "tpu", "cpu or cuda")):
        with pytest.raises(ValueError, match=rf"^RunSpec.{field}: got .*, expected .*{expected}") as caught:
            execute_all([RunSpec(schedule, SHAPE, **{field: value})])
        assert "\n" not in str(caught.value)


def test_data_parallel_replicas_average_their_gradients_as_one_process_over_all_microbatches():
    """w = 2 replicas of a 2-device pipeline (4 ranks, rank r*2 + d): each takes its own microbatches, each stage's
    gradients are averaged over its replicas after its last backward, and training equals one process over all
    w*m microbatches; the replicas end with identical weights."""
    specs = [_spec("1f1b", data_parallel=2, optimizer="sgd", lr=0.5, clip_norm=0.05, iterations=2),
             _spec("zb-h1", data_parallel=2, iterations=2),
             _spec("2bw", m=2, schedule_iterations=2, data_parallel=2, optimizer="sgd", lr=0.5)]
    for spec, result, atol in zip(specs, execute_all(specs), (1e-6, 5e-5, 1e-6)):
        reference = reference_step(spec)
        _assert_matches(result, reference, spec.schedule.name, rtol=1e-4, atol=atol)
        for key, weight in result.weights[0].items():
            assert torch.equal(result.weights[1][key], weight)
        for rank, rows in enumerate(result.rows[-1]):
            reduced = [r for r in rows if r[1] == "ALL_REDUCE" and r[2] >= 0]  # -1: the clipping norm's
            stage = rank % 2
            m = spec.schedule.num_microbatches
            assert [r[0] for r in reduced] == [f"{stage}ALL_REDUCE{(k + 1) * m - 1}"
                                               for k in range(spec.schedule.iterations)]
            assert all(r[4] <= r[5] for r in reduced)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_is_the_allocators():
    """One rank on the GPU (nccl): the peak comes from torch.cuda.max_memory_allocated and holds at least the
    weights, gradients and AdamW state; training matches the CPU reference."""
    spec = RunSpec(build("1f1b", 1, 4), SHAPE, microbatch_size=2, seed=3, device="cuda")
    result = execute_all([spec])[0]
    weights = _param_bytes(spec, 0)
    assert result.memory[0].peak_category == "cuda allocator"
    assert result.memory[0].peak_bytes >= 4 * weights
    _assert_matches(result, reference_step(spec), "cuda", rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_validate_on_one_gpu_reports_every_stages_ops_against_the_profile(capsys):
    """``validate --device cuda``: calibrate tiny on the GPU, time zb-h1's stages on it, one row per stage and op."""
    import json

    from pipescope.experiments.cli import main
    assert main(["validate", "--device", "cuda", "--schedule", "zb-h1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(r["stage"], r["op"]) for r in report["stage_ops"]} == {(s, op) for s in (0, 1) for op in "FIW"} | {
        (0, "OPT"), (1, "OPT")}
    assert all(r["measured_ns"] > 0 and r["profile_ns"] > 0 for r in report["stage_ops"])


@pytest.mark.parametrize("fault, expected", [
    (("exit", 1, 3), r"^rank 1 died \(exit code 7\) at step 3, "),
    (("hang", 0, 2), r"^hung: no rank made progress for 3 s: rank 0 at step 2, .*; rank 1 at step "),
])
def test_a_dead_or_hung_rank_ends_the_run_with_one_line_and_no_process_left(fault, expected):
    before = set(_children())
    spec = RunSpec(build("1f1b", 2, 4), SHAPE, microbatch_size=2, timeout_s=3, inject=fault)
    with pytest.raises(RunError, match=expected) as caught:
        execute_all([spec])
    assert "\n" not in str(caught.value)
    assert set(_children()) <= before  # every rank was killed and reaped


def _children() -> list[int]:
    """PIDs whose parent is this process (from /proc: the ranks it spawned), but multiprocessing's resource
    tracker, which the first spawn starts and which lives as long as this process."""
    mine, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if (int(stat.read().rsplit(")", 1)[1].split()[1]) == mine
                            and b"resource_tracker" not in cmdline.read()):
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_validate_end_to_end_reports_finite_errors_and_an_overlay_gantt(tmp_path, capsys):
    """Calibrate tiny on this CPU, simulate 1F1B p=2 m=4 on the profile, run it for real, compare (a generous
    threshold: the point is the harness; docs/validation.md has the measured errors)."""
    import json
    import math

    from pipescope.experiments.cli import main
    gantt, timeline, trace = tmp_path / "overlay.png", tmp_path / "measured.csv", tmp_path / "measured.json.gz"
    code = main(["validate", "--model", "tiny", "--schedule", "1f1b", "--iterations", "2", "--warmup", "2",
                 # no --op-times: a CPU's default is the stages timed in the executor (asserted below)
                 "--json", "--gantt", str(gantt), "--timeline", str(timeline),
                 "--trace", str(trace), "--max-error", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    for key in ("predicted_iteration_time_s", "measured_iteration_time_s", "iteration_time_error",
                "op_duration_error_median", "op_start_error_median", "memory_error", "per_device"):
        assert key in report
    assert report["measured_iteration_time_s"] > 0 and math.isfinite(report["iteration_time_error"])
    assert abs(report["iteration_time_error"]) < 100 and len(report["per_device"]) == 2
    assert math.isfinite(report["memory_error"]) and abs(report["memory_error"]) < 1
    for device in report["per_device"]:
        assert device["measured_peak_memory_bytes"] > device["measured_static_memory_bytes"] > 0
        assert device["memory_error"] == pytest.approx(
            device["predicted_peak_memory_bytes"] / device["measured_peak_memory_bytes"] - 1)
    assert report["memory_error"] in [d["memory_error"] for d in report["per_device"]]
    phases = [line.split(":")[1].strip().split()[0] for line in err.splitlines() if "validate: warning: " not in line]
    assert phases == ["calibrate", "calibrate-comms", "time", "simulate", "run", "wrote", "wrote", "wrote"]
    assert err.splitlines()[-3:] == [f"pipescope validate: wrote timeline: {timeline}",
                                     f"pipescope validate: wrote trace: {trace}",
                                     f"pipescope validate: wrote gantt: {gantt}"]
    # 2 ranks on this machine's 2 cores: no warning but the ones a busy shared machine may earn (before the start,
    # or while calibrating)
    assert report["op_times"] == "stages"
    assert [w for w in report["warnings"] if not ("stayed noisy when calibrated" in w or "machine is busy" in w)] == []
    ops = {(row["stage"], row["op"]): row for row in report["stage_ops"]}
    assert set(ops) == {(s, op) for s in (0, 1) for op in ("F", "B", "OPT")}  # 1F1B's fused backward
    for row in ops.values():
        assert row["measured_ns"] > 0 and row["error"] == pytest.approx(row["profile_ns"] / row["measured_ns"] - 1)
    errors = [r["error"] for r in ops.values()]
    assert min(errors) <= report["op_time_error_median"] <= max(errors)
    for device in report["per_device"]:  # the op times were measured by the code that ran: busy times agree (within
        # what two ranks timing on a shared 2-core machine allow: 0.71 was seen once on an otherwise quiet run)
        assert abs(device["busy_error"]) < 1.0, device
        # a rank's CPU time holds its ops' (compute-bound, one thread) and fits in its few threads' wall time
        assert 0.3 * device["measured_busy_s"] < device["measured_cpu_s"] < 4 * report["measured_iteration_time_s"]
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_measured_files(timeline, trace, report)
    code = main(["validate", "--timeline", "x.txt"])  # refused before anything runs
    assert code == 2 and "--timeline: got 'x.txt', expected a file name ending in .parquet or .csv" in \
        capsys.readouterr().err
    code = main(["validate", "--device", "tpu"])
    assert code == 2 and "--device: got 'tpu', expected cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        code = main(["validate", "--device", "cuda"])
        assert code == 2 and "torch sees no CUDA device here" in capsys.readouterr().err


def test_validate_on_cuda_runs_the_pipeline_with_a_gpu_per_device_else_times_the_stages_on_one():
    """As many GPUs as --stages: the pipeline over nccl ranks, every flag as on CPU. Fewer: every stage on one GPU,
    and the flags only a pipeline run serves are refused in one line naming the flag."""
    from pipescope.experiments.cli import build_parser
    from pipescope.experiments.validate_cmd import cuda_mode
    parse = build_parser().parse_args
    assert cuda_mode(parse(["validate", "--device", "cuda", "--stages", "4", "--gantt", "g.png"]), 8) == "gpus"
    assert cuda_mode(parse(["validate", "--device", "cuda", "--stages", "4", "--op-times", "profile"]), 4) == "gpus"
    assert cuda_mode(parse(["validate", "--device", "cuda", "--stages", "4"]), 1) == "one-gpu"
    for flags, expected in [(["--gantt", "x.png"], "--gantt: got 'x.png' with --device cuda on 1 GPU(s), expected 4 "
                                                   "GPUs, one per stage device"),
                            (["--op-times", "profile"], "--op-times: got 'profile' with --device cuda on fewer GPUs "
                                                        "than --stages, expected stages")]:
        with pytest.raises(ValueError) as info:
            cuda_mode(parse(["validate", "--device", "cuda", "--stages", "4", *flags]), 1)
        assert str(info.value).startswith(expected)


def test_a_program_whose_devices_post_transfers_in_different_orders_is_refused_on_nccl():
    """nccl has no tags: a pair's transfers match in posting order. Every built-in schedule's lowering agrees; a
    program with two sends swapped is found, named, and refused before any rank starts."""
    import dataclasses

    from pipescope.executor.spec import p2p_order_mismatch
    from pipescope.simulator.lowering import lower
    for name, chunks in (*FLUSH, ("v-min", 2), ("2bw", 1), ("pipedream", 1)):
        for p in (2, 4):
            assert p2p_order_mismatch(lower(build(name, p, 2 * p, chunks=chunks))) is None, (name, p)
    program = lower(build("gpipe", 2, 2))
    first = list(program.device_actions[0])
    sends = [i for i, a in enumerate(first) if a is not None and a.kind is ActionKind.SEND_F]
    first[sends[0]], first[sends[1]] = first[sends[1]], first[sends[0]]
    swapped = dataclasses.replace(program, device_actions=(tuple(first), *program.device_actions[1:]))
    assert p2p_order_mismatch(swapped) == ("devices 0 and 1 post their transfers in different orders: transfer 1 is "
                                           "0SEND_F1 on device 0, 0SEND_F0 on device 1")
    spec = RunSpec(swapped, SHAPE, device="cuda")
    with pytest.raises(ValueError, match=r"^gpipe on nccl: devices 0 and 1 post their transfers in different orders"):
        execute_all([spec])


@pytest.mark.parametrize("meta, flags, expected", [
    ({"model": {"layers": 5}}, [], "--profile: '{}' has no model.hidden in its profile.json; expected the model "
                                   "the profile measured"),
    ({"precision": "bf16"}, [], "--profile: {} was calibrated in bf16, expected fp32, the precision the executor runs"),
    ({"device": {"type": "cuda"}}, [], "--profile: {} was calibrated on cuda, expected a cpu profile for --device cpu"),
    ({}, ["--model", "tiny"], "--model: got 'tiny', but --profile {} measured 't' with layers=4, hidden=64, heads=4, "
                              "vocab=512; expected its model (or leave --model out)"),
    ({}, [], "--profile: {} has no comms.json, expected the transfers measured too (torchrun --nproc-per-node 2 -m "
             "pipescope.calibration.comms --out {}), or no --profile"),
])
def test_validate_refuses_a_profile_the_executor_cannot_run_as_timed(tmp_path, capsys, meta, flags, expected):
    """The executor builds the profile's model in fp32 on --device: a profile without its shape, of another precision
    (calibrate's default on a GPU is bf16), of another device or another --model than asked, or without the
    transfers a pipeline run needs (the default topology's NVLinks would stand in for gloo) is one line before any
    rank starts; so is an unknown --model to calibrate."""
    import json

    from test_profiled_costs import make_profile

    from pipescope.experiments.cli import main
    folder = make_profile(tmp_path / "profile", mbs=(1, 2))
    good = {"model": {"name": "t", "layers": 4, "hidden": 64, "heads": 4, "seq": 128, "vocab": 512},
            "precision": "fp32", "device": {"type": "cpu"}}
    path = folder / "profile.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **good, **meta}))
    assert main(["validate", "--profile", str(folder), "--iterations", "1", "--warmup", "1", *flags]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"pipescope: error: {expected.format(folder, folder)}") and err.count("\n") == 1
    assert out == ""
    assert main(["validate", "--model", "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("pipescope: error: --model: got 'nosuch', expected one of tiny, ")


def test_validate_refuses_bad_flags_before_calibrating_naming_the_flag(capsys):
    from pipescope.experiments.cli import main
    for flags, expected in ((["--stages", "0"], "--stages: got 0, expected an integer from 1"),
                            (["--stages", "5"], "model.layers: got 4, expected at least one layer per stage"),
                            (["--microbatch-size", "0"], "--microbatch-size: got 0, expected an integer from 1")):
        assert main(["validate", *flags]) == 2
        err = capsys.readouterr().err  # one line: refused before the calibration's phase line
        assert err.startswith(f"pipescope: error: {expected}") and err.count("\n") == 1, err


def test_stage_by_stage_program_runs_every_stage_on_one_device_forward_then_backward():
    """The serial program of ``validate --op-times stages``: one device, each microbatch's F through every stage then
    its backward back (I then W where the schedule splits it), a flush that lowers with no transfer."""
    from pipescope.executor.stage_timing import serial_schedule
    from pipescope.simulator.lowering import lower
    for name, back in (("1f1b", ["B"]), ("zb-h1", ["I", "W"])):
        serial = serial_schedule(build(name, 2, 2))
        assert (serial.num_devices, serial.stage_to_device) == (1, (0, 0))
        expected = [f"{s}{k}{mb}" for mb in range(2) for s, k in [(0, "F"), (1, "F")] +
                    [(s, k) for k in back for s in (1, 0)]]
        assert [str(a) for a in serial.device_actions[0]] == expected
        assert all(a.kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
                   for a in lower(serial).device_actions[0] if a is not None)


def test_more_ranks_than_cores_share_them_in_the_simulation_and_are_warned(capsys):
    """validate's config: with more ranks than CPU cores, cluster.host_cores is the core count, and a warning says so
    on stderr and in the report; otherwise the config is left alone."""
    from pipescope.config import load_config
    from pipescope.experiments.validate_cmd import _shared_cores
    cores = len(os.sched_getaffinity(0))
    for ranks in (cores, cores + 2):
        sets = [f"schedule.stages={ranks}", f"schedule.microbatches={2 * ranks}"]
        config, warnings = _shared_cores(load_config(None, sets))
        if ranks == cores:
            assert warnings == [] and config.cluster.host_cores is None
        else:
            (warning,) = warnings
            assert config.cluster.host_cores == cores and config.schedule.stages == ranks
            assert warning.startswith(f"{ranks} ranks on {cores} CPU cores") and warning in capsys.readouterr().err


def test_a_flush_steps_share_the_gradient_norm_before_them_by_their_durations():
    """The gap between the last backward and the first step (the gradient norm) goes to the steps by duration."""
    from pipescope.executor.run import RunResult
    from pipescope.executor.stage_timing import norm_shares, op_means
    rows = [("0F0", "F", 0, 0, 0, 10), ("1B0", "B", 1, 0, 10, 40), ("0B0", "B", 0, 0, 40, 60),
            ("0OPT0", "OPT", 0, 0, 90, 120), ("1OPT0", "OPT", 1, 0, 120, 180)]
    assert norm_shares(rows) == {0: 10, 1: 20}
    slower = [(a, k, s, mb, start, end + (30 if k == "F" else 0)) for a, k, s, mb, start, end in rows]
    run = RunResult([[rows], [slower]], [], {}, [], [], [], 1, [[0], [0]])
    assert op_means(run, 2) == [{"F": 25, "B": 20, "OPT": 40}, {"B": 30, "OPT": 80}]
    copies = RunResult([[rows, slower]], [], {}, [], [], [], 2, [[0, 0]])  # two ranks at once: the same samples
    assert op_means(copies, 2) == op_means(run, 2)


def test_the_cpu_time_clock_counts_work_and_not_waiting():
    """Stage timing with more ranks than cores times ops by their thread's CPU time: a sleep (a rank waiting for
    a core or a message) adds nothing, a busy loop adds its length."""
    import time

    from pipescope.executor.clock import HostClock, ThreadCpuClock, make_clock
    clock = make_clock(torch.device("cpu"), cpu_time=True)
    assert isinstance(clock, ThreadCpuClock) and type(make_clock(torch.device("cpu"))) is HostClock
    start = clock.stamp()
    time.sleep(0.05)
    slept = clock.stamp()
    end = time.perf_counter() + 0.03
    while time.perf_counter() < end:
        pass
    assert slept - start < 5_000_000 and clock.stamp() - slept > 15_000_000


def test_stages_timed_as_copies_at_once_by_cpu_time():
    """The serial program as two ranks at once (replicas whose gradients are averaged) with the CPU-time clock:
    both ranks' rows, every row on that one clock (the all-reduce's too: no span of hours from a wall-clock end),
    and ``stage_op_times`` gives every stage's F, B and OPT from them."""
    import dataclasses

    from pipescope.executor.run import execute_timed
    from pipescope.executor.stage_timing import op_means, serial_schedule
    spec = RunSpec(build("1f1b", 2, 2), SHAPE, iterations=2, warmup=1, timeout_s=60)
    run = execute_timed(dataclasses.replace(spec, schedule=serial_schedule(spec.schedule), data_parallel=2,
                                            cpu_time=True))
    assert [len(ranks) for ranks in run.rows] == [2, 2]
    rows = [row for ranks in run.rows for rank in ranks for row in rank]
    assert {row[1] for row in rows} >= {"F", "B", "OPT", "ALL_REDUCE"}
    assert all(0 <= end - start < 10**9 for *_, start, end in rows)
    times = op_means(run, 2)
    assert [sorted(ops) for ops in times] == [["B", "F", "OPT"], ["B", "F", "OPT"]]
    assert all(ns > 0 for ops in times for ns in ops.values())


def _check_measured_files(timeline, trace, report: dict) -> None:
    """The measured iteration in the simulator's timeline columns and trace format: every row of both devices
    (1F1B p=2 m=4: F, B, the optimizer steps, each transfer on both sides and the clipping norm's all-reduce),
    spans inside the measured iteration; a transfer's two rows share a span that ends before its consumer starts."""
    import gzip
    import json

    import pandas as pd
    frame = pd.read_csv(timeline)
    assert list(frame.columns[:4]) == ["device", "stream", "action", "kind"]
    assert sorted(frame["kind"].unique()) == ["ALL_REDUCE", "B", "F", "OPT", "RECV_B", "RECV_F", "SEND_B", "SEND_F"]
    assert len(frame) == 2 * (4 + 4 + 1 + 4 + 4 + 1)
    assert set(frame.loc[frame["device"] == 0, "stream"]) == {"compute", "send->1", "recv<-1", "collective"}
    assert (frame["start_ns"] <= frame["end_ns"]).all() and frame["start_ns"].min() == 0
    span = {(d, a): (s, e) for d, a, s, e in zip(frame["device"], frame["action"], frame["start_ns"], frame["end_ns"])}
    for k in range(4):
        assert span[0, f"0SEND_F{k}"] == span[1, f"1RECV_F{k}"] and span[1, f"1RECV_F{k}"][1] <= span[1, f"1F{k}"][0]
        assert span[1, f"1SEND_B{k}"] == span[0, f"0RECV_B{k}"] and span[0, f"0RECV_B{k}"][1] <= span[0, f"0B{k}"][0]
        assert span[0, f"0F{k}"][1] <= span[0, f"0SEND_F{k}"][0]  # sent after the F that made it
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    ops = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["action"] for e in ops} == set(frame["action"])
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)
    assert max(e["ts"] + e["dur"] for e in ops) * 1e3 <= report["measured_iteration_time_s"] * 1e9 * 3


def test_a_measured_transfer_spans_from_the_later_post_to_the_receivers_wait():
    """Both rows of a transfer get one span: it cannot move before both sides posted, and it had arrived when the
    receiver's wait returned."""
    import pandas as pd

    from pipescope.experiments.validate_cmd import measured_spans
    rows = pd.DataFrame([(0, "0SEND_F0", "SEND_F", 0, 0, 10, 11), (1, "1RECV_F0", "RECV_F", 1, 0, 5, 30),
                         (1, "1SEND_B0", "SEND_B", 1, 0, 40, 41), (0, "0RECV_B0", "RECV_B", 0, 0, 50, 60),
                         (1, "1F0", "F", 1, 0, 30, 39)],
                        columns=["device", "action", "kind", "stage", "microbatch", "start_ns", "end_ns"])
    spans = measured_spans(rows, (0, 1))
    assert spans[0, "SEND_F", 0, 0] == spans[1, "RECV_F", 1, 0] == (10, 30)  # sent after the receive was posted
    assert spans[1, "SEND_B", 1, 0] == spans[0, "RECV_B", 0, 0] == (50, 60)  # the receive posted after the send
    assert spans[1, "F", 1, 0] == (30, 39)
