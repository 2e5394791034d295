"""ZeRO stages 1-3 over the data-parallel replicas (docs/parallelism.md): the model states each GPU holds, to the
byte; the collectives each stage runs and the bytes they move; stage 3's weight gathers before the ops that read
the weights, prefetched, and what the ledger holds while they are gathered."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipescope import ConfigError, load_config, run
from pipescope.experiments.plots_gantt import gantt_figure
from pipescope.experiments.plots_inputs import run_from_trace
from pipescope.simulator.costs import FsdpUnit, StageCost
from pipescope.simulator.engine import Engine
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.lowering import add_fsdp_actions, add_reduce_grad, lower
from pipescope.simulator.memory import static_memory
from pipescope.simulator.mesh import Sharding
from pipescope.simulator.network import RING_STEPS
from pipescope.simulator.oracle import Oracle
from pipescope.simulator.passes import PASSES, Lowering
from pipescope.simulator.readers.csvio import to_csv_text
from pipescope.simulator.replicas import GradSync, data_parallel
from pipescope.simulator.schedules import build
from pipescope.simulator.trace import chrome_trace
from pipescope.simulator.simulate import prepare
from tests.test_network import servers
from tests.test_optimizer_step import GB, StepCosts

SMALL = ["model.preset=gpt-355m", "model.layers=8", "schedule.stages=2", "schedule.microbatches=4",
         "cluster.topology=dgx-a100", "cluster.nodes=2", "cluster.data_parallel=4", "model.precision=bf16"]


def small(*sets: str):
    return run(load_config(None, [*SMALL, *sets]))


@pytest.mark.parametrize("runtime, w, g, k", [("torch", 2, 2, 12), ("megatron", 2, 4, 12)])
@pytest.mark.parametrize("shards", [1, 4, 64])
def test_each_stage_holds_the_zero_papers_model_state_bytes(runtime: str, w: int, g: int, k: int, shards: int) -> None:
    """(w+g+K)Ψ, (w+g)Ψ + KΨ/N, wΨ + (g+K)Ψ/N, (w+g+K)Ψ/N for stages 0-3 (Rajbhandari et al. 2020, Figure 1)."""
    psi = 7_500_000 * 64
    expected = [(w + g + k) * psi, (w + g) * psi + k * psi // shards, w * psi + (g + k) * psi // shards,
                (w + g + k) * psi // shards]
    got = [static_memory(psi, 1, "bf16", runtime, Sharding(zero, shards)).total for zero in range(4)]
    assert got == expected


def test_a_shard_is_rounded_up_never_lost() -> None:
    state = static_memory(10, 1, "bf16", "torch", Sharding(3, 3))  # 20, 20 and 120 bytes in 3 shards
    assert (state.weights, state.gradients, state.optimizer) == (7, 7, 40)


def test_every_stage_end_to_end_saves_what_it_shards_and_runs_its_collectives() -> None:
    """In a whole run (overheads and step counters are the same in each), each stage's static bytes fall by the
    closed form's saving; stages 1-2 reduce-scatter, stage 3 also gathers weights before its ops."""
    # a small vocabulary: the embedding is not the largest unit, so a stage holds 4 units (two at once under ZeRO-3)
    results = [small(f"parallel.zero={zero}", "memory.runtime=torch", "model.vocab=4096") for zero in range(4)]
    psi = sum(c.params for c in results[0].stage_costs[:1])  # stage 0 lives alone on device 0
    saved = [results[0].devices[0].static_memory_bytes - r.devices[0].static_memory_bytes for r in results]
    assert saved == [0, 12 * psi - -(-12 * psi // 4), 14 * psi - -(-14 * psi // 4), 16 * psi - -(-16 * psi // 4)]
    kinds = [set(r.timeline.query("stage >= 0 and kind in ('ALL_REDUCE', 'REDUCE_SCATTER', 'ALL_GATHER')").kind)
             for r in results]
    assert kinds == [{"ALL_REDUCE"}, {"REDUCE_SCATTER"}, {"REDUCE_SCATTER"}, {"REDUCE_SCATTER", "ALL_GATHER"}]
    peaks = [r.devices[0].peak_memory_bytes for r in results]
    kept = small("parallel.zero=3", "memory.runtime=torch", "model.vocab=4096", "parallel.reshard_after_forward=false")
    # stage 3 without resharding runs torch's FSDP actions: it gathers back the weights it saves between steps and
    # accumulates its gradients unsharded until REDUCE_GRAD, so at its peak it holds what stage 1 holds at its own,
    # and its shards of both beside them (bf16: 2 bytes a parameter each)
    assert peaks[0] > peaks[1] > peaks[2]
    assert kept.devices[0].peak_memory_bytes == peaks[1] + 2 * -(-2 * psi // 4)
    # resharding after each op, only two units are whole at once
    assert results[3].devices[0].static_memory_bytes < peaks[3] < peaks[2]


def test_stages_2_and_3_reduce_scatter_after_every_microbatch_and_stage_1_once() -> None:
    """Per stage and iteration: ZeRO-1 one reduce-scatter a bucket, ZeRO-2 one a bucket and microbatch (the
    micro-step reduction of DeepSpeed and FSDP); the step waits for them all."""
    sets = ["cluster.bucket_size=1PiB", "cluster.overlap_grad_sync=false"]
    counts = {}
    for zero in (1, 2):
        rows = small(f"parallel.zero={zero}", *sets).timeline.query("kind == 'REDUCE_SCATTER' and device == 0")
        counts[zero] = len(rows)
        step = small(f"parallel.zero={zero}", *sets).timeline.query("kind == 'OPT' and device == 0")
        assert step.start_ns.min() >= rows.end_ns.max()
    assert counts == {1: 1, 2: 4}


def _wire_bytes(result) -> float:
    """Bytes each GPU sends in the data-parallel collectives (ring step counts, nccl-tests' convention)."""
    rows = result.timeline.query("stage >= 0 and kind in ('ALL_REDUCE', 'REDUCE_SCATTER', 'ALL_GATHER')")
    n = result.data_parallel
    return sum(nbytes * RING_STEPS[ActionKind(kind)](n) / n for kind, nbytes in zip(rows.kind, rows.bytes))


def test_stage_3_moves_one_and_a_half_times_the_bytes_of_plain_data_parallelism() -> None:
    """One microbatch, one stage: ZeRO-3 gathers before the forward and the backward and reduce-scatters once, 3
    half-volumes against the all-reduce's 2 (ZeRO paper, section 7.2.2); without resharding after the forward, 2."""
    sets = ["schedule.stages=1", "schedule.microbatches=1", "memory.runtime=torch", "cluster.nodes=1"]
    plain, zero3 = small(*sets), small(*sets, "parallel.zero=3")
    assert _wire_bytes(zero3) == pytest.approx(1.5 * _wire_bytes(plain), rel=1e-9)
    kept = small(*sets, "parallel.zero=3", "parallel.reshard_after_forward=false")
    assert _wire_bytes(kept) == pytest.approx(_wire_bytes(plain), rel=1e-9)


def _csv(tmp_path, schedule) -> str:
    """``schedule.name`` of a CSV holding ``schedule``'s lists as they are (torch's runtime CSV keeps every cell)."""
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.csv"
    path.write_text(to_csv_text(schedule, compute_only=False))
    return f"schedule.name=csv:{path}"


def test_stage_3_without_resharding_runs_torchs_fsdp_actions(tmp_path) -> None:
    """The lowering adds UNSHARD/RESHARD/REDUCE_GRAD where torch's runtime does; each UNSHARD all-gathers its stage's
    weights, issued when the device reaches it, and the stage's next op waits for it; each REDUCE_GRAD
    reduce-scatters the stage's gradients once, when its last backward ends, and the step waits for it. A CSV that
    holds the same actions runs the same."""
    sets = ["parallel.zero=3", "parallel.reshard_after_forward=false", "cluster.bucket_size=1PiB"]
    kept = small(*sets)
    assert kept.schedule.device_actions == add_fsdp_actions(build("1f1b", 2, 4)).device_actions
    rows = kept.timeline
    for d in range(8):  # 4 replicas of 2 devices, one stage each: one gather and one reduce-scatter a device
        mine = rows[rows.device == d]
        gather, = mine[mine.kind == "ALL_GATHER"].itertuples()
        scatter, = mine[mine.kind == "REDUCE_SCATTER"].itertuples()
        ops = mine[mine.stream == "compute"]
        backward, step = ops[ops.kind == "B"], ops[ops.kind == "OPT"]
        assert gather.start_ns == 0 and ops.start_ns.min() >= gather.end_ns  # UNSHARD before the device's first op
        assert scatter.start_ns >= backward.end_ns.max() and step.start_ns.min() >= scatter.end_ns
    same = small(*sets, _csv(tmp_path, add_fsdp_actions(build("1f1b", 2, 4))))
    assert (same.iteration_time_s, same.peak_memory_bytes) == (kept.iteration_time_s, kept.peak_memory_bytes)


def test_torchs_fsdp_actions_and_resharding_after_the_forward_are_refused_together(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"parallel.reshard_after_forward: got true, but schedule.name csv:.* holds "
                                          r"torch's UNSHARD/RESHARD/REDUCE_GRAD"):
        small("parallel.zero=3", _csv(tmp_path, add_fsdp_actions(build("1f1b", 2, 4))))
    refused = (r"parallel.reshard_after_forward: got false with schedule.name csv:.*, a lowered schedule "
               r"\(SEND/RECV cells\) or one with torch's REDUCE_GRAD but without its UNSHARD actions")
    one_f_one_b = build("1f1b", 2, 4)
    reduced_only = dataclasses.replace(one_f_one_b, device_actions=tuple(  # torch's CSV of stages without FSDP
        tuple(add_reduce_grad(acts, 4)) for acts in one_f_one_b.device_actions))
    for schedule in (lower(one_f_one_b), reduced_only):
        with pytest.raises(ConfigError, match=refused):
            small("parallel.zero=3", "parallel.reshard_after_forward=false", _csv(tmp_path, schedule))
    with pytest.raises(ValueError, match="already holds 0REDUCE_GRAD; add_fsdp_actions expects a compute-only"):
        add_fsdp_actions(reduced_only)


def _zero3_program(reshard: bool, prefetch: int = 1, offload: bool = False):
    schedule = build("1f1b", 2, 4)
    schedule = schedule if reshard else add_fsdp_actions(schedule)
    program, stage_costs = prepare(schedule, StepCosts())
    grads = [c.params * 2 for c in stage_costs]
    sharding = Sharding(3, 2, reshard, prefetch=prefetch, offload=offload, offload_params=offload,
                        host_rate=16 * GB if offload else 0.0)
    sync = GradSync(bucket_bytes=512 << 20, sharding=sharding)
    return schedule, data_parallel(program, schedule, 2, grads, sync, grads)


@pytest.mark.parametrize("reshard, prefetch, offload", [(True, 1, False), (False, 1, False), (True, 3, False),
                                                       (True, 1, True), (False, 1, True)])
def test_stage_3_gathers_are_prefetched_waited_for_and_replayed_alike_by_engine_and_oracle(
        reshard: bool, prefetch: int, offload: bool) -> None:
    """Each gather starts when the device's op ``prefetch`` before the one it feeds starts (the first ones with the
    run), and that op starts after it ends; the engine equals the test oracle; without resharding, one gather a
    stage. With the weight shards on the host (``offload``), every member joins after its shard's copy up, the first
    gathers too."""
    schedule, program = _zero3_program(reshard, prefetch, offload)
    engine = Engine(program, servers(2, 2, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(2, 2, 450 * GB, 2 * GB)).run()
    gathers = [f for f, c in enumerate(program.flow_collective) if c is not None and c.kind is ActionKind.ALL_GATHER]
    # F and B of 4 microbatches on each of 2 stages: 16 a replica's pair of devices, shared by the 2 replicas
    assert len(gathers) == (16 if reshard else 2)
    # each device's first gathers (a stage's one without resharding), joined by both replicas
    assert len(program.start_joins) == 2 * 2 * (prefetch if reshard else 1)
    assert {offset > 0 for _, offset in program.start_joins} == {offload}
    for entry, waits in enumerate(program.waits):
        for flow in (s - program.num_entries for s in waits if s >= program.num_entries):
            if flow in gathers:
                assert engine.entry_start[entry] >= engine.flow_end[flow]


class UnitCosts(StepCosts):
    """StepCosts whose stages are 4 FSDP units: a first without compute (an embedding's lookup), then 3 blocks that
    share the passes (the last taking what rounding leaves)."""

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        cost = super().stage_cost(stage, num_stages, chunks)
        passes = (cost.forward_ns, cost.input_grad_ns, cost.weight_grad_ns, cost.recompute_ns)
        block = [ns // 3 for ns in passes]
        last = [ns - 2 * b for ns, b in zip(passes, block)]
        unit = cost.params // 4
        units = (FsdpUnit(unit, 0, 0, 0), FsdpUnit(unit, *block), FsdpUnit(unit, *block),
                 FsdpUnit(cost.params - 3 * unit, *last))
        return dataclasses.replace(cost, units=units)


def _segment_starts(program, times, entry: int) -> list[int]:
    """When each segment of an op run unit by unit began: the one before it ended, or its stall did."""
    stalls = dict(times.stalls.get(entry, ()))
    starts = [times.entry_start[entry]]
    for ns in program.segments[entry][:-1]:
        ended = starts[-1] + ns
        starts.append(stalls.get(ended, ended))
    return starts


@pytest.mark.parametrize("prefetch, offload", [(1, False), (2, False), (1, True)])
def test_stage_3_gathers_unit_by_unit_and_each_unit_waits_for_its_own(prefetch: int, offload: bool) -> None:
    """With units (docs/parallelism.md, "Units"), each op that reads the weights runs unit by unit, forward order in
    F and reversed in B: one gather a unit that has parameters, a quarter of the stage's bytes each; a unit starts
    after its gather ends, and a device's gathers start as the unit ``prefetch`` before in its order of need starts
    (the first ones with the run). The engine equals the oracle; the waits between units are the result's stalls,
    not busy time, and count as exposed."""
    schedule = build("1f1b", 2, 4)
    program, stage_costs = prepare(schedule, UnitCosts())
    grads = [c.params * 2 for c in stage_costs]
    sharding = Sharding(3, 2, prefetch=prefetch, offload=offload, offload_params=offload,
                        host_rate=16 * GB if offload else 0.0)
    program = data_parallel(program, schedule, 2, grads, GradSync(512 << 20, sharding=sharding), grads,
                            units=[c.units for c in stage_costs])
    network = servers(2, 2, 450 * GB, 2 * GB)
    times = Engine(program, network).run()
    assert times == Oracle(program, servers(2, 2, 450 * GB, 2 * GB)).run()
    assert times.stalls, "the gathers over a 2 GB/s NIC outlast a block"
    gathers = {f: c for f, c in enumerate(program.flow_collective) if c is not None and c.kind is ActionKind.ALL_GATHER}
    assert len(gathers) == 16 * 4 and {c.nbytes for c in gathers.values()} == {2 * 10**9 // 4}
    for entry, ns in program.segments.items():
        assert len(ns) == 4 and sum(ns) == program.duration[entry]
        assert ns[0 if program.actions[entry].kind is ActionKind.F else 3] == 0  # the lookup's unit
        starts = _segment_starts(program, times, entry)
        for j in range(1, 4):
            for signal in program.segment_waits[entry, j]:
                assert starts[j] >= times.flow_end[signal - program.num_entries]
        for j in range(1, 4):
            for flow, offset in program.segment_joins.get((entry, j), ()):
                assert times.flow_start[flow] >= starts[j] + offset
    assert len(program.start_joins) == 2 * 2 * prefetch  # each device's first gathers, joined by both replicas
    assert {offset > 0 for _, offset in program.start_joins} == {offload}


def test_an_ops_waits_between_its_units_are_exposed_not_busy() -> None:
    """GPT 1.3B under ZeRO-3 on 2 DGX H100s: each device's busy time is its ops' work (the stalls between units are
    not), and the data-parallel time exposed covers them; a deeper prefetch starts gathers earlier and exposes less
    (docs/parallelism.md, "Prefetch and nodes")."""
    sets = ["model.preset=gpt-1.3b", "schedule.stages=1", "schedule.microbatches=4", "model.microbatch_size=4",
            "cluster.topology=dgx-h100", "cluster.nodes=2", "cluster.data_parallel=16", "parallel.zero=3"]
    one, four = (run(load_config(None, [*sets, f"parallel.zero_prefetch={k}"])) for k in (1, 4))
    for result in (one, four):
        rows = result.timeline.query("device == 0 and stream == 'compute'")
        stalls = result.records.stalls
        stalled = int((stalls[stalls[:, 0] == 0, 2] - stalls[stalls[:, 0] == 0, 1]).sum())
        assert stalled > 0
        assert result.devices[0].busy_s * 1e9 == pytest.approx(int((rows.end_ns - rows.start_ns).sum()) - stalled,
                                                               abs=1)
        assert result.devices[0].exposed_allreduce_s * 1e9 >= stalled
    assert four.exposed_allreduce_s < one.exposed_allreduce_s
    assert four.iteration_time_s < one.iteration_time_s
    figure = gantt_figure(one)  # the stalls hatched over their ops, and named in the legend
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert "waits for its unit's gather" in labels
    assert any(bars.get_hatch() == "////" for bars in figure.axes[0].collections)
    assert figure.axes[0].get_title().startswith("1f1b: p=1 x16 replicas ZeRO-3 m=4")  # the run's sharding named
    # a Chrome trace carries them, nested in their ops, so a Gantt of the file hatches them too
    read = run_from_trace(chrome_trace(one), "one.json", None)
    assert sorted(map(tuple, read.stalls.tolist())) == sorted(map(tuple, one.records.stalls.tolist()))


def test_zero_2_and_3_under_a_profile_say_a_stage_is_one_unit() -> None:
    """A profile times a stage's ops, not its blocks: ZeRO-2 and 3 then hold the stage's whole gradients (and weights)
    beside the shard, and the peak can pass ZeRO-1's (a new user's finding): the result says why."""
    sets = ["costs.kind=profile", "costs.profile=calibration/profiles/h200/gpt-1.3b", "cluster.topology=hgx-h200",
            "schedule.stages=1", "schedule.microbatches=2", "cluster.data_parallel=2"]
    peaks, notes = {}, {}
    for zero in (1, 3):
        result = run(load_config(None, [*sets, f"parallel.zero={zero}"]))
        peaks[zero], notes[zero] = result.peak_memory_bytes, [w for w in result.warnings if "one unit" in w]
    assert peaks[3] > peaks[1] and notes[1] == []
    assert notes[3] == ["parallel.zero 3 under costs.kind profile: a stage is one unit (the costs time its ops, not "
                        "its blocks), so each op holds the stage's whole gradients and weights beside its shard and "
                        "the peak can pass parallel.zero 1's; costs.kind analytic splits a stage into FSDP's units"]


def test_zero_is_refused_where_it_has_no_meaning() -> None:
    with pytest.raises(ConfigError, match=r"parallel.zero: got 4, expected an integer from 0 to 3"):
        small("parallel.zero=4")
    with pytest.raises(ConfigError, match="parallel.zero: got 3 with schedule.name 2bw, expected a flush schedule"):
        small("parallel.zero=3", "schedule.name=2bw")
    with pytest.raises(ConfigError, match="parallel.zero: got 2 under costs.kind uniform, expected 0"):
        small("parallel.zero=2", "costs.kind=uniform")


def test_the_headline_names_the_zero_stage_and_the_old_key_is_stage_1() -> None:
    from pipescope.experiments.report import table

    assert " w=4 ZeRO-3  weight" in table(small("parallel.zero=3"))
    old, new = small("parallel.distributed_optimizer=true"), small("parallel.zero=1")
    assert " w=4 ZeRO-1  weight" in table(old)
    assert old.iteration_time_s == new.iteration_time_s and old.peak_memory_bytes == new.peak_memory_bytes


def test_the_planner_searches_zero_stages_and_ranks_them_exactly(cli) -> None:
    """With --zero, each stage is a candidate where it means something (replicas to shard over, a flush schedule);
    the top 3 are an exhaustive simulation's; a --set of a searched key is refused naming --zero."""
    from pipescope.experiments.plan import plan
    from pipescope.experiments.plan_space import PLAN_KEYS, PlanRequest, base_config, candidates
    from tests.test_plan import _exhaustive

    request = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, 12 << 30, {"model": {"layers": 8}}), 16,
                          schedules=("1f1b", "2bw"), microbatch_sizes=(1, 2), tensor=(1,), recompute=("none",),
                          vocab=("naive",), zero=(0, 1, 3), top=3)
    points = candidates(request, 8)
    assert {c.zero for c in points} == {0, 1, 3}
    assert all(c.zero == 0 for c in points if c.width == 1 or c.schedule == "2bw")
    report = plan(request, workers=2, progress=False)
    every = _exhaustive(request)
    assert [r["throughput_samples_per_s"] for r in report.ranked[:3]] == pytest.approx([t for t, _, _ in every[:3]])
    assert tuple(report.best[k] for k in PLAN_KEYS) == every[0][2]
    assert report.best["zero"] > 0  # under a 12 GiB cap only a sharded state fits the fastest widths
    code, _, err = cli(["plan", "--global-batch", "8", "--zero", "0,1", "--set", "parallel.zero=1", "--no-progress"])
    assert code == 2 and "--set: parallel.zero is what the planner searches, expected --zero instead" in err
    code, _, err = cli(["plan", "--global-batch", "8", "--zero", "0,5", "--no-progress"])
    assert code == 2 and "--zero" in err


def test_the_planner_offloads_weights_under_the_configs_zero_3(cli) -> None:
    """--offload parameters needs ZeRO-3: with parallel.zero 3 from the config (not searched) it runs where there are
    replicas to shard over, where it was refused as if ZeRO-3 were missing (a new user's finding)."""
    code, out, err = cli(["plan", "--global-batch", "8", "--model", "gpt-355m", "--schedules", "1f1b", "--tensor",
                          "1", "--microbatch-sizes", "1", "--recompute", "none", "--vocab", "naive", "--workers", "1",
                          "--set", "parallel.zero=3", "--offload", "none,parameters", "--no-progress", "--json"])
    report = json.loads(out)
    assert code == 0, err
    assert {r["width"] for r in report["ranked"] if r["offload"] == "parameters"} == {2, 4, 8}
    assert report["config_fixed"] == {"parallel.zero": 3}


def test_the_planner_searches_offload_and_hsdp_groups_and_ranks_them_exactly(cli) -> None:
    """--offload and --shard-groups are axes where they mean something (offload: flush schedules; a group: a ZeRO
    stage and replicas to split into groups); the top 3 are an exhaustive simulation's; the table and the best line
    name them; their keys are refused in --set, and groups without a ZeRO stage to search."""
    from pipescope.experiments.plan import plan
    from pipescope.experiments.plan_space import PLAN_KEYS, PlanRequest, base_config, candidates
    from tests.test_plan import _exhaustive

    request = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, 9 << 30, {"model": {"layers": 8}}), 16,
                          schedules=("1f1b", "2bw"), microbatch_sizes=(2,), tensor=(1,), recompute=("none",),
                          vocab=("naive",), zero=(0, 2), offload=("none", "optimizer"), shard_groups=(2, 3), top=3)
    points = candidates(request, 8)
    assert all(c.offload == "none" for c in points if c.schedule == "2bw")  # no flush: its steps stay on the GPU
    assert {c.offload for c in points if c.schedule == "1f1b"} == {"none", "optimizer"}
    groups = {(c.width, c.zero, c.shard_group) for c in points}
    assert (8, 2, 2) in groups and (4, 2, 2) in groups and (8, 2, 3) not in groups  # 3 divides no width into groups
    assert all(g == w for w, z, g in groups if z == 0)  # nothing sharded: no group
    report = plan(request, workers=2, progress=False)
    every = _exhaustive(request)
    assert [r["throughput_samples_per_s"] for r in report.ranked[:3]] == pytest.approx([t for t, _, _ in every[:3]])
    assert tuple(report.best[k] for k in PLAN_KEYS) == every[0][2]
    flags = ["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16", "--schedules", "1f1b",
             "--tensor", "1", "--recompute", "none", "--microbatch-sizes", "2", "--vocab", "naive", "--depths", "1",
             "--workers", "1", "--no-progress", "--memory-cap", "6GiB", "--zero", "2", "--offload", "optimizer",
             "--shard-groups", "4"]
    code, out, _ = cli(flags)
    head = out.splitlines()[1]
    assert code == 0 and "offload" in head and "HSDP" in head
    assert "optimizer on the host" in out.splitlines()[-1] or "optimizer on the host" in out
    code, _, err = cli([*flags, "--set", "parallel.offload=none"])
    assert code == 2 and "--set: parallel.offload is what the planner searches, expected --offload instead" in err
    code, _, err = cli(["plan", "--global-batch", "8", "--shard-groups", "2", "--no-progress"])
    assert code == 2 and "--shard-groups: got 2 without a ZeRO stage to search" in err


def test_an_op_holds_two_units_whole_or_its_whole_stage_when_smaller() -> None:
    sharded = Sharding(3, 4, unit_params=10)
    assert sharded.in_flight(2 * 1000, "weights", 2) == 2 * 10 * 2  # two units of 10 parameters, 2 bytes each
    assert sharded.in_flight(2 * 16, "weights", 2) == 32  # a stage smaller than two units: all of it, beside the shard
    assert Sharding(3, 4).in_flight(2 * 1000, "weights", 2) == 2000  # no units: the whole stage
    assert Sharding(2, 4, unit_params=10).in_flight(2 * 1000, "weights", 2) == 0  # stage 2 keeps weights whole
    deeper = Sharding(3, 4, unit_params=10, prefetch=3)  # three units gathered ahead of the one in use
    assert deeper.in_flight(2 * 1000, "weights", 2) == 4 * 10 * 2 and deeper.in_flight(4000, "gradients", 4) == 80
    edges = Sharding(3, 4, unit_params=10, edge_unit_params=30)  # the embedding is a unit of the first stage only
    # the edge stage's largest unit beside a block, not two of it (the stage holds one embedding)
    assert edges.in_flight(2 * 1000, "weights", 2) == 40 and edges.in_flight(2 * 1000, "weights", 2, edge=True) == 80
    assert dataclasses.replace(edges, prefetch=2).in_flight(2 * 1000, "weights", 2, edge=True) == (30 + 2 * 10) * 2


def test_zero_2_and_3_save_memory_on_the_first_and_last_stages_of_a_large_vocabulary() -> None:
    """Llama 3 8B's embedding (525M) is over twice a block (218M): charged as two units in flight, the first and
    last stages peaked the same under ZeRO-1, 2 and 3 (a newcomer's report)."""
    peaks = {}
    for zero in (1, 2, 3):
        result = run(load_config(None, ["model.preset=llama3-8b", "model.seq=2048", "model.layers=8",
                                        "schedule.stages=2", "schedule.microbatches=4", "cluster.data_parallel=4",
                                        f"parallel.zero={zero}"]))
        peaks[zero] = [d.peak_memory_bytes for d in result.devices[:2]]
    for device in range(2):
        assert peaks[1][device] > peaks[2][device] > peaks[3][device], (device, peaks)


def test_a_stage_of_blocks_holds_block_units_so_its_peak_falls_with_each_zero_stage() -> None:
    """Llama 3 8B in 4 stages over 2 replicas: the middle stages hold blocks only, whose units (218M parameters)
    are smaller than the embedding's (525M); charged the embedding's, ZeRO-2 and 3 made them peak above ZeRO-1."""
    peaks = {}
    for zero in (1, 2, 3):
        result = run(load_config(None, [
            "model.preset=llama3-8b", "schedule.recompute=full", "cluster.data_parallel=2", f"parallel.zero={zero}"]))
        peaks[zero] = [d.peak_memory_bytes for d in result.devices]
    for device in range(4):
        assert peaks[1][device] > peaks[2][device] > peaks[3][device], (device, peaks)


# HSDP: shard within a group of replicas, replicate across the groups ----------------------------------------------

def test_hsdp_reduce_scatters_in_each_group_then_all_reduces_each_shard_across_them() -> None:
    """4 replicas in 2 shard groups of 2: a bucket's reduce-scatter runs in each group, then each half is all-reduced
    by the 2 replicas holding it, each member joining when its group's reduce-scatter ends; the step waits for the
    all-reduce; the engine equals the test oracle."""
    schedule = build("1f1b", 2, 4)
    program, stage_costs = prepare(schedule, StepCosts())
    grads = [c.params * 2 for c in stage_costs]
    sync = GradSync(bucket_bytes=1 << 50, sharding=Sharding(1, 2))  # 2 shards over 4 replicas: 2 groups
    program = data_parallel(program, schedule, 4, grads, sync, grads)
    engine = Engine(program, servers(4, 2, 450 * GB, 2 * GB)).run()
    assert engine == Oracle(program, servers(4, 2, 450 * GB, 2 * GB)).run()
    flows = {f: c for f, c in enumerate(program.flow_collective) if c is not None and c.stage == 0}
    scatters = {f: c for f, c in flows.items() if c.kind is ActionKind.REDUCE_SCATTER}
    reduces = {f: c for f, c in flows.items() if c.kind is ActionKind.ALL_REDUCE}
    assert sorted(c.group for c in scatters.values()) == [(0, 2), (4, 6)]  # device 0 of replicas 0-1 and 2-3
    assert sorted(c.group for c in reduces.values()) == [(0, 4), (2, 6)]  # the same half in either group
    assert {c.nbytes for c in reduces.values()} == {grads[0] // 2}
    for f in reduces:
        assert engine.flow_start[f] >= max(engine.flow_end[s] for s in scatters)
    steps = [i for i, a in enumerate(program.actions) if a.kind is ActionKind.OPT and a.stage == 0]
    assert min(engine.entry_start[i] for i in steps) >= max(engine.flow_end[f] for f in reduces)


def test_hsdp_holds_a_groups_shards_and_inside_a_node_beats_sharding_across_nodes() -> None:
    """Shard groups of a node's 8 GPUs on 2 DGX H100s: each GPU holds 1/8 of the states (not 1/16), and the gathers
    stay on NVLink, so the step is faster than ZeRO-3 over all 16."""
    sets = ["schedule.stages=1", "schedule.microbatches=4", "cluster.topology=dgx-h100", "cluster.nodes=2",
            "cluster.data_parallel=16", "model.preset=gpt-1.3b", "model.microbatch_size=4", "memory.runtime=torch",
            "parallel.zero=3", "model.vocab=50304"]  # padded: torch's 50,257 would add misaligned logits to both
    full, hybrid = (run(load_config(None, [*sets, *extra])) for extra in ([], ["parallel.shard_group=8"]))
    psi = full.stage_costs[0].params
    for result, shards in ((full, 16), (hybrid, 8)):
        assert result.devices[0].static_memory_bytes - result.memory_overheads.total == \
            pytest.approx(16 * psi / shards, rel=1e-3)
    assert hybrid.iteration_time_s < 0.5 * full.iteration_time_s


def test_deepspeed_holds_bf16_gradients_beside_the_fp32_ones_it_reduces() -> None:
    """DeepSpeed's BF16 optimizer keeps autograd's bf16 gradients (2 bytes a parameter) beside the fp32 ones it
    reduces: the same step time as Megatron's accounting, each device's static bytes 2 per parameter more; it has no
    ZeRO-2 or 3."""
    megatron, deepspeed = small("parallel.zero=1"), small("parallel.zero=1", "memory.runtime=deepspeed")
    assert deepspeed.iteration_time_s == megatron.iteration_time_s
    params = [sum(c.params for s, c in enumerate(megatron.stage_costs) if megatron.schedule.stage_to_device[s] == d)
              for d in range(2)]
    assert [d.static_memory_bytes - m.static_memory_bytes for d, m in zip(deepspeed.devices, megatron.devices)] == \
        [2 * params[d % 2] for d in range(8)]  # four replicas of the two stages
    with pytest.raises(ConfigError, match=r"^memory.runtime: got deepspeed, and parallel.zero: got 2; expected "
                                          r"parallel.zero 0 or 1"):
        small("parallel.zero=2", "memory.runtime=deepspeed")


def test_hsdp_is_refused_where_it_has_no_meaning() -> None:
    with pytest.raises(ConfigError, match="parallel.shard_group: got 2 with parallel.zero 0, expected parallel.zero"):
        small("parallel.shard_group=2")
    with pytest.raises(ConfigError, match=r"parallel.shard_group: got 3, expected a divisor of cluster.data_parallel"):
        small("parallel.zero=1", "parallel.shard_group=3")


def test_zero_3s_own_choices_are_refused_without_it() -> None:
    """The prefetch depth and resharding set how ZeRO-3 gathers weights; under stages 0-2 they were ignored."""
    with pytest.raises(ConfigError, match=r"^parallel.zero_prefetch: got 2 with parallel.zero 2, expected "
                                          r"parallel.zero 3"):
        small("parallel.zero=2", "parallel.zero_prefetch=2")
    with pytest.raises(ConfigError, match=r"^parallel.reshard_after_forward: got false with parallel.zero 0"):
        small("parallel.reshard_after_forward=false")
    assert small("parallel.zero=3", "parallel.zero_prefetch=2").iteration_time_s > 0
    alone = small("parallel.zero=3", "cluster.data_parallel=1")  # nothing to shard over: said, not silent
    assert any(w.startswith("parallel.zero 3 with cluster.data_parallel 1: no replicas") for w in alone.warnings)
    assert not any(w.startswith("parallel.zero") for w in small("parallel.zero=3").warnings)
    with pytest.raises(ConfigError, match=r"^parallel.zero_prefetch: got 2 with parallel.reshard_after_forward "
                                          r"false, expected 1"):  # torch's UNSHARD gathers once: nothing to prefetch
        small("parallel.zero=3", "parallel.reshard_after_forward=false", "parallel.zero_prefetch=2")
    own = small("parallel.zero=3", "parallel.shard_group=1")  # a group of one shards nothing: said, not silent
    assert any(w.startswith("parallel.shard_group 1 with parallel.zero 3: ") for w in own.warnings)


def test_zero_3s_choices_without_it_are_refused_when_loaded_so_a_sweep_stops_before_it_runs(cli, tmp_path) -> None:
    """They are combinations of config keys alone: load_config refuses them, and a sweep whose grid holds one stops
    with exit 2 before any run (it ran the others and filed an error row, exit 1: a new user's finding)."""
    with pytest.raises(ConfigError, match=r"^parallel.reshard_after_forward: got false with parallel.zero 0"):
        load_config(None, ["parallel.reshard_after_forward=false"])
    with pytest.raises(ConfigError, match=r"^parallel.shard_group: got 3, expected a divisor of cluster.data_parallel"):
        load_config(None, ["parallel.zero=3", "cluster.data_parallel=4", "parallel.shard_group=3"])
    grid = tmp_path / "grid.yaml"
    grid.write_text("model: {preset: gpt-355m, layers: 4}\nschedule: {stages: 2, microbatches: 4}\n"
                    "cluster: {data_parallel: 2}\nsweep:\n  parallel.zero: [0, 3]\n"
                    "  parallel.reshard_after_forward: [true, false]\n")
    code, _, err = cli(["sweep", str(grid), "--out", str(tmp_path / "out")])
    assert code == 2 and "parallel.reshard_after_forward: got false with parallel.zero 0" in err
    assert not (tmp_path / "out" / "runs.jsonl").exists()


@pytest.mark.parametrize("sets", [["parallel.zero=1"], ["parallel.zero=2"], ["parallel.zero=3"],
                                  ["parallel.zero=3", "parallel.reshard_after_forward=false"],
                                  ["parallel.zero=3", "parallel.shard_group=2"], ["parallel.offload=optimizer"],
                                  ["parallel.zero=2", "parallel.offload=optimizer"],
                                  ["parallel.zero=1", "memory.runtime=deepspeed"]])
def test_the_planners_bounds_hold_under_zero(sets: list[str]) -> None:
    """The floors the planner prunes with stay below what the simulation gives: the reduce-scatter's time and the
    memory with the sharded static state (so its ranking stays exact)."""
    from pipescope.experiments.plan import _allreduce_floor
    from pipescope.runner import prepare
    from pipescope.simulator.bounds import memory_lower_bounds

    config = load_config(None, [*SMALL, *sets])
    built = prepare(config)
    costs = built.stage_costs()
    result = run(config)
    assert 0 < _allreduce_floor(built, costs) <= result.iteration_time_s * 1e9
    c = built.config
    bounds = memory_lower_bounds(built.schedule, costs, c.model.precision, c.memory.runtime,
                                 sharding=c.parallel.sharding(c.cluster.data_parallel),
                                 overhead_bytes=built.overheads.total)
    assert all(b <= d.peak_memory_bytes for b, d in zip(bounds, result.devices))


def test_when_nothing_fits_the_plan_tries_zero_3_before_more_nodes(cli) -> None:
    """GPT 1.3B on one DGX A100 under 6 GiB: no pipeline fits, ZeRO-3 over the 8 GPUs does; under 5 GiB it takes 2
    nodes of it. The line says so and prints the command that plans it."""
    flags = ["plan", "--model", "gpt-1.3b", "--topology", "dgx-a100", "--global-batch", "64", "--schedules", "1f1b",
             "--tensor", "1", "--recompute", "none", "--microbatch-sizes", "1,2", "--vocab", "naive", "--workers", "1",
             "--no-progress"]
    code, out, _ = cli([*flags, "--memory-cap", "5GiB", "--json"])
    fit = json.loads(out)["would_fit"]
    assert code == 1 and (fit["nodes"], fit["zero"], fit["depth"]) == (2, 3, 1)
    assert fit["peak_memory_bytes"] <= 5 << 30
    code, out, _ = cli([*flags, "--memory-cap", "6GiB"])
    assert "would fit: 1 node (8 GPUs) with full recompute and microbatch 1 and ZeRO-3, e.g. 1f1b w=8 d=1" in out
    assert "(pipescope plan --nodes 1 --zero 3 --recompute full --microbatch-sizes 1 ...)" in out


# On real gloo ranks: every ZeRO stage against one process and against the ledger ----------------------------------

@pytest.mark.parametrize("stage, world, reshard", [(1, 2, True), (2, 2, True), (3, 4, False)])
def test_zero_on_gloo_ranks_trains_as_one_process_and_holds_what_the_ledger_says(stage: int, world: int,
                                                                                  reshard: bool) -> None:
    """One AdamW step of the executor's tiny GPT under ZeroRedundancyOptimizer (stage 1), the executor's own stage 2
    or fully_shard (stage 3) on 2 and 4 CPU ranks: the loss, every gradient and every weight after the step are one
    process's on the whole batch, and each rank's weights, gradients and Adam moments are the ledger's static bytes
    for that stage (fp32: 4 + 4 + 8 per parameter, sharded as ``memory.static_memory`` shards them) within 5%."""
    torch = pytest.importorskip("torch")
    from pipescope.calibration.presets import resolve
    from pipescope.executor.zero_check import check_zero

    check = check_zero(resolve("tiny"), stage, world, reshard_after_forward=reshard, timeout_s=120)
    assert check.loss == pytest.approx(check.reference_loss, rel=1e-5)
    for name, grad in check.reference_grads.items():
        torch.testing.assert_close(check.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(check.weights[name], check.reference_weights[name], rtol=1e-4, atol=1e-6,
                                   msg=name)
    ledger = static_memory(check.params, 1, "fp32", "torch", Sharding(stage, world)).total
    assert all(abs(measured / ledger - 1) < 0.05 for measured in check.state_bytes), (check.state_bytes, ledger)


def test_the_lowering_passes_each_add_their_own_actions_in_order() -> None:
    """``passes.PASSES`` from a compute-only schedule to the program of ZeRO-3 without resharding over 2 replicas:
    torch's FSDP actions, then SEND/RECV, then the optimizer steps and clipping's all-reduce, then the arrays, then
    the replicas' gathers and reduce-scatters; each pass leaves what the ones before it made."""
    schedule = build("1f1b", 2, 4)
    stage_costs = [StepCosts().stage_cost(s, 2, 1) for s in range(2)]
    run = Lowering(schedule, stage_costs, width=2, grad_bytes=[2 * c.params for c in stage_costs],
                   weight_bytes=[2 * c.params for c in stage_costs],
                   sync=GradSync(sharding=Sharding(3, 2, reshard_after_forward=False)))
    seen = []
    for each in PASSES:
        each(run)
        lists = run.program.actions if run.program is not None else [
            a for acts in (run.lists or run.schedule).device_actions for a in acts]
        seen.append({a.kind.value for a in lists})
    new = [sorted(now - before) for before, now in zip([set()] + seen, seen)]
    assert new == [["B", "F", "REDUCE_GRAD", "RESHARD", "UNSHARD"],
                   ["RECV_B", "RECV_F", "SEND_B", "SEND_F"], ["ALL_REDUCE", "OPT"], [], [],
                   ["ALL_GATHER", "REDUCE_SCATTER"], []]
    assert run.program.num_entries > 2 * sum(len(acts) for acts in run.lists.device_actions)  # tiled, syncs added


# ZeRO 1 and 2 inside the executor's pipeline program (docs/validation.md, "ZeRO in the pipeline") -----------------

PIPELINE_SHAPE = dict(layers=4, hidden=32, heads=2, seq=16, vocab=64)


def test_zero_inside_the_pipeline_trains_as_one_process_and_peaks_where_the_ledger_says(tmp_path, cli) -> None:
    """A 2-stage pipeline, 2 replicas (4 gloo ranks), two AdamW steps with clipping under ZeRO 1, 2 and 3 (its
    weights gathered per op, or at torch's FSDP actions): every loss, the last gradients and the final weights are
    one process's over all the microbatches, the replicas end equal, ZeRO-1 reduce-scatters once after the stage's
    last backward, and each rank's measured peak is the ledger's on a profile of the same model (the ledger counts
    one 4-byte step counter per parameter tensor, the executor's flat shard has one)."""
    torch = pytest.importorskip("torch")
    from pipescope.calibration.presets import Shape
    from pipescope.executor.run import RunSpec, execute_all, reference_step

    shape = Shape("test", **PIPELINE_SHAPE)
    cases = [("1f1b", 1, True), ("1f1b", 2, True), ("zb-h1", 1, True), ("1f1b", 3, True), ("gpipe", 3, False)]
    specs = [RunSpec(build(name, 2, 4), shape, microbatch_size=2, seed=3, data_parallel=2, zero=zero,
                     reshard_after_forward=reshard, iterations=2, clip_norm=0.5) for name, zero, reshard in cases]
    profile = tmp_path / "profile"
    code, _, err = cli(["calibrate", *[f"--{k}={v}" for k, v in PIPELINE_SHAPE.items()], "--microbatch-sizes", "2",
                        "--precision", "fp32", "--device", "cpu", "--budget-s", "0.05", "--out", str(profile)])
    assert code == 0, err
    for (name, zero, reshard), spec, result in zip(cases, specs, execute_all(specs)):
        reference = reference_step(spec)
        assert result.losses == pytest.approx(reference.losses, rel=1e-6)
        for key, weight in reference.weights.items():
            torch.testing.assert_close(result.weights[0][key], weight, rtol=1e-4, atol=5e-5, msg=key)
            assert torch.equal(result.weights[1][key], result.weights[0][key])
        for key, grad in reference.grads.items():
            torch.testing.assert_close(result.grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)
        collectives = [r[0] for r in result.rows[-1][0] if r[1] in ("ALL_REDUCE", "REDUCE_SCATTER")]
        assert collectives == ["0REDUCE_SCATTER3"] * (zero == 1) + ["-1ALL_REDUCE3"]  # then clipping's norm
        ledger = run(load_config(raw={
            "schedule": {"name": name, "stages": 2, "microbatches": 4},
            "model": {"microbatch_size": 2, "precision": "fp32"}, "memory": {"runtime": "torch"},
            "costs": {"kind": "profile", "profile": str(profile)}, "cluster": {"data_parallel": 2},
            "parallel": {"zero": zero, "reshard_after_forward": reshard}}))
        measured = [m.peak_bytes for m in result.memory]
        predicted = [d.peak_memory_bytes for d in ledger.devices]
        tolerance = 0.001 if name != "zb-h1" else 0.01  # zb-h1's last device: a few KiB, as without ZeRO
        assert all(abs(p / m - 1) < tolerance for p, m in zip(predicted, measured)), (name, zero, predicted, measured)


@pytest.mark.parametrize("options, expected", [
    ({"zero": 4}, "0, 1, 2 or 3"), ({"zero": 1}, "data_parallel >= 2"),
    ({"zero": 1, "data_parallel": 2, "name": "2bw"}, "a flush schedule"),
    ({"zero": 3, "data_parallel": 2, "name": "zb-h1"}, "whose backward is split into I and W")])
def test_the_executor_refuses_a_zero_it_cannot_run_in_one_line(options: dict, expected: str) -> None:
    pytest.importorskip("torch")
    from pipescope.calibration.presets import Shape
    from pipescope.executor.run import RunSpec

    name = options.pop("name", "1f1b")
    spec = RunSpec(build(name, 2, 4), Shape("test", **PIPELINE_SHAPE), **options)
    with pytest.raises(ValueError, match=r"^RunSpec.zero: got \d, expected ") as caught:
        spec.check()
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_of_too_many_data_parallel_collectives_is_refused_before_it_runs() -> None:
    """ZeRO-2 reduce-scatters every bucket after every microbatch: 1.5 MiB buckets of GPT 1.3B over 40 microbatches
    are 144,120 collectives, which ran for minutes; refused at once, naming the bucket size (docs/cli.md, "Limits")."""
    import time

    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^cluster\.bucket_size: got 1,572,864 bytes, which makes 144,120 "
                                          r"data-parallel collectives .* expected at most 100,000"):
        run(load_config(None, ["schedule.stages=1", "schedule.microbatches=40", "cluster.data_parallel=2",
                               "parallel.zero=2", "cluster.bucket_size=1.5MiB"]))
    assert time.perf_counter() - started < 30  # not the minutes the run took


def test_the_simulate_header_names_the_sharding_and_offload_that_ran(cli) -> None:
    """Offload, HSDP's groups and stage 3's prefetch change the run: its first line says so."""
    code, out, _ = cli(["simulate", "--stages", "2", "--set", "cluster.data_parallel=4", "--set", "parallel.zero=3",
                        "--set", "parallel.shard_group=2", "--set", "parallel.zero_prefetch=2", "--set",
                        "parallel.offload=optimizer"])
    assert code == 0 and " w=4 ZeRO-3 HSDP groups of 2 prefetch 2 offload optimizer " in out.splitlines()[0]


def test_the_planner_refuses_shard_groups_that_split_no_candidates_replicas(cli) -> None:
    """A group that divides no sharded candidate's replicas into 2 or more would plan as no HSDP, silently."""
    from pipescope.experiments.plan_space import PlanRequest, base_config, candidates

    request = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, 9 << 30, {"model": {"layers": 8}}), 16,
                          schedules=("1f1b",), microbatch_sizes=(2,), tensor=(1,), recompute=("none",),
                          vocab=("naive",), zero=(2,), shard_groups=(3, 5))
    with pytest.raises(ConfigError, match=r"^shard_groups: got 3,5, expected a group size that divides a "
                                          r"candidate's replicas into 2 or more groups \(the sharded candidates' "
                                          r"replicas: 2, 4, 8\)$"):
        candidates(request, 8)
    assert any(c.shard_group == 2 for c in candidates(dataclasses.replace(request, shard_groups=(3, 2)), 8))
    code, _, err = cli(["plan", "--global-batch", "8", "--zero", "3", "--shard-groups", "3", "--no-progress"])
    assert code == 2 and err.startswith("pipescope: error: --shard-groups: got 3, expected a group size")
    # a group of one replica shards nothing: it ranked unsharded candidates as HSDP 1 (a new user's finding)
    code, _, err = cli(["plan", "--global-batch", "8", "--zero", "3", "--shard-groups", "1,2", "--no-progress"])
    assert code == 2 and err == ("pipescope: error: --shard-groups: got 1,2, expected group sizes of 2 or more (a "
                                 "group of 1 replica shards nothing)\n")


def test_the_planner_names_zero_where_one_replica_leaves_it_nothing_and_says_which_plans_ran_without_it(cli) -> None:
    """Tensor 8 on 8 GPUs leaves one replica: the refusal blamed --vocab, never passed. A config's ZeRO applies to
    flush schedules only, and the line that says every plan runs with it now says which did not."""
    code, _, err = cli(["plan", "--model", "llama2-7b", "--global-batch", "8", "--schedules", "1f1b", "--tensor", "8",
                        "--zero", "1", "--no-progress", "--workers", "1"])
    assert code == 2 and err.startswith("pipescope: error: --zero: got 1, expected a setting these schedules")
    code, out, _ = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16", "--schedules",
                        "1f1b,2bw", "--tensor", "1", "--recompute", "none", "--microbatch-sizes", "2", "--vocab",
                        "naive", "--set", "parallel.zero=1", "--no-progress", "--workers", "1", "--json"])
    report = json.loads(out)
    assert code == 0 and report["config_fixed"] == {"parallel.zero": 1} and report["config_fixed_not_for"] == ["2bw"]


def test_the_older_spelling_beside_another_stage_is_refused_not_dropped() -> None:
    """distributed_optimizer: true beside zero: 0 ran ZeRO-1 silently; beside zero: 1 it says the same thing."""
    with pytest.raises(ConfigError, match=r"^parallel.distributed_optimizer: got true beside parallel.zero 0, "
                                          r"expected one of them \(distributed_optimizer is the older spelling of "
                                          r"zero: 1\)$"):
        load_config(None, ["parallel.zero=0", "parallel.distributed_optimizer=true"])
    with pytest.raises(ConfigError, match=r"got true beside parallel.zero 3"):
        load_config(None, [], raw={"parallel": {"zero": 3, "distributed_optimizer": "yes"}})
    assert load_config(None, ["parallel.zero=1", "parallel.distributed_optimizer=true"]).parallel.zero_stage == 1
    assert load_config(None, ["parallel.zero=2", "parallel.distributed_optimizer=false"]).parallel.zero_stage == 2
