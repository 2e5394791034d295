"""ZeRO-Offload (``parallel.offload: optimizer``, docs/parallelism.md "Offload"): the optimizer state leaves the GPU
to the byte, the step is the gradients' copy down, the host's passes and the weights' copy up at the machine's
PCIe share and host memory rate, and what cannot run says so in one line. ZeRO-Infinity (``parameters``): ZeRO-3's
weight shards leave the GPU too, and each gather waits for its shard's copy up."""

from __future__ import annotations

import math
import subprocess
import sys

import networkx as nx
import pytest

from pipescope import ConfigError, load_config, run
from pipescope.runner import prepare
from pipescope.simulator.offload import pcie_share
from pipescope.topologies.topology_io import load_topology

BASE = ["model.preset=gpt-355m", "model.layers=8", "schedule.stages=2", "schedule.microbatches=4",
        "cluster.topology=dgx-a100", "cluster.nodes=1", "cluster.data_parallel=4", "model.precision=bf16"]


@pytest.mark.parametrize("machine, share", [("dgx-a100", 32e9 / 2), ("dgx-h100", 64e9 / 2),
                                            ("p3.16xlarge", 16e9 / 2), ("pcie-box", 32e9 / 4)])
def test_each_gpu_gets_its_share_of_the_pcie_link_it_shares_to_the_cpu(machine: str, share: float) -> None:
    """Two GPUs behind each PCIe switch of a DGX or a p3 (four in the PCIe box) share the switch's link to the CPU."""
    assert pcie_share(load_topology(machine, 2, None, None)) == share


def test_a_machine_without_a_cpu_on_its_pcie_links_has_no_share() -> None:
    graph = nx.DiGraph()
    graph.add_node("gpu0", kind="gpu", node=0)
    graph.add_node("sw", kind="pcie", node=0)
    graph.add_edge("gpu0", "sw", kind="pcie", bandwidth=1e9)
    assert pcie_share(graph) is None


@pytest.mark.parametrize("zero, width", [(0, 4), (1, 4), (2, 4), (3, 4), (0, 1)])
def test_offload_takes_the_optimizer_state_off_the_gpu_to_the_byte(zero: int, width: int) -> None:
    """Each device's state between steps loses exactly its shard of Adam's 12 bytes a parameter, nothing else; with
    one replica, the whole of it (the ledger once kept it there when there was nothing to shard over)."""
    kept, offloaded = (run(load_config(None, [*BASE, f"parallel.zero={zero}", f"parallel.offload={o}",
                                              f"cluster.data_parallel={width}"]))
                       for o in ("none", "optimizer"))
    shards = 4 if zero else 1
    params_of = [cost.params for cost in prepare(load_config(None, BASE)).stage_costs()]  # a device a stage here
    for device, params in enumerate(params_of):
        lost = kept.devices[device].static_memory_bytes - offloaded.devices[device].static_memory_bytes
        assert lost == 12 * -(-params // shards)
    assert offloaded.peak_memory_bytes < kept.peak_memory_bytes


def test_the_step_is_the_copies_and_the_hosts_passes_at_the_machines_rates() -> None:
    """D2H of the gradients (4 bytes each under Megatron's fp32 gradients) and H2D of the bf16 weights at 16 GB/s a
    GPU; the host's norm, clipping and AdamW over fp32 gradients (4 + 8 + 30 bytes a parameter) at the DGX A100
    host's STREAM rate over its 8 GPUs (topologies/hosts.py: 16 channels of DDR4-3200 at 340/409.6 of it)."""
    built = prepare(load_config(None, [*BASE, "parallel.zero=2", "parallel.offload=optimizer"]))
    host_rate = 16 * 3200e6 * 8 * (340e9 / 409.6e9) / 8
    for cost in built.stage_costs():
        shard = -(-cost.params // 4)
        expected_s = shard * 4 / 16e9 + shard * (4 + 8 + 30) / host_rate + shard * 2 / 16e9
        assert cost.optimizer_ns == pytest.approx(expected_s * 1e9, abs=3)


def test_offloading_lengthens_the_step_and_sharding_shortens_it_again() -> None:
    """The host's step is far slower than the GPU's; ZeRO-2 cuts each GPU's share of it by the replicas."""
    times = {(zero, o): run(load_config(None, [*BASE, f"parallel.zero={zero}", f"parallel.offload={o}"]))
             .iteration_time_s for zero in (0, 2) for o in ("none", "optimizer")}
    assert times[0, "optimizer"] > times[0, "none"]
    assert times[2, "optimizer"] < times[0, "optimizer"]


@pytest.mark.parametrize("sets, expected", [
    (["costs.kind=uniform"], "parallel.offload: got optimizer under costs.kind uniform"),
    (["schedule.name=2bw"], "parallel.offload: got optimizer with schedule.name 2bw, expected a flush schedule"),
    (["cluster.host_memory=1GiB"], "parallel.offload: got optimizer, which needs up to"),
])
def test_what_cannot_offload_is_named(sets: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        run(load_config(None, [*BASE, "parallel.offload=optimizer", *sets]))


def test_the_cli_refuses_an_unknown_offload_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "pipescope.experiments.cli", "simulate", "--set",
                           "parallel.offload=cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pipescope: error: parallel.offload: got 'cpu', expected one of none, optimizer, parameters"]


# ZeRO-Infinity: the weight shards on the host too -----------------------------------------------------------------

INFINITY = [*BASE, "parallel.zero=3", "memory.runtime=torch", "cluster.bucket_size=1PiB"]


def test_offloaded_parameters_leave_the_gpu_and_the_step_keeps_its_weights_on_the_host() -> None:
    """Each device's state between steps loses its shard of the weights (bf16: 2 bytes a parameter) beyond the
    optimizer's offload; the step drops the weights' copy up, which each gather makes instead."""
    optimizer, parameters = (run(load_config(None, [*INFINITY, f"parallel.offload={o}"]))
                             for o in ("optimizer", "parameters"))
    params_of = [cost.params for cost in prepare(load_config(None, INFINITY)).stage_costs()]
    for device, params in enumerate(params_of):
        lost = optimizer.devices[device].static_memory_bytes - parameters.devices[device].static_memory_bytes
        assert lost == 2 * -(-params // 4)
    steps = [prepare(load_config(None, [*INFINITY, f"parallel.offload={o}"])).stage_costs() for o in
             ("optimizer", "parameters")]
    for kept, dropped, params in zip(*steps, params_of):
        assert kept.optimizer_ns - dropped.optimizer_ns == pytest.approx(-(-params // 4) * 2 / 16e9 * 1e9, abs=2)


@pytest.mark.parametrize("reshard", [True, False])
def test_each_gather_waits_for_its_shards_copy_from_the_host(reshard: bool) -> None:
    """The program's weight gathers are the same, each member joining later by its shard's copy at the GPU's PCIe
    share (16 GB/s on a DGX A100); with the run's first gathers too, which start with it (resharding, the first
    unit's; torch's FSDP actions, the stage's)."""
    sets = [*INFINITY, f"parallel.reshard_after_forward={str(reshard).lower()}"]
    built = {o: prepare(load_config(None, [*sets, f"parallel.offload={o}"])) for o in ("optimizer", "parameters")}
    result = {o: run(load_config(None, [*sets, f"parallel.offload={o}"])) for o in built}
    gathers = {o: r.timeline.query("kind == 'ALL_GATHER' and device == 0").sort_values("start_ns")
               for o, r in result.items()}
    assert len(gathers["optimizer"]) == len(gathers["parameters"]) > 0
    first_stage = built["parameters"].stage_costs()[0]
    first_params = first_stage.units[0].params if reshard else first_stage.params
    copy_ns = math.ceil(2 * -(-first_params // 4) * 1e9 / 16e9)  # device 0's shard of what it gathers first
    first = gathers["parameters"].start_ns.iloc[0] - gathers["optimizer"].start_ns.iloc[0]
    assert first == pytest.approx(copy_ns, abs=2)
    assert (gathers["parameters"].start_ns.to_numpy() >= gathers["optimizer"].start_ns.to_numpy()).all()
    # gathering before every op copies every time, where the step copied once; torch's FSDP actions gather once,
    # and that copy moves from the step's end to the run's start, where the later stages' wait for their input hides it
    more = result["parameters"].iteration_time_s > result["optimizer"].iteration_time_s
    assert more is reshard


@pytest.mark.parametrize("sets, expected", [
    (["parallel.zero=2"], "parallel.offload: got parameters with parallel.zero 2 and cluster.data_parallel 4, "
                          "expected parallel.zero 3 and cluster.data_parallel >= 2"),
    (["parallel.zero=3", "cluster.data_parallel=1"], "with parallel.zero 3 and cluster.data_parallel 1"),
    (["parallel.zero=3", "cluster.host_memory=1GiB"], "parallel.offload: got parameters, which needs up to"),
])
def test_what_cannot_offload_its_parameters_is_named(sets: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        run(load_config(None, [*BASE, "parallel.offload=parameters", *sets]))


def test_the_planner_offloads_parameters_only_under_zero_3_and_says_so(cli) -> None:
    from pipescope.experiments.plan_space import PlanRequest, base_config, candidates

    request = PlanRequest(base_config("gpt-355m", "dgx-a100", 1, None, {"model": {"layers": 8}}), 16,
                          schedules=("1f1b",), microbatch_sizes=(2,), tensor=(1,), recompute=("none",),
                          vocab=("naive",), zero=(0, 3), offload=("none", "parameters"))
    points = candidates(request, 8)
    assert {(c.zero, c.offload) for c in points if c.width > 1} == {(0, "none"), (3, "none"), (3, "parameters")}
    code, out, err = cli(["plan", "--model", "gpt-355m", "--topology", "dgx-a100", "--global-batch", "16",
                          "--schedules", "1f1b", "--tensor", "1", "--recompute", "none", "--microbatch-sizes", "2",
                          "--vocab", "naive", "--depths", "1", "--workers", "1", "--no-progress", "--memory-cap",
                          "8GiB", "--zero", "3", "--offload", "parameters"])
    assert code == 0, err
    assert "host+w" in out and "optimizer and weights on the host" in out
