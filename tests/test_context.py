"""Context parallelism (docs/parallelism.md, "Context parallelism"; simulator/context.py): each GPU of a context group
computes and stashes its 1/cp of the tokens, exchanges keys and values in a ring behind its attention (or by
all-gather, as Llama 3 did), and all-reduces its gradients over the group before the step."""

from __future__ import annotations

import pytest

from pipescope import ConfigError, load_config, run
from pipescope.runner import prepare
from pipescope.simulator.context import ContextTimes, exposed_ns
from pipescope.simulator.kernels import layer_kernels
from pipescope.simulator.models import PRESETS, layer_work

LONG = ["model.preset=llama3-8b", "model.seq=32768", "model.layers=8", "schedule.stages=2",
        "schedule.microbatches=4", "parallel.tensor=2", "cluster.topology=dgx-h100", "cluster.nodes=2"]


def test_each_gpu_runs_its_share_of_the_tokens_against_every_key() -> None:
    """At cp = 4 a GPU's kernels add up to a quarter of the block's FLOPs in every pass (its queries attend to all
    keys, the causal balance giving each the same share), and its flash kernel still sees the whole sequence."""
    spec = PRESETS["llama3-8b"]
    work = layer_work(spec, 1, "bf16")
    kernels = layer_kernels(spec, 1, "bf16", context=4)
    for op, flops in (("F", work.forward_flops), ("I", work.input_grad_flops), ("W", work.weight_grad_flops)):
        assert sum(k.flops for k in kernels if k.op == op) == pytest.approx(flops / 4, rel=1e-12)
    assert {k.flash.seq for k in kernels if k.flash is not None} == {spec.seq}


def test_a_ring_step_costs_only_what_its_transfer_takes_beyond_its_block_of_attention() -> None:
    times = ContextTimes(ring_step=30, gather=100, scatter=70)
    assert exposed_ns(times, 2, "p2p", 3, (80, 160)) == (0, 0)  # 30 < 80/2 and 60 < 160/2: hidden
    assert exposed_ns(times, 4, "p2p", 3, (80, 160)) == (3 * 3 * 10, 3 * 3 * 20)  # 3 steps of 30 - 20 and 60 - 40
    assert exposed_ns(times, 4, "all_gather", 3, (80, 160)) == (3 * 100, 3 * 170)  # nothing hidden
    assert exposed_ns(times, 1, "p2p", 3, (80, 160)) == (0, 0)


def test_a_long_sequence_splits_its_time_and_activations_over_the_group() -> None:
    """Llama 3 8B (8 layers) at 32k tokens on 2 stages of t = 2: cp = 2 holds half the activations a GPU stashes and
    takes close to half the time on twice the GPUs; each step first all-reduces the gradients over the group."""
    one, two = (run(load_config(None, [*LONG, f"parallel.context={cp}"])) for cp in (1, 2))
    assert two.gpus == 2 * one.gpus
    assert 0.5 <= two.iteration_time_s / one.iteration_time_s < 0.56
    for a, b in zip(one.stage_costs, two.stage_costs):
        assert b.activation_bytes == pytest.approx(a.activation_bytes / 2, abs=2)
        assert b.params == a.params  # the weights are whole on every GPU of the group
    built = prepare(load_config(None, [*LONG, "parallel.context=2"]))
    grads = built.costs.split.context_times[0].grad_all_reduce
    assert grads > 0 and two.stage_costs[0].optimizer_ns == one.stage_costs[0].optimizer_ns + grads
    gathered = run(load_config(None, [*LONG, "parallel.context=2", "parallel.context_comm=all_gather"]))
    assert gathered.iteration_time_s > two.iteration_time_s  # nothing of the all-gather hides behind attention
    from pipescope.experiments.report import table

    assert " t=2 cp=2  weight" in table(two) and " t=2 cp=2 all-gather  weight" in table(gathered)


@pytest.mark.parametrize("sets, message", [
    (["parallel.context=3", "parallel.tensor=2"],
     "parallel.context: got 3 with parallel.tensor 2, expected context x tensor to divide the 8 GPUs per node of "
     "dgx-h100, or to be a multiple"),
    (["parallel.context=4", "parallel.tensor=4", "cluster.nodes=4", "cluster.placement=spread"],
     "cluster.placement: got spread with devices of 16 GPUs, which fill whole nodes"),
    (["parallel.context=4", "parallel.tensor=4", "cluster.nodes=4", "cluster.placement=4,16"],
     "cluster.placement: GPU 4 starts a device of 16 GPUs inside a node"),
    (["parallel.context=2", "model.seq=32766"], "expected 2 x context to divide model.seq"),
    # sequence parallelism splits a context rank's tokens, not the whole sequence
    (["parallel.context=2", "parallel.tensor=4", "parallel.sequence=true", "model.seq=8196", "cluster.nodes=2"],
     r"parallel.tensor: got 4 with parallel.sequence, expected a divisor of a context rank's tokens, model.seq / "
     r"parallel.context \(=8196 / 2\)"),
    (["parallel.context=2", "model.attention=eager"], "with model.attention eager, expected flash"),
    (["parallel.context=2", "parallel.tensor=1", "costs.kind=uniform"],
     "parallel.context: got 2 under costs.kind uniform, expected 1"),
    (["parallel.context=2", "parallel.context_comm=ring"], "parallel.context_comm: got 'ring', expected one of p2p, "
                                                            "all_gather"),
    (["parallel.context=2", "parallel.tensor=1", "schedule.name=1f1b", "schedule.vocab=vocab-1"],
     "schedule.vocab: vocab-1 with parallel.context=2 is not modelled"),
])
def test_context_parallelism_is_refused_where_it_has_no_meaning(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run(load_config(None, [*LONG, *sets]))


def test_the_planner_searches_context_parallelism_and_ranks_it_exactly() -> None:
    """--context is an axis: a device is tensor x cp GPUs, so each degree has its own widths and depths; the top 3
    are an exhaustive simulation's, and the floors the planner prunes with stay below every simulated candidate's. A
    base config's parallel.context (not searched) is every candidate's."""
    from pipescope.experiments.plan import _allreduce_floor, plan, screen
    from pipescope.experiments.plan_space import PLAN_KEYS, PlanRequest, base_config, candidates
    from pipescope.simulator.bounds import busy_per_iteration_ns, memory_lower_bounds

    base = base_config("llama3-8b", "dgx-h100", 1, None, {"model": {"seq": 32768, "layers": 8}})
    request = PlanRequest(base, 8, schedules=("1f1b",), microbatch_sizes=(1,), tensor=(2,), recompute=("full",),
                          vocab=("naive",), context=(1, 2), top=3)
    points = candidates(request, 8)
    assert sorted({(c.context, c.width * c.depth) for c in points}) == [(1, 4), (2, 2)]  # 8 GPUs over t x cp
    every = []
    for candidate in points:
        screened = screen(request, candidate)
        result = run(screened.run.config)
        built = prepare(screened.run.config)
        costs, c = built.stage_costs(), built.config
        floor = max(max(busy_per_iteration_ns(built.schedule, costs)), _allreduce_floor(built, costs))
        assert floor <= result.iteration_ns and result.gpus == 8
        memory = memory_lower_bounds(built.schedule, costs, c.model.precision, c.memory.runtime,
                                     sharding=c.parallel.sharding(c.cluster.data_parallel),
                                     overhead_bytes=built.overheads.total)
        assert all(m <= d.peak_memory_bytes for m, d in zip(memory, result.devices))
        every.append((result.throughput_samples_per_s, tuple(candidate.as_dict().values())))
    every.sort(key=lambda row: -row[0])
    report = plan(request, workers=1, progress=False)
    assert [r["throughput_samples_per_s"] for r in report.ranked[:3]] == pytest.approx([t for t, _ in every[:3]])
    assert tuple(report.best[k] for k in PLAN_KEYS) == every[0][1]
    fixed = PlanRequest(base_config("llama3-8b", "dgx-h100", 1, None, {"model": {"seq": 32768, "layers": 8},
                                                                        "parallel": {"context": 2}}), 8,
                        schedules=("1f1b",), microbatch_sizes=(1,), tensor=(2,), recompute=("full",), vocab=("naive",))
    assert {c.width * c.depth for c in candidates(fixed, 8)} == {2}  # the base's cp = 2 in every candidate


def test_a_context_group_may_cross_nodes_and_its_ring_then_runs_at_the_nics_rate() -> None:
    """t = 4, cp = 4 on DGX H100s: a device is 16 GPUs, two whole nodes; each tensor group stays in a node and the
    context group [g, g+4, g+8, g+12] crosses them (Llama 3 ran its context parallelism across nodes). Half the
    bytes of t = 2's ring step then take over twice as long: two of its four transfers leave the node."""
    within = prepare(load_config(None, [*LONG, "parallel.tensor=2", "parallel.context=4"]))
    across = prepare(load_config(None, [*LONG, "parallel.tensor=4", "parallel.context=4", "cluster.nodes=4"]))
    assert across.cluster.rank_of == [0, 16]  # each device starts a node pair
    step = [built.costs.split.context_times[0].ring_step for built in (within, across)]
    assert step[1] > 2 * step[0]
    result = run(across.config)
    assert result.gpus == 32 and result.iteration_time_s > 0


def test_an_exchange_chosen_without_context_parallelism_is_said_not_silent() -> None:
    result = run(load_config(None, ["parallel.context_comm=all_gather"]))
    assert any(w.startswith("parallel.context_comm all_gather with parallel.context 1: no context parallelism")
               for w in result.warnings)
    assert not any(w.startswith("parallel.context_comm") for w in run(load_config(None, [])).warnings)
