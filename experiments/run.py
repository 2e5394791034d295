"""From a Config to a schedule, a cost model, a cluster and a SimResult."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

from pipescope.experiments.config import Config, ConfigError, ScheduleConfig
from pipescope.simulator.costs import AnalyticCosts, CostError, CostModel, UniformCosts
from pipescope.simulator.csvio import read_csv
from pipescope.simulator.ir import Schedule
from pipescope.simulator.models import DEVICES, ModelSpec, layer_work, output_layer_flops, preset
from pipescope.simulator.result import SimResult
from pipescope.simulator.schedules import ALIASES, GENERATORS, generator
from pipescope.simulator.simulate import simulate
from pipescope.topologies.cluster import Cluster, Machine, load_machine


def model_spec(config: Config) -> ModelSpec:
    m = config.model
    try:
        spec = preset(m.preset, layers=m.layers, hidden=m.hidden, heads=m.heads, seq=m.seq, vocab=m.vocab)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    if spec.hidden % spec.heads:
        raise ConfigError(f"model.heads: got {spec.heads}, expected a divisor of model.hidden (={spec.hidden})")
    return spec


def build_schedule(config: Config) -> Schedule:
    """The schedule named by ``schedule.name``: a generator, ``torch:<Name>`` or ``csv:<path>``."""
    s = config.schedule
    if s.name.startswith("csv:"):
        return _csv_schedule(s)
    if s.name.startswith("torch:"):
        return _torch_schedule(s.name[6:], s.p, s.m, s.chunks)
    try:
        gen = generator(s.name)
    except KeyError:
        names = ", ".join(list(GENERATORS) + ["flush", "torch:<Name>", "csv:<path>"])
        raise ConfigError(f"schedule.name: got {s.name!r}, expected one of {names}") from None
    options: dict[str, object] = {}
    if s.vertical_sync:
        if "vertical_sync" not in inspect.signature(gen.build).parameters:
            raise ConfigError(f"schedule.vertical_sync: got true, but only pipedream has it, not {gen.name}")
        options["vertical_sync"] = True
    if config.iterations is not None:
        if "iterations" not in inspect.signature(gen.build).parameters:
            raise ConfigError(f"iterations: got {config.iterations}, but {gen.name} has a flush and simulates "
                              f"one iteration; iterations applies to schedules without a flush")
        options["iterations"] = config.iterations
    try:
        return gen.build(s.p, s.m, chunks=s.chunks, recompute=s.recompute, **options)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _csv_schedule(s: ScheduleConfig) -> Schedule:
    """A CSV schedule. Its size comes from the file; stages or chunks given as well must agree with it,
    microbatches given are the count the checker holds the file to, and recompute applies to it."""
    path = s.name[4:]
    try:
        schedule = read_csv(path, s.microbatches)
    except OSError as err:
        raise ConfigError(f"schedule.name: csv file {path!r} cannot be read ({err.strerror})") from None
    except ValueError as err:
        raise ConfigError(f"schedule.name: csv file {path!r}: {err}") from None
    if s.stages is not None and s.stages != schedule.num_devices:
        raise ConfigError(f"schedule.stages: got {s.stages}, but {path!r} has {schedule.num_devices} devices")
    if s.chunks != 1 and s.chunks != schedule.chunks:
        raise ConfigError(f"schedule.chunks: got {s.chunks}, but {path!r} has {schedule.chunks} per device")
    return replace(schedule, recompute=s.recompute)


def _torch_schedule(name: str, stages: int, microbatches: int, chunks: int) -> Schedule:
    try:
        from pipescope.calibration.torch_schedules import torch_schedule
    except ImportError as err:
        raise ConfigError(f"schedule.name: torch:{name} needs torch installed ({err})") from None
    try:
        return torch_schedule(name, stages, microbatches, chunks)
    except ValueError as err:
        raise ConfigError(f"schedule.name: torch:{name}: {err}") from None


def build_cluster(config: Config, devices: int) -> Cluster:
    c = config.cluster
    try:
        machine = load_machine(c.topology)
        return Cluster(machine, c.nodes, c.placement, devices=devices * c.data_parallel)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def build_costs(config: Config, machine: Machine) -> CostModel:
    c, m = config.costs, config.model
    if c.kind == "uniform":
        return UniformCosts(c.forward, c.backward_input, c.backward_weight, c.p2p, precision=m.precision)
    if c.kind == "profile":
        return _profiled_costs(config)
    return AnalyticCosts(model_spec(config), DEVICES[machine.device], m.microbatch_size, m.precision, c.efficiency)


def _profiled_costs(config: Config) -> CostModel:
    if not config.costs.profile:
        raise ConfigError("costs.profile: missing, expected a profile folder written by 'pipescope calibrate'")
    from pipescope.simulator.profiled import ProfiledCosts
    m = config.model
    try:
        return ProfiledCosts.load(config.costs.profile, m.microbatch_size, seq=m.seq, layers=m.layers,
                                  precision=m.precision)
    except (OSError, ValueError) as err:
        message = str(err).removeprefix("costs.profile: ")
        raise ConfigError(f"costs.profile: {config.costs.profile!r}: {message}") from None


@dataclass
class Run:
    """A configured simulation: its parts and its result."""

    config: Config
    schedule: Schedule
    cluster: Cluster
    costs: CostModel
    result: SimResult


def model_flops(config: Config, microbatches: int) -> float:
    """Training FLOPs of one iteration (F + I + W of every layer and the output layer), no recompute."""
    spec = model_spec(config)
    work = layer_work(spec, config.model.microbatch_size, config.model.precision)
    per_mb = spec.layers * (work.forward_flops + work.input_grad_flops + work.weight_grad_flops)
    per_mb += sum(output_layer_flops(spec, config.model.microbatch_size))
    return per_mb * microbatches


# Each microbatch-stage is 2-3 ops at about 12 us each (pipescope bench): 500k of them take about 15 s.
MAX_MICROBATCH_STAGES = 500_000


def _check_layers(layers: int, stages: int) -> None:
    if layers < stages:
        raise ConfigError(f"model.layers: got {layers}, expected at least one layer per stage "
                          f"(schedule.stages x chunks = {stages})")


def _precheck(config: Config) -> None:
    """Cheap limits first, so an impossible size fails at once instead of after building a huge schedule."""
    s = config.schedule
    if s.name.startswith("csv:"):
        return  # its size is in the file
    known = s.name in GENERATORS or s.name in ALIASES
    chunks = max(s.chunks, generator(s.name).min_chunks) if known else s.chunks
    size = s.p * chunks * s.m * (config.iterations or 3)
    if size > MAX_MICROBATCH_STAGES:
        raise ConfigError(f"schedule: stages x chunks x microbatches x iterations = {size:,} microbatch-stages, "
                          f"expected at most {MAX_MICROBATCH_STAGES:,} (about 15 s of simulation)")
    build_cluster(config, s.p)
    if config.costs.kind == "analytic" and not s.name.startswith("torch:"):
        _check_layers(model_spec(config).layers, s.p * chunks)


def run_config(config: Config) -> Run:
    """Build everything the config names and simulate it."""
    _precheck(config)
    schedule = build_schedule(config)
    cluster = build_cluster(config, schedule.num_devices)
    costs = build_costs(config, cluster.machine)
    if config.costs.kind != "uniform":
        _check_layers(getattr(costs, "layers", None) or model_spec(config).layers, schedule.num_stages)
    device = DEVICES[cluster.machine.device]
    uniform = config.costs.kind == "uniform"
    default_capacity = None if uniform else device.memory_bytes
    capacity = config.cluster.memory if config.cluster.memory is not None else default_capacity
    try:
        result = simulate(schedule, costs, cluster.link, samples_per_microbatch=config.model.microbatch_size,
                          data_parallel=config.cluster.data_parallel, memory_capacity_bytes=capacity)
    except CostError as err:
        raise ConfigError(f"costs: {err}") from None
    if config.costs.kind == "analytic":  # a profile's model need not be the preset's: no MFU then
        result.model_flops_per_iteration = model_flops(config, schedule.num_microbatches)
        result.peak_flops_per_device = device.peak_flops[config.model.precision]
    return Run(config, schedule, cluster, costs, result)
