"""What a Megatron-style run pays that the model counts since issue 27 (docs/costs.md, memory.md, network.md): the
distributed optimizer's sharded state and its reduce-scatter and all-gather, tensor-parallel collectives hidden
behind their matmuls, what a GPU holds besides tensors, the gradient precision that decides both the ledger and the
all-reduce, per-block recompute, HFU, and the links' NCCL efficiency in topology files."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from pipescope import ConfigError, load_config, run
from pipescope.runner import prepare
from pipescope.simulator.memory_overheads import (
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT_BYTES,
    HOPPER_WORKSPACE_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    Overheads,
    communicators,
    nvidia_smi_bytes,
)
from pipescope.simulator.memory_runtime import grad_bytes
from pipescope.simulator.models import PRECISIONS
from pipescope.topologies.topology_io import load_topology

SMALL = ["model.preset=gpt-355m", "model.layers=8", "schedule.stages=2", "schedule.microbatches=4",
         "cluster.topology=dgx-a100", "cluster.nodes=2"]


def small(*sets: str):
    return run(load_config(None, [*SMALL, *sets]))


# The distributed optimizer --------------------------------------------------------------------------------------

def test_the_distributed_optimizer_shards_the_state_and_reduce_scatters() -> None:
    """Over 4 replicas each GPU holds a quarter of the 12-byte Adam state, steps a quarter of its parameters, and its
    replicas reduce-scatter the gradients (and all-gather the weights after the step) instead of all-reducing."""
    sets = ["cluster.data_parallel=4", "cluster.overlap_grad_sync=false"]
    plain, sharded = small(*sets), small(*sets, "parallel.distributed_optimizer=true")
    params = plain.stage_costs[0].params
    saved = plain.devices[0].static_memory_bytes - sharded.devices[0].static_memory_bytes
    assert saved == params * 12 - -(-params * 12 // 4)
    steps = {name: r.timeline.query("kind == 'OPT' and device == 0").eval("end_ns - start_ns").iloc[0]
             for name, r in (("plain", plain), ("sharded", sharded))}
    assert steps["sharded"] == pytest.approx(steps["plain"] / 4, rel=0.01)
    kinds = {name: set(r.timeline.query("kind in ('ALL_REDUCE', 'REDUCE_SCATTER', 'ALL_GATHER') and stage >= 0").kind)
             for name, r in (("plain", plain), ("sharded", sharded))}
    assert kinds == {"plain": {"ALL_REDUCE"}, "sharded": {"REDUCE_SCATTER", "ALL_GATHER"}}
    overlapped = small("cluster.data_parallel=4", "parallel.distributed_optimizer=true")
    assert "ALL_GATHER" not in set(overlapped.timeline.kind)  # behind the next iteration's forwards


@pytest.mark.parametrize("sets, message", [
    (["costs.kind=uniform"], "parallel.distributed_optimizer: got true under costs.kind uniform, expected false"),
    (["schedule.name=2bw"], "parallel.distributed_optimizer: got true with schedule.name 2bw, expected a flush "
                            "schedule"),
])
def test_the_distributed_optimizer_is_refused_where_it_has_no_meaning(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        small("parallel.distributed_optimizer=true", *sets)


# Tensor-parallel collectives behind their matmuls --------------------------------------------------------------

def test_overlapped_tensor_collectives_cost_only_what_outlasts_their_matmul() -> None:
    """With userbuffers overlap, a layer's F pays max(0, collective - matmul) for each of its four collectives
    instead of the collectives' whole time, and never more than without the overlap."""
    sets = ["cluster.nodes=1", "parallel.tensor=4", "parallel.sequence=true", "schedule.name=zb-h1"]
    config = load_config(None, [*SMALL, *sets, "parallel.tp_comm_overlap=true"])
    costs = prepare(config).costs
    split, gemms = costs.split, costs._layer_gemm_ns(costs.rates(1, 2))
    c = split.times[1]
    layers = 4
    exposed = layers * sum(max(0, comm - gemm) for comm, gemm in
                           zip((c.all_gather, c.reduce_scatter) * 2, gemms[0]))
    whole = layers * 2 * (c.all_gather + c.reduce_scatter)
    overlapped, plain = costs.stage_cost(1, 2, 1), prepare(load_config(None, [*SMALL, *sets])).costs.stage_cost(1, 2, 1)
    assert plain.forward_ns - overlapped.forward_ns == whole - exposed
    assert 0 <= exposed < whole
    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap: got true without parallel.sequence"):
        small("parallel.tensor=4", "cluster.nodes=1", "parallel.tp_comm_overlap=true")


# What a GPU holds besides tensors ---------------------------------------------------------------------------------

def test_overheads_are_refused_where_no_gpu_process_is_modelled() -> None:
    with pytest.raises(ConfigError, match=r"^memory\.nccl_communicator: got 1048576 under costs\.kind uniform, "
                       r"expected unset"):
        small("costs.kind=uniform", "memory.nccl_communicator=1MiB")


def test_every_gpu_holds_its_cuda_context_nccl_communicators_and_workspace() -> None:
    """2 stages x 2 replicas: a pipeline, a data-parallel and a model-parallel communicator; the keys replace the
    measured defaults and count in every device's static bytes."""
    result = small("cluster.data_parallel=2")
    overheads = result.memory_overheads
    assert overheads.cuda_context == CUDA_CONTEXT_BYTES
    assert overheads.nccl == communicators(1, 2, 2) * NCCL_COMMUNICATOR_BYTES == 3 * NCCL_COMMUNICATOR_BYTES
    assert result.summary()["memory_overheads"] == overheads.as_dict()
    lean = small("cluster.data_parallel=2", "memory.cuda_context=0", "memory.nccl_communicator=0")
    assert result.devices[0].static_memory_bytes - lean.devices[0].static_memory_bytes == overheads.total - \
        lean.memory_overheads.total == CUDA_CONTEXT_BYTES + 3 * NCCL_COMMUNICATOR_BYTES
    assert run(load_config(None, ["cluster.topology=dgx-h100"])).memory_overheads.workspace == HOPPER_WORKSPACE_BYTES
    assert run(load_config(None, ["costs.kind=uniform"])).memory_overheads.total == 0  # no GPU process modelled
    assert (communicators(1, 1, 1), communicators(8, 1, 1), communicators(8, 4, 2)) == (0, 2, 4)


def test_nvidia_smi_sees_the_allocators_reserve_measured_in_megatron_logs() -> None:
    """The reserve is the median of max reserved / max allocated over every rank report of the logs the CSV copies
    (docs/memory.md, "What nvidia-smi sees"), and applies to what the caching allocator holds: the tensors and
    cuBLAS's workspace, not the CUDA context or NCCL's buffers."""
    reserve_csv = Path(__file__).parents[1] / "experiments" / "published" / "allocator-reserve.csv"
    with reserve_csv.open() as rows:
        reports = list(csv.DictReader(line for line in rows if not line.startswith("#")))
    ratios = [float(r["max_reserved_mb"]) / float(r["max_allocated_mb"]) for r in reports]
    assert len(reports) == 587 and round(statistics.median(ratios), 3) == ALLOCATOR_RESERVE
    assert 1 < min(ratios) and max(ratios) < 1.4
    overheads = Overheads(cuda_context=1 << 30, nccl=2 << 30, workspace=8 << 20)
    tensors = 40 << 30
    peak = overheads.total + tensors
    assert nvidia_smi_bytes(peak, overheads) == (3 << 30) + -(-((tensors + (8 << 20)) * 1209) // 1000)
    assert nvidia_smi_bytes(overheads.cuda_context + overheads.nccl, overheads) == 3 << 30


def test_megatron_keeps_fp32_gradients_for_bf16_only_and_the_all_reduce_moves_them() -> None:
    """megatron/arguments.py turns on fp32 gradient accumulation and all-reduce with --bf16 only; the ledger's
    gradient buffer and the data-parallel all-reduce's bytes follow the same rule."""
    assert (grad_bytes("megatron", "bf16"), grad_bytes("megatron", "fp16"), grad_bytes("torch", "bf16")) == (4, 2, 2)
    for precision, per_param in (("bf16", 4), ("fp16", 2)):
        result = small("cluster.data_parallel=2", f"model.precision={precision}", "cluster.overlap_grad_sync=false",
                       "cluster.bucket_size=1PiB")
        moved = result.timeline.query("kind == 'ALL_REDUCE' and stage == 0").bytes.max()
        assert moved == result.stage_costs[0].params * per_param
    assert PRECISIONS["fp16"].grad_bytes == 2


# Recompute, HFU ----------------------------------------------------------------------------------------------------

def test_full_recompute_checkpoints_every_block_under_megatron_and_the_stage_under_torch() -> None:
    """Megatron keeps each block's input and rebuilds one block at a time; torch's pipelining runtime (the executor's
    accounting) keeps the stage input and rebuilds the whole stage's stash."""
    sets = [*SMALL, "schedule.stages=4", "schedule.recompute=full"]  # stage 1 of 4: two blocks, no output layer
    megatron = prepare(load_config(None, sets)).stage_costs()[1]
    torch = prepare(load_config(None, [*sets, "memory.runtime=torch"])).stage_costs()[1]
    layers, block_input = 2, 1024 * 1 * 1024 * 2
    assert megatron.input_bytes == layers * block_input and megatron.rebuilt == megatron.activation_bytes // layers
    assert torch.input_bytes == block_input and torch.rebuilt == torch.activation_bytes


def test_hfu_counts_what_recompute_runs_again() -> None:
    """Full recompute runs each block's forward twice: HFU / MFU = 1 + F / (F + I + W) of the blocks' FLOPs
    (the output layer is not recomputed); selective adds only the attention core's 4 s^2 b h."""
    none, full, selective = (small(f"schedule.recompute={mode}") for mode in ("none", "full", "selective"))
    assert none.hfu == pytest.approx(none.mfu)
    h, s, layers, m = 1024, 1024, 8, 4
    forward = s * h * (24 * h + 4 * s)
    assert full.hardware_flops_per_iteration - full.model_flops_per_iteration == layers * m * forward
    assert selective.hardware_flops_per_iteration - selective.model_flops_per_iteration == layers * m * 4 * s * s * h
    assert full.hfu / full.mfu == pytest.approx(full.hardware_flops_per_iteration / full.model_flops_per_iteration)


# Links' NCCL efficiency -------------------------------------------------------------------------------------------

MACHINE = """name: box
device: a100
gpus: 2
parts: {nvswitch0: nvswitch, nic0: nic, pcie0: pcie}
edges:
- {a: gpu0, b: nvswitch0, kind: nvswitch, bandwidth: 300GB/s, latency: 750ns, efficiency: 0.5}
- {a: gpu1, b: nvswitch0, kind: nvswitch, bandwidth: 300GB/s, latency: 750ns, efficiency: 0.5}
- {a: gpu0, b: pcie0, kind: pcie, bandwidth: 32GB/s, latency: 1us}
- {a: gpu1, b: pcie0, kind: pcie, bandwidth: 32GB/s, latency: 1us}
- {a: pcie0, b: nic0, kind: pcie, bandwidth: 32GB/s, latency: 1us}
fabric: {nic_bandwidth: 100Gbit/s, nic_efficiency: 0.9}
"""


def test_a_machine_file_gives_each_link_its_nccl_efficiency(tmp_path) -> None:
    """``efficiency`` on an edge and ``nic_efficiency`` in the fabric scale the line rate flows get; the built-ins
    carry nccl-tests' measurements; a value outside (0, 1] is one line naming the edge."""
    path = tmp_path / "box.yaml"
    path.write_text(MACHINE)
    graph = load_topology(str(path), 2)
    assert graph.edges["n0.gpu0", "n0.nvswitch0"]["efficiency"] == 0.5
    assert {d["efficiency"] for _, _, d in graph.edges(data=True) if d["kind"] == "nic"} == {0.9}
    assert "efficiency" not in graph.edges["n0.gpu0", "n0.pcie0"]
    dgx = load_topology("dgx-a100", 2)
    assert dgx.edges["n0.gpu0", "n0.nvswitch0"]["efficiency"] == 0.783
    path.write_text(MACHINE.replace("efficiency: 0.5}", "efficiency: 1.5}", 1))
    with pytest.raises(ValueError, match=r"edges\[0\]: efficiency: got 1\.5, expected a fraction of the line rate "
                                         r"in \(0, 1\]"):
        load_topology(str(path))


def test_context_and_hsdp_groups_hold_communicators_of_their_own() -> None:
    """Context parallelism adds its ring's group and reduces gradients over data x context; HSDP reduces over a shard
    group and a replicate group: each a communicator (docs/memory.md, "Beyond the tensors")."""
    assert communicators(1, 2, 1, context=2) == communicators(1, 2, 1) + 2  # the context group, data x context
    assert communicators(1, 1, 4, hybrid=True) == communicators(1, 1, 4) + 1
    assert communicators(2, 2, 2, context=2) == 5  # tensor, pipeline, context, data x context, model parallel
    base = small("cluster.data_parallel=4", "cluster.nodes=2", "parallel.zero=3")
    hsdp = small("cluster.data_parallel=4", "cluster.nodes=2", "parallel.zero=3", "parallel.shard_group=2")
    assert hsdp.memory_overheads.nccl - base.memory_overheads.nccl == NCCL_COMMUNICATOR_BYTES
    plain, cp = small("parallel.tensor=2"), small("parallel.tensor=2", "parallel.context=2")
    assert cp.memory_overheads.nccl - plain.memory_overheads.nccl == 2 * NCCL_COMMUNICATOR_BYTES
