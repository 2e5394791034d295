"""One call from a schedule, a cost model and a network to a SimResult."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipescope.simulator.check import structure_problems
from pipescope.simulator.collectives import FOR_A_COLLECTIVE
from pipescope.simulator.costs import CostModel, StageCost, check_stage_costs, stage_costs as costs_of
from pipescope.simulator import replicas
from pipescope.simulator.engine import Engine, Progress, RunTimes, gc_paused
from pipescope.simulator.faults import ComputeFaults
from pipescope.simulator.fold import Fold, NotFoldable, spanning_phases
from pipescope.simulator.host_cores import SharedCores
from pipescope.simulator.flows import NetworkError
from pipescope.simulator.ir import Schedule, ScheduleError, WeightUpdate
from pipescope.simulator.lowering import defers_steps, gradient_buffers
from pipescope.simulator.memory_runtime import grad_bytes
from pipescope.simulator.mesh import DeviceMesh, Sharding
from pipescope.simulator.models import PRECISIONS
from pipescope.simulator.network import FifoLinks, Network
from pipescope.simulator.passes import ONE_REPLICA, Lowering, run_passes
from pipescope.simulator.program import Program
from pipescope.simulator.replicas import GradSync
from pipescope.simulator.routed import RoutedNetwork
from pipescope.simulator.result import SimResult, build_result, link_floor_ns
from pipescope.simulator.timeline import replay_timeline


def simulate(schedule: Schedule, costs: CostModel, network: Network | None = None, *, samples_per_microbatch: int = 1,
             data_parallel: int = 1, grad_sync: GradSync | None = None, faults: ComputeFaults | None = None,
             host_cores: int | None = None, progress: Progress | None = None, fold: bool = True,
             **extra: Any) -> SimResult:
    """Check, lower, compile and replay ``schedule``.

    Args:
        schedule: what each device runs, in order (compute-only, or lowered already).
        costs: compute durations and bytes per stage.
        network: moves the data; None means free, instantaneous transfers (the plain timing model with zero p2p).
        samples_per_microbatch: the microbatch size, for throughput.
        data_parallel: pipeline replicas w. With a network and gradients to move, all w replicas are simulated
            (device r*D + d is replica r's device d) with their gradient all-reduces (``simulator.replicas``);
            otherwise they only multiply the throughput.
        grad_sync: bucket size and overlap of the gradient all-reduce (default: DDP's), and the ZeRO stage.
        faults: stragglers and per-op jitter (``simulator.faults``).
        host_cores: the devices are CPU ranks sharing this many cores of one host (``simulator.host_cores``);
            None: every device computes on its own.
        progress: called with (entries ended, entries) as the replay goes (``engine.Progress``): the CLI's bar.
        fold: replay one replica of each kind where replicas are alike (``simulator.fold``), with the same result;
            False: every replica, always.
        **extra: further ``SimResult`` fields: ``memory_capacity_bytes`` (to report OOM),
            ``model_flops_per_iteration`` and ``peak_flops_per_device`` (MFU), ``config`` (what it came from),
            ``memory_runtime`` (whose buffers the ledger counts: ``simulator.memory_runtime``).

    Raises:
        ScheduleError: malformed or deadlocking schedule, naming the actions. Structure is checked first;
            deadlocks are found by the lowering or the engine itself, naming each stuck action.
        NetworkError: a transfer or collective has no route (a failed link), naming it.
    """
    wall = time.perf_counter()
    with gc_paused():
        problems = structure_problems(schedule)
        if problems:
            raise ScheduleError(problems)
        # 2BW with replicas hides its all-reduce behind the next iteration (lowering.add_optimizer_steps)
        deferred = network is not None and defers_steps(schedule.weight_update, data_parallel)
        stage_costs = costs_of(costs, schedule)
        check_stage_costs(stage_costs)
        per_param = grad_bytes(extra.get("memory_runtime", "megatron"), costs.precision)
        grads = [c.params * per_param for c in stage_costs]  # what the ledger holds is what the replicas reduce
        weights = [c.params * PRECISIONS[costs.precision].weight_bytes for c in stage_costs]
        width = data_parallel if network is not None and any(grads) else 1
        sync = grad_sync or GradSync()
        lowered = run_passes(Lowering(schedule, stage_costs, deferred, width, grads, weights, sync, faults))
        schedule, program = lowered.schedule, lowered.program  # the schedule as it ran: with torch's FSDP actions
        network = network or FifoLinks.fixed_delay(0)
        folding = _folding(network, lowered, faults, host_cores, fold) if width > 1 else None
        try:
            shared = SharedCores(len(program.device_steps), host_cores) if host_cores else None
            times = _folded(lowered, network, folding, progress) if folding and folding.fold else None
            if times is None:
                times = Engine(program, network, shared, progress).run()
        except NetworkError as err:
            where = str(err).removesuffix(FOR_A_COLLECTIVE)  # the flow says which
            raise NetworkError(f"{where} for {_flow_name(program, err.flow)}", err.flow) from None
        samples = schedule.num_microbatches * samples_per_microbatch * data_parallel
        records = replay_timeline(program, times, schedule.num_devices * width, schedule.num_devices)
        busiest = network.busiest_link_ns()
        result = build_result(schedule, records, stage_costs, costs.precision, samples,
                              warnings=costs.notes() + _run_notes(schedule),
                              gradient_buffers=gradient_buffers(deferred),
                              sharding=sync.sharding if width > 1 else _unsharded(sync.sharding),
                              busiest_link_ns=busiest, **extra)
    network.report(result)
    if folding is not None:
        result.network["folding"] = folding.summary()
    result.warnings += _link_floor_note(result, busiest)
    result.sim_wall_s = time.perf_counter() - wall
    return result


@dataclass
class _Folding:
    """Whether a run with replicas is folded (``simulator.fold``): the fold while it may be, and why not."""

    replicas: int
    fold: Fold | None
    why_not: str = ""

    def summary(self) -> dict:
        """What the result says: the replicas, how many were replayed, and why every one was where it was."""
        if self.fold is not None:
            return {"replicas": self.replicas, "simulated": len(self.fold.simulated)}
        return {"replicas": self.replicas, "simulated": self.replicas, "why_not": self.why_not}


def _folding(network: Network, lowered: Lowering, faults: ComputeFaults | None, host_cores: int | None,
             wanted: bool) -> _Folding | None:
    """The fold of a run's replicas where nothing breaks their symmetry (``simulator.fold``); None without a routed
    network (its replicas are not simulated apart)."""
    if not isinstance(network, RoutedNetwork):
        return None
    width, sharding = lowered.width, lowered.sync.sharding
    why = ("cluster.fold is false" if not wanted else
           "stragglers or jitter" if faults is not None and (faults.slowdown or faults.jitter) else
           "ranks sharing a host's cores" if host_cores else
           "HSDP's shard groups" if DeviceMesh(lowered.schedule.num_devices, width,
                                               shard=sharding.shards if lowered.sync.sharded else 0).hybrid else "")
    fold = None if why else Fold.of(network.fabric, network.device_endpoints(), lowered.schedule.num_devices, width)
    if fold is None and not why:
        why = "the replicas' servers, their links' bandwidths or the fabric are not the same for every replica"
    return _Folding(width, fold, why)


def _folded(lowered: Lowering, network: RoutedNetwork, folding: _Folding, progress: Progress | None
            ) -> RunTimes | None:
    """The whole run's times from a replay of one replica of each kind, with the collectives over their edges alone,
    and the network's edge statistics those of every replica; None (and why, in ``folding``) where the run turned
    out not to be symmetric, or a flow has no route (the caller then replays every replica, and names that flow in
    the whole run's numbering)."""
    fold, base, program = folding.fold, lowered.base, lowered.program
    network.folding(fold)
    try:
        spanning = (c for c in program.flow_collective[lowered.width * base.num_flows:] if c is not None)
        fold.classify(spanning_phases(((c.kind, c.group, c.nbytes) for c in spanning), network.collectives.choose,
                                      lowered.schedule.num_devices))
        some = replicas.data_parallel(base, lowered.schedule, lowered.width, lowered.grad_bytes, lowered.sync,
                                      lowered.weight_bytes, held=fold.simulated,
                                      units=[c.units for c in lowered.stage_costs])
        times = Engine(some, network, None, progress).run()
    except (NotFoldable, NetworkError) as why:
        folding.fold, folding.why_not = None, str(why)
        return None
    finally:
        network.folding(None)
    fold.expand_stats(network.fabric.stats)
    return fold.expand_times(times, base.num_entries, base.num_flows)


def _flow_name(program: Program, flow: int) -> str:
    """What flow ``flow`` of ``program`` moves: a collective's kind, stage and devices, or a transfer's action."""
    collective = program.flow_collective[flow] if flow < len(program.flow_collective) else None
    if collective is None:
        return str(program.actions[program.flow_of.index(flow)])
    owner = "clipping's norm" if collective.stage < 0 else f"stage {collective.stage}'s"
    return (f"{owner} {collective.kind.name.lower().replace('_', '-')} over devices "
            f"{', '.join(map(str, collective.group))}")


def _link_floor_note(result: SimResult, busiest_link_ns: int) -> list[str]:
    """Where the busiest link's floor set a run's iteration (``result.iteration_times``): which link and why."""
    iterations = result.schedule.iterations
    if iterations <= 1 or not result.links or result.iteration_ns != link_floor_ns(busiest_link_ns, iterations):
        return []
    link = result.links[0]  # the busiest: bytes over bandwidth, as the floor
    per_iteration = link["bytes"] / iterations
    return [f"the iteration is held by its busiest link: {link['src']} > {link['dst']} carries "
            f"{per_iteration / 1e9:.3g} GB an iteration at {link['bandwidth_Bps'] / 1e9:.4g} GB/s, which each "
            f"iteration must in steady state (docs/network.md, \"Data parallelism\")"]


def prepare(schedule: Schedule, costs: CostModel, deferred_steps: bool = False) -> tuple[Program, list[StageCost]]:
    """One pipeline's lowered, compiled program of ``schedule`` under ``costs`` (``passes.ONE_REPLICA``), and the
    per-stage costs it used (``deferred_steps``: ``lowering.add_optimizer_steps``'s ``deferred``)."""
    stage_costs = costs_of(costs, schedule)
    check_stage_costs(stage_costs)
    return run_passes(Lowering(schedule, stage_costs, deferred_steps), ONE_REPLICA).program, stage_costs


def _unsharded(sharding: Sharding) -> Sharding:
    """What one replica's ledger holds with nothing to shard over: no ZeRO, but an optimizer offloaded to the host
    is still not on the GPU (ZeRO-Offload without replicas steps the whole state there)."""
    return Sharding(offload=sharding.offload)


def _run_notes(schedule: Schedule) -> list[str]:
    if schedule.weight_update is not WeightUpdate.FLUSH and schedule.iterations == 1:
        return [f"{schedule.name} has no flush but ran one iteration: there is no steady state, so the iteration "
                f"time is the whole run with fill and drain; use iterations >= 2"]
    return []
