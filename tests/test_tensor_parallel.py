"""Tensor parallelism, sequence parallelism and the recompute modes (simulator/parallel.py; docs/costs.md, memory.md
and network.md, "Tensor parallelism"): t = 1 changes nothing, a layer's time is its split kernels plus the
collectives of the collective model, per-GPU memory follows Korthikanti et al.'s table, bad values are one-line
errors, and placement keeps a device's t GPUs in one node."""

from __future__ import annotations

from fractions import Fraction

import networkx as nx
import pytest

from pipescope import ConfigError, load_config, run
from pipescope.runner import prepare
from pipescope.simulator.collectives import LL_WIRE_FACTOR, NCCL_STEP_NS
from pipescope.simulator.costs import AnalyticCosts, seconds_to_ns
from pipescope.simulator.kernels import PASSES, layer_kernels, output_kernels
from pipescope.simulator.memory import static_memory
from pipescope.simulator.models import ModelSpec, layer_work, output_activation_bytes, preset
from pipescope.simulator.parallel import TensorSplit, parse_recompute
from pipescope.simulator.schedules import ScheduleConfig
from pipescope.topologies.cluster import gpu_nodes, placement_ranks
from pipescope.topologies.devices import DEVICES
from pipescope.topologies.topology_io import load_topology

H100 = DEVICES["h100"]
SMALL = {"preset": "gpt-1.3b", "layers": 3, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024,
         "microbatch_size": 2}


def small(**sections) -> dict:
    """A small model on one DGX-H100, analytic costs; ``sections`` override whole keys (``schedule={...}``)."""
    raw = {"model": dict(SMALL), "cluster": {"topology": "dgx-h100"}, "schedule": {"name": "1f1b", "stages": 3,
                                                                                    "microbatches": 3}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def merged(extra: dict, **sections) -> dict:
    """``small`` with ``extra``'s and ``sections``' keys, section by section."""
    both = {name: dict(values) for name, values in extra.items()}
    for name, values in sections.items():
        both.setdefault(name, {}).update(values)
    return small(**both)


def spec() -> ModelSpec:
    return ModelSpec("small", SMALL["layers"], SMALL["hidden"], SMALL["heads"], SMALL["seq"], SMALL["vocab"])


# t = 1 changes nothing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"schedule": {"name": "zb-v", "stages": 2, "microbatches": 4},
                                        "model": {"layers": 4}},
                                   {"model": {"attention": "eager"}}, {"cluster": {"data_parallel": 2}}])
def test_tensor_one_is_the_run_without_the_section(extra: dict) -> None:
    """``parallel.tensor: 1`` and the old boolean recompute give the run they gave before the section existed."""
    plain = run(load_config(raw=small(**extra)))
    explicit = run(load_config(raw=merged(extra, parallel={"tensor": 1, "sequence": False})))
    assert explicit.iteration_ns == plain.iteration_ns and explicit.peak_memory_bytes == plain.peak_memory_bytes
    full = run(load_config(raw=merged(extra, schedule={"recompute": "full"})))
    old = run(load_config(raw=small(**extra), sets=["schedule.recompute=true"]))
    assert full.iteration_ns == old.iteration_ns and full.peak_memory_bytes == old.peak_memory_bytes
    assert full.schedule.recompute and not plain.schedule.recompute


def test_tensor_one_stage_costs_follow_the_unsplit_formulas() -> None:
    """The default split is the documented t = 1 model: 34sbh + 4abs stashed, 12h^2 + 13h parameters per layer,
    the whole logits, and the kernels of the unsplit layer."""
    model, b = preset("gpt-1.3b"), 2
    costs = AnalyticCosts(model, H100.peak_flops["bf16"], b, "bf16", 0.5, memory_bandwidth=H100.memory_bandwidth)
    s, h, a, v, layers = model.seq, model.hidden, model.heads, model.vocab, model.layers // 2
    last = costs.stage_cost(1, 2, 1)
    assert last.activation_bytes == layers * (34 * s * b * h + 4 * a * s * b) + b * s * v * 6
    assert last.params == layers * (12 * h * h + 13 * h) + v * h + 2 * h  # and the final layer norm
    assert costs.stage_cost(0, 2, 1).params == layers * (12 * h * h + 13 * h) + v * h + s * h
    assert last.boundary_bytes == last.input_bytes == 2 * s * b * h
    assert layer_kernels(model, b, "bf16", "flash", tensor=1) == layer_kernels(model, b, "bf16", "flash")


@pytest.mark.parametrize("name", ["tiny", "gpt-355m", "gpt-3.8b"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_the_default_split_is_the_unsplit_model(name: str, precision: str, attention: str) -> None:
    """TensorSplit() gives models.layer_work's bytes, the whole logits stash and ModelSpec's parameter counts."""
    model, split = preset(name), TensorSplit()
    assert split.layer_work(model, 3, precision, attention) == layer_work(model, 3, precision, attention)
    assert split.output_bytes(model, 3, precision) == output_activation_bytes(model, 3, precision)
    assert split.params(model, 5, True, True) == 5 * model.layer_params() + model.embedding_params() + \
        model.output_params()
    assert split.comm_ns(0, 5, True, True) == (0, 0)


@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_split_kernels_carry_one_tth_of_the_flops(tensor: int, attention: str) -> None:
    """Megatron splits every matmul and the attention core evenly: t GPUs' kernels carry the layer's FLOPs."""
    model = preset("gpt-1.3b")
    work = layer_work(model, 2, "bf16", attention)
    totals = dict.fromkeys(PASSES, 0.0)
    for kernel in layer_kernels(model, 2, "bf16", attention, tensor=tensor):
        totals[kernel.op] += kernel.flops * tensor
    assert (totals["F"], totals["I"], totals["W"]) == (work.forward_flops, work.input_grad_flops,
                                                       work.weight_grad_flops)
    logits = sum(k.flops for k in output_kernels(model, 2, "bf16", tensor=tensor))
    assert logits == 6 * 2 * model.seq * model.hidden * -(-model.vocab // tensor)  # the vocabulary padded to t


def test_layer_norms_and_dropouts_stay_whole_without_sequence_parallelism() -> None:
    """Layer norms, dropouts and residual adds move the whole activation per GPU unless sequence parallelism
    splits them; matmuls and GeLU shrink either way."""
    model = preset("gpt-1.3b")
    whole = {(k.name, k.op): k for k in layer_kernels(model, 1, "bf16")}
    checked = 0
    for sequence in (False, True):
        for k in layer_kernels(model, 1, "bf16", tensor=4, sequence=sequence):
            if k.name.startswith(("layer norm", "dropout (", "residual", "bias-dropout-add")):
                assert k.nbytes == whole[k.name, k.op].nbytes / (4 if sequence else 1)
                checked += 1
            if k.name == "bias-GeLU":
                assert k.nbytes == whole[k.name, k.op].nbytes / 4
                checked += 1
    assert checked == 2 * 12  # per layout: 2 layer norms, 2 bias-dropout-adds, GeLU in F; 8 such kernels in I


# Time: split compute plus the collectives ------------------------------------------------------------------------

def path_between(graph: nx.DiGraph, a: str, b: str) -> tuple[float, float]:
    """(bytes per ns, ns) of the lowest-latency path from a to b: its slowest edge as NCCL reaches it (line rate
    times efficiency) and its summed latency."""
    path = nx.shortest_path(graph, a, b, weight="latency_ns")
    edges = [graph.edges[u, w] for u, w in zip(path, path[1:])]
    return min(e["bandwidth"] * e.get("efficiency", 1) for e in edges) / 1e9, sum(e["latency_ns"] for e in edges)


def ring_ns(kind: str, n: int, nbytes: int, rate: float, hop: float) -> float:
    """The collective model's ring (docs/network.md): 2(n-1) steps of S/n for an all-reduce, n-1 otherwise, each
    paying its path's latency, under NCCL's faster protocol: Simple adds its step time, LL moves twice the bytes."""
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    simple = steps * nbytes / n / rate + steps * (hop + NCCL_STEP_NS)
    return min(simple, steps * nbytes * LL_WIRE_FACTOR / n / rate + steps * hop)


def op_ns(result, kind: str, stage: int) -> int:
    frame = result.timeline
    row = frame[(frame.kind == kind) & (frame.stage == stage)].iloc[0]
    return int(row.end_ns - row.start_ns)


@pytest.mark.parametrize("tensor,sequence", [(2, False), (4, False), (4, True)])
def test_a_layer_takes_its_split_kernels_plus_two_collectives_each_way(tensor: int, sequence: bool) -> None:
    """A middle stage's F and I are the roofline of its split kernels plus, per layer, two ring all-reduces of
    s*b*h (or two all-gathers and two reduce-scatters) over its GPUs, priced from the graph by the ring formula."""
    config = load_config(raw=small(parallel={"tensor": tensor, "sequence": sequence},
                                   cluster={"collective": "ring", "nodes": 2}, schedule={"name": "zb-h1"}))
    result = run(config)
    model, b = spec(), SMALL["microbatch_size"]
    roofline = prepare(config).costs.roofline  # the GPU's rates (docs/costs.md, "Rates")
    seconds = roofline.pass_seconds(layer_kernels(model, b, "bf16", "flash", tensor, sequence))
    graph = load_topology("dgx-h100", 1, None, None)
    gpus = gpu_nodes(graph)
    rate, hop = path_between(graph, gpus[tensor], gpus[tensor + 1])  # stage 1 runs on GPUs t .. 2t-1
    activation = model.seq * b * model.hidden * 2
    if sequence:
        per_layer = 2 * (ring_ns("all_gather", tensor, activation, rate, hop)
                         + ring_ns("reduce_scatter", tensor, activation, rate, hop))
    else:
        per_layer = 2 * ring_ns("all_reduce", tensor, activation, rate, hop)
    assert op_ns(result, "F", 1) == pytest.approx(seconds_to_ns(seconds["F"]) + per_layer, abs=8)
    assert op_ns(result, "I", 1) == pytest.approx(seconds_to_ns(seconds["I"]) + per_layer, abs=8)
    assert op_ns(result, "W", 1) == pytest.approx(seconds_to_ns(seconds["W"]), abs=2)  # W has no collective


def test_mfu_counts_every_gpu_and_the_gpu_count_includes_t() -> None:
    """A device is t GPUs: MFU divides by their peak, and p x t x w GPUs must fit the cluster."""
    plain, split = run(load_config(raw=small())), run(load_config(raw=small(parallel={"tensor": 2})))
    achieved = split.model_flops_per_iteration / split.iteration_time_s
    assert split.mfu == pytest.approx(achieved / (2 * H100.peak_flops["bf16"] * 3))
    assert split.peak_flops_per_device == 2 * plain.peak_flops_per_device
    with pytest.raises(ConfigError, match=r"^cluster\.nodes: the run needs 12 GPUs \(stages x parallel\.tensor x "
                                          r"data_parallel\)"):
        run(load_config(raw=small(parallel={"tensor": 2}, cluster={"data_parallel": 2})))
    assert run(load_config(raw=small(parallel={"tensor": 2}, cluster={"data_parallel": 2, "nodes": 2}))).mfu


# Memory per GPU --------------------------------------------------------------------------------------------------

def korthikanti(t: int, sequence: bool, recompute: str, attention: str) -> Fraction:
    """Bytes per layer (bf16) of Korthikanti et al. 2022, Table 2, and the flash analogue of docs/memory.md."""
    s, b, h, a = SMALL["seq"], SMALL["microbatch_size"], SMALL["hidden"], SMALL["heads"]
    core = Fraction(5 * a * s * s * b, t) if attention == "eager" else Fraction(4 * a * s * b, t)
    linear = Fraction(34 * s * b * h, t) if sequence else s * b * h * (10 + Fraction(24, t))
    return linear + (0 if recompute == "selective" else core)


@pytest.mark.parametrize("attention", ["eager", "flash"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("tensor,sequence", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_peak_memory_per_gpu_follows_the_table(attention: str, recompute: str, tensor: int, sequence: bool) -> None:
    """GPipe on one stage, 2 microbatches, fused B: the peak is the static state of one GPU's parameters and what a
    GPU holds besides tensors, plus two stashes (none, selective), or under full recompute two of what Megatron's
    per-block checkpoints keep (each block's input, and the output layer's logits, which are not recomputed) and one
    block's stash, rebuilt in the backward."""
    raw = small(model={"attention": attention}, parallel={"tensor": tensor, "sequence": sequence},
                schedule={"name": "gpipe", "stages": 1, "microbatches": 2, "recompute": recompute})
    result = run(load_config(raw=raw))
    s, b, h, v, layers = SMALL["seq"], SMALL["microbatch_size"], SMALL["hidden"], SMALL["vocab"], SMALL["layers"]
    params = layers * (12 * h * h + 13 * h) if tensor == 1 else layers * (12 * h * h + 7 * h) // tensor + layers * 6 * h
    params += 2 * v * h // tensor + s * h + 2 * h  # vocabulary-parallel embedding and output layer; positions and
    # the final layer norm whole
    block = korthikanti(tensor, sequence, recompute, attention)  # 'full': the stash a backward rebuilds
    logits = b * s * v // tensor * (2 + 4)  # the logits slice and its fp32 softmax
    block_input = s * b * h * 2 // (tensor if sequence else 1)
    held = 2 * (layers * block_input + logits) + block if recompute == "full" else 2 * (layers * block + logits)
    device = result.devices[0]
    assert device.static_memory_bytes == static_memory(params, 1, "bf16").total + result.memory_overheads.total
    assert result.memory_overheads.total > 0
    assert device.peak_memory_bytes == device.static_memory_bytes + held


def test_selective_recompute_adds_only_the_attention_core_forward() -> None:
    """Selective recompute lengthens each backward by the split attention core's forward, and nothing else."""
    base = run(load_config(raw=small(parallel={"tensor": 2}, model={"attention": "eager"})))
    config = load_config(raw=small(parallel={"tensor": 2}, model={"attention": "eager"},
                                   schedule={"recompute": "selective"}))
    selective = run(config)
    roofline = prepare(config).costs.roofline
    core = [k for k in layer_kernels(spec(), 2, "bf16", "eager", 2) if k.op == "F"][2:6]
    assert [k.name for k in core] == ["attention scores", "softmax", "attention dropout", "attention times V"]
    extra = sum(roofline.seconds(k) for k in core)
    assert op_ns(selective, "B", 1) - op_ns(base, "B", 1) == pytest.approx(extra * 1e9, abs=2)
    assert op_ns(selective, "F", 1) == op_ns(base, "F", 1)


def test_split_params_and_boundary() -> None:
    """One GPU holds 1/t of the split weights and sends a 1/t slice of the activation."""
    split, model = TensorSplit(4), preset("gpt-1.3b")
    h = model.hidden
    assert split.params(model, 2, False, False) == 2 * (12 * h * h // 4 + 7 * h // 4 + 6 * h)
    assert split.layer_work(model, 1, "bf16", "flash").boundary_bytes == model.seq * h * 2 // 4


# Bad values ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,message", [
    (small(parallel={"tensor": 3}), r"parallel\.tensor: got 3, expected a divisor of the 8 GPUs per node"),
    (small(parallel={"tensor": 8}, model={"heads": 4}, schedule={"stages": 1}),
     r"parallel\.tensor: got 8, expected a divisor of model\.heads"),
    (small(parallel={"sequence": True}), r"parallel\.sequence: got true with parallel\.tensor = 1"),
    (small(parallel={"tensor": 2, "sequence": True}, model={"seq": 127}),
     r"parallel\.tensor: got 2 with parallel\.sequence, expected a divisor of model\.seq"),
    (small(parallel={"tensor": 2}, costs={"kind": "uniform"}), r"parallel\.tensor: got 2 under costs\.kind uniform"),
    (small(schedule={"recompute": "selective"}, costs={"kind": "uniform"}),
     r"schedule\.recompute: got selective under costs\.kind uniform"),
    (small(parallel={"tensor": 2}, cluster={"placement": "7,0,2"}), r"cluster\.placement: GPU 7 starts a device's"),
    (small(parallel={"tensor": 2}, cluster={"placement": "0,1,4"}), r"cluster\.placement: GPU 1 is in the "),
    (small(parallel={"tensor": 2000}), r"parallel\.tensor: got 2000, expected an integer from 1 to 1,024"),
])
def test_bad_values_are_one_line_errors(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message) as err:
        run(load_config(raw=raw))
    assert "\n" not in str(err.value)


def test_recompute_spellings() -> None:
    """none/selective/full, and the old booleans as full/none; anything else names the choices."""
    assert [parse_recompute(v) for v in (True, False, "true", "False", "selective")] == [
        "full", "none", "full", "none", "selective"]
    assert ScheduleConfig(recompute=True).recompute == "full"
    with pytest.raises(ConfigError, match=r"^schedule\.recompute: got 'some', expected one of none, selective, full"):
        load_config(sets=["schedule.recompute=some"])


# Placement -------------------------------------------------------------------------------------------------------

def test_a_device_s_gpus_share_one_node() -> None:
    """linear and spread place each device on the first of t consecutive GPUs of one node; stragglers on any of
    its GPUs slow the device."""
    assert placement_ranks("linear", 4, 2, 8, tensor=4) == [0, 4, 8, 12]
    assert placement_ranks("spread", 4, 2, 8, tensor=2) == [0, 8, 2, 10]
    config = load_config(raw=small(parallel={"tensor": 2}, faults={"stragglers": "3:2.0"}))
    slow, plain = run(config), run(load_config(raw=small(parallel={"tensor": 2})))
    assert op_ns(slow, "F", 1) == pytest.approx(2 * op_ns(plain, "F", 1), abs=1)


# The real thing: t = 2 on CPU (gloo) ------------------------------------------------------------------------------

def test_two_gloo_ranks_give_the_unsplit_loss_and_gradients() -> None:
    """Megatron's column/row-parallel blocks and vocabulary-parallel embedding and cross-entropy on 2 gloo ranks (one
    launch, killed after 120 s): the loss and every gradient, gathered to full shape, are the unsplit model's."""
    torch = pytest.importorskip("torch")
    from pipescope.calibration.presets import Shape
    from pipescope.executor.tensor_parallel import check_tensor_parallel

    shape = Shape("test", layers=2, hidden=32, heads=2, seq=16, vocab=64)
    check = check_tensor_parallel(shape, tensor=2, microbatch_size=2, seed=5, timeout_s=120)
    assert check.loss == pytest.approx(check.reference_loss, rel=1e-6)
    assert set(check.grads) == set(check.reference_grads) and len(check.grads) == 2 + 2 * 12 + 3
    for name, grad in check.reference_grads.items():
        assert grad.abs().max() > 0, name  # every parameter takes part, so a wrong slice cannot hide
        torch.testing.assert_close(check.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match=r"^tensor: got 4, expected a divisor of heads \(2\)"):
        check_tensor_parallel(shape, tensor=4)


def test_the_table_names_the_options() -> None:
    """``simulate``'s headline says which recompute ran and the tensor width."""
    from pipescope.experiments.report import table

    raw = small(parallel={"tensor": 2, "sequence": True}, schedule={"recompute": "selective"})
    assert "p=3 m=3 v=1 selective recompute t=2 sequence-parallel  weight" in table(run(load_config(raw=raw)))
    assert "v=1 recompute  weight" in table(run(load_config(raw=small(schedule={"recompute": True}))))


def test_remembered_idle_times_are_what_pricing_afresh_gives() -> None:
    """``routed.IdleTimes`` remembers a group's collective times by the graph nodes it runs between: a run whose
    devices are numbered otherwise on the same cluster (4 stages where the first run had 2, over the same first node)
    takes its first groups' times from the first run, and they equal what pricing afresh gives."""
    from pipescope.simulator.routed import IdleTimes

    def times(stages: int) -> tuple:
        config = load_config(None, ["model.preset=gpt-1.3b", "parallel.tensor=4", f"schedule.stages={stages}",
                                    "cluster.topology=dgx-a100", "cluster.nodes=2", "parallel.context=1"])
        return prepare(config).costs.split.times

    IdleTimes._known.clear()
    times(2)
    before = len(IdleTimes._known)
    shared = times(4)
    added = len(IdleTimes._known) - before
    IdleTimes._known.clear()
    assert times(4) == shared
    assert 0 < added < len(IdleTimes._known)  # the second run priced only the groups the first had not
