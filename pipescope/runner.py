"""``pipescope.run``: from a Config to a SimResult. The CLI, sweeps, the planner and notebooks all call it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator

import networkx as nx

from pipescope.config import RANGES, Config, ConfigError, check_config
from pipescope.simulator.costs import (
    AnalyticCosts,
    AnalyticCostsConfig,
    CostError,
    CostModel,
    StageCost,
    UniformCostsConfig,
    seconds_to_ns,
    stage_costs,
)
from pipescope.simulator.ir import Schedule, WeightUpdate
from pipescope.simulator.lowering import has_fsdp_actions, stage_actions
from pipescope.simulator.models import (
    DEFAULT_PRESET,
    MEGATRON_MODEL,
    PRECISIONS,
    PRESETS,
    SHAPE_KEYS,
    ModelSpec,
    layer_work,
    output_layer_flops,
    stage_layers,
)
from pipescope.simulator.engine import Progress
from pipescope.simulator.faults import ComputeFaults
from pipescope.simulator.flows import NetworkError
from pipescope.simulator.gpu_rates import Tiling
from pipescope.simulator.measured_gemms import MeasuredGemms, load_gemms
from pipescope.simulator.memory_overheads import NO_OVERHEADS, Overheads, overheads
from pipescope.simulator.memory import device_params
from pipescope.simulator.memory_runtime import grad_bytes
from pipescope.simulator.network import FifoLinks, Link, Network, link_occupancy_ns, link_transfer_ns
from pipescope.simulator.context import check_context, context_times
from pipescope.simulator.mesh import DeviceMesh
from pipescope.simulator.parallel import ParallelConfig, TensorSplit, check_parallel, stage_times
from pipescope.simulator.profiled import ProfiledCosts, ProfiledCostsConfig
from pipescope.simulator.replicas import SyncError
from pipescope.simulator.result import SimResult
from pipescope.simulator.routed import IdleTimes
from pipescope.simulator.schedules import ALIASES, GENERATORS, build_schedule, generator
from pipescope.simulator.schedules.pipedream import DEFAULT_ITERATIONS
from pipescope.simulator.simulate import simulate
from pipescope.simulator.readers.units import format_bytes, short_repr

from pipescope.topologies.cluster import Cluster, gpu_memory_bytes, rank_ranges
from pipescope.topologies.devices import DeviceSpec
from pipescope.topologies.graphs import topology_names
from pipescope.offload_setup import check_host_memory, check_offload, host_offload
from pipescope.vocab_setup import apply_vocab

# 500k microbatch-stages at 8 devices (1F1B, m = 62,500) took 16 s and 2.0 GB under uniform costs, 104 s and
# 2.3 GB under analytic costs, whose transfers are routed flows (docs/cli.md, "Limits").
MAX_MICROBATCH_STAGES = 500_000


@contextlib.contextmanager
def model_errors(config: Config) -> Iterator[None]:
    """What the cost model, the gradient sync and the network refuse, as the ConfigError naming the key to change
    (a run, the planner's bounds and its refinements alike)."""
    try:
        yield
    except CostError as err:
        offload = " (or cluster.host_memory_bandwidth: the offloaded step runs on the host)" \
            if config.parallel.offloads_optimizer else ""
        raise ConfigError(f"costs: {err}{offload}") from None
    except SyncError as err:
        raise ConfigError(str(err)) from None
    except NetworkError as err:
        raise ConfigError(f"faults.failed_links: {err}; expected a topology where every transfer has a route") from None


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything ``run`` builds before it simulates: the resolved config, the schedule, the cluster, the cost model
    and the model shape (None unless costs are analytic). The planner's bounds read it without simulating."""

    config: Config
    schedule: Schedule
    cluster: Cluster
    costs: CostModel
    model: ModelSpec | None

    def stage_costs(self) -> list[StageCost]:
        with model_errors(self.config):
            return stage_costs(self.costs, self.schedule)

    @property
    def samples_per_iteration(self) -> int:
        """Samples one iteration trains over all replicas (throughput's numerator, as ``run`` passes it)."""
        c = self.config
        return self.schedule.num_microbatches * c.model.microbatch_size * c.cluster.data_parallel

    def network(self) -> Network:
        """The network ``run`` replays over (built anew: a network keeps the state of the flows bound to it)."""
        return _network(self.config, self.cluster, self.costs)

    @property
    def overheads(self) -> Overheads:
        """What each GPU holds besides tensors (``simulator.memory_overheads``): none under uniform or profiled
        costs, which model no GPU process."""
        if self.model is None:
            return NO_OVERHEADS
        m, parallel, data = self.config.memory, self.config.parallel, self.config.cluster.data_parallel
        hybrid = parallel.reduce_group(data) < data  # HSDP: a shard group narrower than the replicas
        return overheads(self.cluster.graph.graph["device"], parallel.tensor, self.schedule.num_devices, data,
                         m.cuda_context, m.nccl_communicator, parallel.context, hybrid)

    @property
    def capacity(self) -> int | None:
        """Bytes per device: ``cluster.memory``, else the GPU's (none under uniform costs, which have no scale)."""
        if self.config.cluster.memory is not None or isinstance(self.config.costs, UniformCostsConfig):
            return self.config.cluster.memory
        return self.cluster.memory_bytes


def prepare(config: Config) -> Prepared:
    """Check ``config`` (by ``load_config``'s rules: it may be built in Python) and build what it names, short of
    simulating.

    Raises:
        ConfigError: a bad section, value or combination, naming the key.
    """
    return prepare_checked(check_config(config))


def prepare_checked(config: Config) -> Prepared:
    """``prepare`` for a config ``load_config`` or ``check_config`` returned: the planner screens thousands, each
    loaded just before, and checking each again cost it about 2% (0.17 of 8.5 ms a candidate).

    Raises:
        ConfigError: a combination only building it shows, naming the key.
    """
    config = _with_precision(config)
    _check_host_cores(config)
    cluster = _precheck(config)
    analytic = isinstance(config.costs, AnalyticCostsConfig)
    model = _model(config) if analytic else None
    _check_parallel(config, model, cluster)
    if model is not None and _generated(config):
        _check_layers(model.layers, config.schedule.p * _chunks(config))  # before building a schedule that big
    schedule = _schedule(config)
    check_offload(config, analytic, schedule.weight_update)
    if config.parallel.zero_stage and schedule.weight_update is not WeightUpdate.FLUSH:
        raise ConfigError(f"{_zero_key(config)} with schedule.name {config.schedule.name}, expected a flush schedule "
                          f"(one synchronous step per iteration, which ZeRO shards)")
    if config.memory.runtime == "deepspeed" and config.parallel.zero_stage >= 2:
        raise ConfigError(f"memory.runtime: got deepspeed, and {_zero_key(config)}; expected parallel.zero 0 or 1 "
                          f"(the runtime counts DeepSpeed's BF16 optimizer, which shards at most the optimizer state)")
    _check_fsdp_actions(config, schedule)
    if cluster is None:  # a CSV schedule: its size was in the file
        _check_size(schedule.num_stages * schedule.total_microbatches * config.cluster.data_parallel)
        cluster = _cluster(config, schedule.num_devices)
    costs = _costs(config, cluster, model, schedule)
    if isinstance(costs, ProfiledCosts):
        config = _with_profile_model(config, costs)
    if not isinstance(config.costs, UniformCostsConfig):
        _check_layers(config.model.layers or model.layers, schedule.pipeline_stages)
    config, schedule, costs = apply_vocab(config, schedule, costs, model)  # schedule.vocab (docs/schedules.md 7)
    if config.parallel.offloads_optimizer:
        with model_errors(config):
            params = device_params(schedule, stage_costs(costs, schedule))
        check_host_memory(config, cluster, params)
    if not isinstance(config.costs, UniformCostsConfig):
        config = _with_layer_split(config, schedule.pipeline_stages)
    return Prepared(_with_what_ran(config, schedule), schedule, cluster, costs, model)


def run(config: Config, progress: Progress | None = None) -> SimResult:
    """Build everything ``config`` names, simulate it, and return the result (which keeps ``config``).

    ``progress``, if given, is called with (entries ended, entries) as the replay goes: ``simulate``'s bar.

    Raises:
        ConfigError: a bad section, value or combination, naming the key (``prepare`` checks it).
        ScheduleError: the schedule is malformed or deadlocks, naming the actions.
    """
    return run_prepared(prepare(config), progress)


def run_prepared(built: Prepared, progress: Progress | None = None) -> SimResult:
    """``run`` on what ``prepare`` built (a caller may swap a part first: validate's measured op times)."""
    config, schedule, cluster, costs, model = built.config, built.schedule, built.cluster, built.costs, built.model
    analytic = model is not None
    try:
        network, faults = _network(config, cluster, costs), _compute_faults(config, cluster)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    p = config.parallel
    host = costs.offload if isinstance(costs, AnalyticCosts) else None  # offloaded weights come up its PCIe share
    sharding = dataclasses.replace(p.sharding(config.cluster.data_parallel),
                                   unit_params=fsdp_unit_params(model, p.tensor),
                                   edge_unit_params=fsdp_unit_params(model, p.tensor, edge=True),
                                   host_rate=host.pcie_rate if host is not None else 0.0)
    sync = config.cluster.grad_sync(sharding)
    with model_errors(config):
        result = simulate(schedule, costs, network, samples_per_microbatch=config.model.microbatch_size,
                          data_parallel=config.cluster.data_parallel, grad_sync=sync,
                          faults=faults, memory_capacity_bytes=built.capacity,
                          model_flops_per_iteration=model_flops(model, config, schedule) if analytic else None,
                          hardware_flops_per_iteration=hardware_flops(model, config, schedule) if analytic else None,
                          peak_flops_per_device=_peak(config, cluster) * config.parallel.gpus_per_device
                          if analytic else None,
                          config=config, memory_runtime=config.memory.runtime,
                          memory_overheads=built.overheads,
                          host_cores=config.cluster.host_cores, progress=progress, fold=config.cluster.fold)
    result.warnings.extend(_idle_settings(config) + _whole_units(config, analytic))
    above = memory_above_gpu(config, cluster.graph)
    if above:
        result.warnings.append(above)
    result.kernels = costs.kernel_report(schedule.pipeline_stages)
    result.cluster_name = cluster.name
    result.cluster_nodes = int(cluster.graph.graph.get("nodes") or config.cluster.nodes)
    result.gpus_per_device = config.parallel.gpus_per_device
    profiled = isinstance(config.costs, ProfiledCostsConfig)  # the profile's model, its sequence resolved
    result.tokens_per_sample = model.seq if analytic else config.model.seq if profiled else None
    result.model_params = model.total_params() if analytic else None
    return result


def fsdp_unit_params(model: ModelSpec | None, tensor: int, edge: bool = False) -> int:
    """One GPU's parameters of a unit ZeRO-2/3 gathers and reduces at a time: a transformer block, or with ``edge``
    the embedding or output layer (each its own unit, as torchtitan wraps them; only the first and last stages hold
    them); 0 without a model (a stage's op)."""
    if model is None:
        return 0
    return -(-(model.vocab * model.hidden if edge else model.layer_params()) // tensor)


def _check_host_cores(config: Config) -> None:
    """``cluster.host_cores`` beside more than one node is refused, naming the key: they are one host's cores."""
    cores, nodes = config.cluster.host_cores, config.cluster.nodes
    if cores is not None and nodes != 1:
        raise ConfigError(f"cluster.host_cores: got {cores} with cluster.nodes {nodes}; expected cluster.nodes 1 "
                          "(the cores of one host, which all its ranks share)")


def _compute_faults(config: Config, cluster: Cluster) -> ComputeFaults | None:
    """Stragglers (by GPU rank, as placed) and jitter, or None on a healthy cluster."""
    slowdown = cluster.slowdown(config.faults)
    if not slowdown and not config.faults.jitter:
        return None
    replica = len(cluster.rank_of) // config.cluster.data_parallel  # devices of one replica
    if isinstance(config.costs, UniformCostsConfig) and max(slowdown, default=0) >= replica:
        device = max(slowdown)
        gpus = rank_ranges(sorted(r + i for r in cluster.rank_of[:replica] for i in range(cluster.tensor)))
        raise ConfigError(f"faults.stragglers: a straggler runs replica {device // replica}'s device "
                          f"{device % replica}, and uniform costs simulate replica 0 only (cluster.data_parallel "
                          f"multiplies its throughput); expected a GPU of replica 0 (GPUs {gpus}), or analytic or "
                          f"profile costs, which simulate every replica")
    return ComputeFaults(slowdown, config.faults.jitter, config.seed)


def _with_precision(config: Config) -> Config:
    """``model.precision`` resolved: the GPU's own when unset, refused when the GPU has no fast path for it.

    A profile's precision is the one it was measured in (ProfiledCosts warns on a mismatch), so it is left alone.
    """
    m = config.model
    if isinstance(config.costs, ProfiledCostsConfig):
        return config
    try:
        device = config.cluster.device()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    precision = m.precision or device.default_precision
    if precision not in device.peak_flops and config.cluster.peak_flops is None:
        gpu = device.name.split("-")[0]  # the family: a machine may carry another memory size than the datasheet's
        raise ConfigError(f"model.precision: got {precision!r}, expected one of {', '.join(device.peak_flops)} on "
                          f"{config.cluster.topology} ({gpu} GPUs have no {precision} tensor cores)")
    return dataclasses.replace(config, model=dataclasses.replace(m, precision=precision))


def _with_profile_model(config: Config, costs: ProfiledCosts) -> Config:
    """Under profiled costs the profile's model is the run's: its shape fills the model section, and a preset or
    dimension that contradicts it is refused (layers and seq may differ: times are per layer and interpolated
    over the measured sequence lengths)."""
    m, measured = config.model, costs.meta.get("model", {})
    family = _model(config).family
    if family != "gpt":  # calibration times GPT blocks (calibration/model.py)
        raise ConfigError(f"model.family: got {family} under costs.kind profile, expected gpt (the profile timed GPT "
                          f"blocks; use analytic costs for a {family} model)")
    if m.embedding_norm:  # calibration's embedding has none, so its bytes and passes would be left out silently
        raise ConfigError("model.embedding_norm: got true under costs.kind profile, expected false (the profile "
                          "timed an embedding without a layer norm; use analytic costs)")
    unknown = [key for key in ("layers", *FIXED_BY_PROFILE) if key not in measured and getattr(m, key) is None]
    if unknown:  # else the default preset's shape would stand in for the measured model's, silently
        raise ConfigError(f"costs.profile: {config.costs.profile!r} has no model.{unknown[0]} in its profile.json; "
                          f"expected the model the profile measured (pipescope calibrate writes it), or set "
                          f"model.{unknown[0]}")
    given = {key: getattr(m, key) for key in FIXED_BY_PROFILE if getattr(m, key) is not None}
    if m.preset is not None:
        given = {key: getattr(_model(config), key) for key in FIXED_BY_PROFILE}
    for key, value in given.items():
        if key in measured and measured[key] != value:
            source = f"model.preset {m.preset!r} has" if getattr(m, key) is None else "got"
            raise ConfigError(f"model.{key}: {source} {value}, but the profile {config.costs.profile!r} measured "
                              f"{key}={measured[key]}; expected the profile's model (leave model.preset and "
                              f"model.{key} unset, or calibrate this model)")
    name = measured.get("name")
    shape = {key: measured.get(key, getattr(m, key)) for key in FIXED_BY_PROFILE}
    model = dataclasses.replace(m, preset=name if name in PRESETS else m.preset, layers=costs.layers, seq=costs.seq,
                                precision=costs.precision, **shape)
    for key in SHAPE_KEYS:  # the config's own limits (docs/cli.md, "Limits"): a profile is a file a user hands us
        low, high = RANGES[f"model.{key}"]
        if not low <= getattr(model, key) <= high:
            raise ConfigError(f"costs.profile: {config.costs.profile!r} measured model.{key}={getattr(model, key)}; "
                              f"expected {low:,} to {high:,}")
    try:
        model.spec()  # heads must divide hidden
    except ValueError as err:
        raise ConfigError(f"costs.profile: {config.costs.profile!r}: {err}") from None
    return dataclasses.replace(config, model=model)


FIXED_BY_PROFILE = ("hidden", "heads", "vocab")


def _with_layer_split(config: Config, num_stages: int) -> Config:
    """``model.layers_per_stage`` checked against the schedule's stage count and the model's layers, and resolved
    (the equal split when unset) so the result's config says which split ran. Analytic and profile costs only:
    uniform costs take no layers (like ``model.layers``, the key is not read there)."""
    m = config.model
    try:
        split = stage_layers(m.layers if m.layers is not None else _model(config).layers, num_stages,
                             m.layers_per_stage)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return dataclasses.replace(config, model=dataclasses.replace(m, layers_per_stage=tuple(split)))


def _model(config: Config) -> ModelSpec:
    try:
        return config.model.spec()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _schedule(config: Config) -> Schedule:
    s = config.schedule
    if s.name.startswith("torch:"):
        return _torch_schedule(s.name[6:], s.p, s.m, _chunks(config))
    try:
        return build_schedule(s, config.iterations)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _torch_schedule(name: str, stages: int, microbatches: int, chunks: int) -> Schedule:
    if importlib.util.find_spec("torch") is None:
        raise ConfigError(f"schedule.name: torch:{name} needs torch: pip install 'pipescope[calibration]'")
    from pipescope.calibration.torch_schedules import torch_schedule

    try:
        return torch_schedule(name, stages, microbatches, chunks)
    except ValueError as err:  # a shape error names its own key (schedule.chunks, ...)
        raise ConfigError(str(err) if str(err).startswith("schedule.") else f"schedule.name: torch:{name}: {err}") \
            from None


def _cluster(config: Config, devices: int) -> Cluster:
    try:
        return config.cluster.build(devices, config.parallel.tensor, config.parallel.context)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _peak(config: Config, cluster: Cluster) -> float:
    """The device's dense peak at the run's precision: ``cluster.peak_flops``, else the datasheet's."""
    return config.cluster.peak_flops or cluster.device_spec.peak_flops[config.model.precision]


def _check_parallel(config: Config, model: ModelSpec | None, cluster: Cluster | None) -> None:
    """The ``parallel`` section, ``schedule.recompute=selective`` and the memory overheads against the model and
    the cost model."""
    kind, analytic = config.costs.kind, isinstance(config.costs, AnalyticCostsConfig)
    if not analytic and config.parallel.tensor > 1:
        raise ConfigError(f"parallel.tensor: got {config.parallel.tensor} under costs.kind {kind}, expected 1 (only "
                          f"analytic costs split the kernels over tensor-parallel GPUs)")
    if not analytic and config.parallel.context > 1:
        raise ConfigError(f"parallel.context: got {config.parallel.context} under costs.kind {kind}, expected 1 (only "
                          f"analytic costs split the tokens over context-parallel GPUs)")
    if isinstance(config.costs, UniformCostsConfig) and config.parallel.zero_stage:
        off = 0 if config.parallel.zero else "false"
        raise ConfigError(f"{_zero_key(config)} under costs.kind {kind}, expected {off} (uniform costs have no model "
                          f"states to shard)")
    if not analytic and config.schedule.recompute == "selective":
        raise ConfigError(f"schedule.recompute: got selective under costs.kind {kind}, expected none or full (only "
                          f"analytic costs separate the attention core)")
    for key in ("cuda_context", "nccl_communicator"):
        if not analytic and getattr(config.memory, key) is not None:
            raise ConfigError(f"memory.{key}: got {getattr(config.memory, key)} under costs.kind {kind}, expected "
                              f"unset (only analytic costs count what a GPU process holds besides tensors)")
    per_node = cluster.graph.graph["gpus_per_node"] if cluster is not None else None
    p = config.parallel
    try:
        check_context(p.context, p.context_comm, p.tensor, model.seq if model else None, config.model.attention,
                      per_node)
        check_parallel(p, model, per_node)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def memory_above_gpu(config: Config, graph: nx.DiGraph) -> str | None:
    """A warning where ``cluster.memory`` is above what the machine's GPU has (out of memory is then judged against
    a memory no GPU of the machine holds), else None."""
    cap, has = config.cluster.memory, gpu_memory_bytes(graph)
    if cap is None or isinstance(config.costs, UniformCostsConfig) or cap <= has:
        return None
    return (f"cluster.memory {format_bytes(cap)} is above the {format_bytes(has)} each {graph.graph['device']} of "
            f"{config.cluster.topology} has: out of memory is judged against {format_bytes(cap)}")


def _idle_settings(config: Config) -> list[str]:
    """Warnings for settings that the rest of the config leaves nothing to act on (they run as if unset)."""
    p, notes = config.parallel, []
    if p.zero_stage and config.cluster.data_parallel < 2:
        notes.append(f"parallel.zero {p.zero_stage} with cluster.data_parallel 1: no replicas to shard over, so "
                     f"every state is whole, as under parallel.zero 0")
    elif p.zero_stage and p.shard_group == 1:
        notes.append(f"parallel.shard_group 1 with parallel.zero {p.zero_stage}: each replica is a shard group of "
                     f"its own, so no state is sharded (each is whole on every GPU)")
    if p.context == 1 and p.context_comm != ParallelConfig.context_comm:
        notes.append(f"parallel.context_comm {p.context_comm} with parallel.context 1: no context parallelism, so "
                     f"no keys or values are exchanged")
    return notes


def _whole_units(config: Config, analytic: bool) -> list[str]:
    """Under costs without FSDP's units (a profile times a stage's ops, not its blocks), ZeRO-2 and 3 hold a stage's
    whole gradients (and weights) beside the shard during each op and gather them at once: say so, as the peak can
    pass ZeRO-1's (docs/parallelism.md, "Units")."""
    p = config.parallel
    if analytic or p.zero_stage < 2 or config.cluster.data_parallel < 2 or p.shard_group == 1:
        return []
    held = "gradients and weights" if p.zero_stage == 3 else "gradients"
    return [f"parallel.zero {p.zero_stage} under costs.kind {config.costs.kind.value}: a stage is one unit (the costs "
            f"time its ops, not its blocks), so each op holds the stage's whole {held} beside its shard and the "
            f"peak can pass parallel.zero 1's; costs.kind analytic splits a stage into FSDP's units"]


def _check_fsdp_actions(config: Config, schedule: Schedule) -> None:
    """Under ZeRO-3, torch's FSDP actions run exactly when ``reshard_after_forward`` is false (docs/parallelism.md,
    "torch's FSDP actions"): the lowering adds them to a compute-only schedule, and a schedule that holds them asks
    for that mode."""
    p = config.parallel
    if p.zero_stage < 3:
        return
    held, name = has_fsdp_actions(schedule), config.schedule.name
    if held and p.reshard_after_forward:
        raise ConfigError(f"parallel.reshard_after_forward: got true, but schedule.name {name} holds torch's UNSHARD/"
                          f"RESHARD/REDUCE_GRAD, which gather a stage's weights once and hold them until RESHARD; "
                          f"expected false")
    if not held and not p.reshard_after_forward and (schedule.is_lowered or stage_actions(schedule)):
        raise ConfigError(f"parallel.reshard_after_forward: got false with schedule.name {name}, a lowered schedule "
                          f"(SEND/RECV cells) or one with torch's REDUCE_GRAD but without its UNSHARD actions; "
                          f"expected a compute-only schedule (the lowering adds them) or one that holds them")


def _zero_key(config: Config) -> str:
    """The key that asked for ZeRO, with its value: ``parallel.zero`` or its older spelling."""
    p = config.parallel
    return f"parallel.zero: got {p.zero}" if p.zero else "parallel.distributed_optimizer: got true"


def _tensor_split(config: Config, cluster: Cluster, model: ModelSpec, schedule: Schedule) -> TensorSplit:
    """Tensor and context parallelism and selective recompute for the analytic costs, with each stage's collective
    times on its device's groups."""
    p, b = config.parallel, config.model.microbatch_size
    split = TensorSplit(p.tensor, p.sequence, config.schedule.recompute == "selective", overlap=p.tp_comm_overlap,
                        context=p.context, context_comm=p.context_comm)
    if p.gpus_per_device < 2:
        return split
    idle = IdleTimes(lambda: cluster.tensor_network(schedule.num_devices, config.seed, config.cluster.collective,
                                                    config.faults),
                     cluster.tensor_gpus(schedule.num_devices), _graph_key(config))
    mesh = DeviceMesh(schedule.num_devices, tensor=p.tensor, context=p.context)
    tokens, width = model.seq * b // p.context, PRECISIONS[config.model.precision].activation_bytes
    devices = list(schedule.stage_to_device)
    try:
        if p.tensor > 1:
            split = dataclasses.replace(split, times=stage_times(idle, mesh, devices, tokens * model.hidden * width,
                                                                 tokens))
        if p.context > 1:
            block = 2 * (model.kv_width // p.tensor) * tokens * width  # one GPU's keys and values
            split = dataclasses.replace(split, context_times=context_times(
                idle, mesh, devices, block, block * p.context, _stage_grad_bytes(config, model, split, schedule)))
    except NetworkError as err:
        raise ConfigError(f"faults.failed_links: {err}; expected a topology where every transfer has a route") from None
    return split


def _graph_key(config: Config) -> tuple | None:
    """What makes the routed network of a built-in machine (``routed.IdleTimes``' key); None for a topology file,
    which may change while a process lives."""
    c = config.cluster
    if c.topology not in topology_names():
        return None
    return (c.topology, c.nodes, c.fabric, c.oversubscription, c.collective, config.faults, config.seed)


def _stage_grad_bytes(config: Config, model: ModelSpec, split: TensorSplit, schedule: Schedule) -> list[int]:
    """Per stage, one GPU's gradient bytes (what its context group all-reduces before the step): its model stage's
    (``Schedule.model_stage``)."""
    try:
        layers = stage_layers(model.layers, schedule.pipeline_stages, config.model.layers_per_stage)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    last = schedule.pipeline_stages - 1
    per_param = grad_bytes(config.memory.runtime, config.model.precision)
    model_stages = map(schedule.model_stage, range(schedule.num_stages))
    return [split.params(model, layers[s], s == 0, s == last) * per_param for s in model_stages]


def _power_headroom(gpu: DeviceSpec, peak: float, precision: str) -> float | None:
    """The GPU's power headroom in FLOP/s, scaled with a ``cluster.peak_flops`` given for another part."""
    if gpu.power_headroom is None or precision not in gpu.peak_flops:
        return None
    return gpu.power_headroom * peak / gpu.peak_flops[precision]


def _costs(config: Config, cluster: Cluster, model: ModelSpec | None, schedule: Schedule) -> CostModel:
    c, m = config.costs, config.model
    if isinstance(c, UniformCostsConfig):
        return c.costs(m.precision)
    if isinstance(c, AnalyticCostsConfig):
        gpu, p, peak = cluster.device_spec, config.parallel, _peak(config, cluster)
        gemms = _measured_gemms(c, m.precision, peak, cluster) if c.gemms else None
        eager = c.eager_efficiency or gpu.eager_efficiency  # None: never measured on this GPU
        return AnalyticCosts(model, peak, m.microbatch_size, m.precision,
                             c.efficiency or gpu.gemm_efficiency, layers_per_stage=m.layers_per_stage,
                             memory_bandwidth=config.cluster.memory_bandwidth or gpu.memory_bandwidth,
                             memory_efficiency=c.memory_efficiency or gpu.memory_efficiency, attention=m.attention,
                             eager_efficiency=eager,
                             split=_tensor_split(config, cluster, model, schedule), tiling=Tiling(gpu.sms),
                             flash=gpu.flash, gemms=gemms, warnings=_gemms_note(gemms, cluster)
                             + _attention_note(m.attention, eager, gpu),
                             misaligned_gemm=gpu.misaligned_gemm, sustained=c.sustained or gpu.sustained,
                             power_headroom=None if c.sustained else _power_headroom(gpu, peak, m.precision),
                             vocab_runtime=config.memory.runtime,
                             grad_bytes=grad_bytes(config.memory.runtime, m.precision),
                             checkpoint_layers=config.memory.runtime in MEGATRON_MODEL,
                             optimizer_shards=p.optimizer_shards(config.cluster.data_parallel),
                             offload=host_offload(config, cluster))
    if not c.profile:
        raise ConfigError("costs.profile: missing, expected a profile folder written by 'pipescope calibrate'")
    try:
        costs = ProfiledCosts.load(c.profile, m.microbatch_size, seq=m.seq, layers=m.layers, precision=m.precision,
                                   layers_per_stage=m.layers_per_stage,
                                   optimizer_shards=config.parallel.optimizer_shards(config.cluster.data_parallel))
    except (OSError, ValueError) as err:
        message = str(err).removeprefix("costs.profile: ")
        raise ConfigError(f"costs.profile: {c.profile!r}: {message}") from None
    costs.warnings += _device_note(costs, cluster)
    if m.attention == "eager":  # the key is not read here (docs/cli.md): say so rather than time flash-like kernels
        costs.warnings.append("model.attention: eager is not read under a profile's costs, which timed what "
                              "'pipescope calibrate' ran (torch's scaled_dot_product_attention)")
    return costs


def _measured_gemms(c: AnalyticCostsConfig, precision: str, peak: float, cluster: Cluster) -> MeasuredGemms:
    """``costs.gemms``'s table, refused when it says a matmul ran faster than the cluster GPU's peak (a table of
    another GPU or precision would price every matmul wrong) or beside ``costs.efficiency``, which it replaces."""
    if c.efficiency is not None:
        raise ConfigError(f"costs.efficiency: got {c.efficiency} with costs.gemms, expected one of the two (the "
                          "table's measured rates replace the large-GEMM efficiency)")
    try:
        gemms = load_gemms(c.gemms, precision)
    except (OSError, ValueError) as err:
        raise ConfigError(f"costs.gemms: {c.gemms!r}: {str(err).removeprefix('costs.gemms: ')}") from None
    shape, rate = gemms.fastest()
    if rate > peak:
        raise ConfigError(f"costs.gemms: {c.gemms!r} measured {' x '.join(map(str, shape))} at {rate / 1e12:.4g} "
                          f"TFLOP/s, above the {precision} peak of cluster.topology {cluster.name}'s GPU "
                          f"({peak / 1e12:.4g}); expected a table measured on that GPU (or set cluster.peak_flops)")
    return gemms


def _gemms_note(gemms: MeasuredGemms | None, cluster: Cluster) -> tuple[str, ...]:
    """A warning when the GEMM table was measured on another device than the cluster's GPU."""
    gpu = cluster.graph.graph["device"]
    if gemms is None or gpu.lower() in gemms.device_name.lower().replace(" ", ""):
        return ()
    return (f"costs.gemms: measured on {short_repr(gemms.device_name)}, the cluster's GPUs are {gpu}s: matmuls run "
            "at the table's rates",)


def _attention_note(attention: str, eager_efficiency: float | None, gpu: DeviceSpec) -> tuple[str, ...]:
    """A warning when the attention's rate on this GPU is not a measurement: flash attention where FlashAttention
    does not run (V100), or eager attention without an eager rate (``eager_efficiency``: the config's or the
    GPU's), whose score kernels then stream at a copy's rate, 13% fast on the A100 where it was measured
    (docs/costs.md, "Rates")."""
    model = gpu.name.split("-")[0]  # V100, not the spec's V100-SXM2-32GB: a p3.16xlarge's have 16 GB
    if attention == "flash" and not gpu.flash_runs:
        return (f"model.attention: flash on {model}, where FlashAttention does not run (it needs sm80 or newer): "
                f"its rate here is the A100's measured one scaled by the two peaks, an estimate; "
                f"model.attention=eager is what a run there does (docs/costs.md, \"Rates\")",)
    if attention != "eager" or eager_efficiency:
        return ()
    return (f"model.attention: eager on {model}, where no measurement of Megatron's eager attention was found: "
            f"its kernels over the s x s scores stream at a copy's rate, which made them 13% fast on the A100 that "
            f"was measured (costs.eager_efficiency sets a fraction; docs/costs.md, \"Eager attention\")",)


def _device_note(costs: ProfiledCosts, cluster: Cluster) -> list[str]:
    """A warning when the profile was measured on another device than the cluster's: a CPU profile without comms
    sends its transfers over the cluster's GPU links, and another GPU's op times are not this one's."""
    device = costs.meta.get("device") if isinstance(costs.meta.get("device"), dict) else {}
    measured_on, name, gpu = device.get("type"), str(device.get("name", "")), cluster.graph.graph["device"]
    if measured_on == "cpu" and costs.comms_fit is None:
        return [f"costs.profile: measured on a CPU ({short_repr(name)}) without comms: its transfers are timed on "
                f"the links of cluster.topology {cluster.name}'s {gpu} GPUs; 'pipescope calibrate-comms' into the "
                f"profile times them on the CPU"]
    if measured_on == "cuda" and gpu.lower() not in name.lower().replace(" ", ""):
        return [f"costs.profile: measured on {short_repr(name)}, the cluster's GPUs are {gpu}s: op times are the "
                f"profile's GPU's, memory and links the cluster's"]
    return []


def _network(config: Config, cluster: Cluster, costs: CostModel) -> Network:
    """Uniform costs: a fixed p2p delay (the plain timing model); a profile with a comms fit: the fit's p2p link
    between every pair (it was measured between two ranks of the machine); otherwise routed, fair-shared flows on
    the cluster's graph."""
    if isinstance(config.costs, UniformCostsConfig):
        _check_no_link_faults(config, "costs.kind=uniform, a fixed p2p delay")
        return FifoLinks.fixed_delay(seconds_to_ns(config.costs.p2p))
    if isinstance(costs, ProfiledCosts) and costs.p2p_link(1) is not None:
        _check_no_link_faults(config, "a comms profile, whose measured p2p fit joins every pair")

        def timing(src: int, dst: int, nbytes: int) -> tuple[int, int]:
            link: Link = costs.p2p_link(nbytes)
            return link_transfer_ns(nbytes, link), link_occupancy_ns(nbytes, link)
        return FifoLinks(timing)
    return cluster.network(config.seed, config.cluster.collective, config.faults)


def _check_no_link_faults(config: Config, network: str) -> None:
    """Link faults act on the cluster's graph; a network without one would ignore them without a word."""
    for key in ("degraded_links", "failed_links"):
        value = getattr(config.faults, key)
        if value.strip():
            raise ConfigError(f"faults.{key}: got {short_repr(value)} under {network}, which has no links to "
                              f"fault; expected costs.kind=analytic, or a profile without comms (routed over "
                              f"cluster.topology)")


def model_flops(model: ModelSpec, config: Config, schedule: Schedule) -> float:
    """Training FLOPs of one iteration (F + I + W of every layer and the output layer), no recompute."""
    work = layer_work(model, config.model.microbatch_size, config.model.precision)
    per_mb = model.layers * (work.forward_flops + work.input_grad_flops + work.weight_grad_flops)
    per_mb += sum(output_layer_flops(model, config.model.microbatch_size))
    return per_mb * schedule.num_microbatches


def hardware_flops(model: ModelSpec, config: Config, schedule: Schedule) -> float:
    """``model_flops`` plus the forward FLOPs recompute runs again: every layer's under full recompute, the
    attention core's (``4 s^2 b h`` per layer) under selective; the output layer is never recomputed."""
    b, recompute = config.model.microbatch_size, config.schedule.recompute
    per_layer = {"full": layer_work(model, b, config.model.precision).forward_flops,
                 "selective": 4.0 * model.seq * model.seq * b * model.hidden}.get(recompute, 0.0)
    return model_flops(model, config, schedule) + per_layer * model.layers * schedule.num_microbatches


def _check_layers(layers: int, stages: int) -> None:
    if layers < stages:
        raise ConfigError(f"model.layers: got {layers}, expected at least one layer per stage "
                          f"(schedule.stages x chunks = {stages})")


def _with_what_ran(config: Config, schedule: Schedule) -> Config:
    """The config with the schedule's size and the model's preset filled in where it left them unset, so that the
    result says what ran. Not the model's shape or the iterations: a config changed from this one with
    ``dataclasses.replace`` (another preset, another schedule) must not keep values that followed from the old one
    (the sweep's table fills those in: ``sweep.resolved_columns``)."""
    s, ran = config.schedule, {"stages": schedule.num_devices, "microbatches": schedule.num_microbatches,
                               "chunks": schedule.chunks}
    config = dataclasses.replace(config, schedule=dataclasses.replace(s, **{
        key: value for key, value in ran.items() if getattr(s, key) is None}))
    m = config.model
    if isinstance(config.costs, UniformCostsConfig) or m.preset is not None or m.from_hf is not None or \
            all(getattr(m, key) is not None for key in SHAPE_KEYS):  # no model read, or named, or custom
        return config
    return dataclasses.replace(config, model=dataclasses.replace(m, preset=DEFAULT_PRESET))


def _generated(config: Config) -> bool:
    """The schedule comes from one of our generators (not a CSV file, not torch)."""
    return not config.schedule.name.startswith(("csv:", "torch:"))


def _chunks(config: Config) -> int:
    """Stages per device the schedule will have: ``schedule.chunks``, else the named schedule's own."""
    s = config.schedule
    if s.chunks is not None:
        return s.chunks
    if s.name.startswith("torch:"):
        from pipescope.calibration.torch_schedules import default_chunks  # stdlib-only until a schedule is built
        try:
            return default_chunks(s.name)
        except ValueError as err:  # canonical_name's, which names schedule.name
            raise ConfigError(str(err)) from None
    known = s.name in GENERATORS or s.name in ALIASES
    return generator(s.name).default_chunks if known else 1


def _precheck(config: Config) -> Cluster | None:
    """Cheap limits first, so an impossible size fails at once instead of after building a huge schedule.

    Returns:
        The cluster, built once here, unless the schedule is a CSV file (its size is in the file).
    """
    s = config.schedule  # iterations against the schedule: config._check_combinations
    if s.name.startswith("csv:"):
        return None
    _check_size(s.p * _chunks(config) * s.m * _iterations(config) * config.cluster.data_parallel)
    return _cluster(config, s.p)


def _check_size(size: int) -> None:
    if size > MAX_MICROBATCH_STAGES:
        raise ConfigError(f"schedule: stages x chunks x microbatches x iterations x data_parallel = {size:,} "
                          f"microbatch-stages, expected at most {MAX_MICROBATCH_STAGES:,} (at 8 devices that many "
                          f"take about 16 s under uniform costs, 104 s under analytic costs)")


def _iterations(config: Config) -> int:
    """Iterations the schedule will run: those asked for, or the generator's default where it runs several."""
    name = config.schedule.name
    takes_iterations = (name in GENERATORS or name in ALIASES) and "iterations" in generator(name).options
    return (config.iterations or DEFAULT_ITERATIONS) if takes_iterations else 1
