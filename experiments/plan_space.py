"""The planner's search space: its axes, a candidate, a request, and every candidate of a request
(docs/planner.md, "The search space"). ``experiments/plan.py`` screens and simulates them."""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass, replace
from typing import Any

from pipescope.config import ConfigError
from pipescope.experiments.sweep import validated_config
from pipescope.simulator.costs import CostKind
from pipescope.simulator.mesh import ZERO_STAGES
from pipescope.simulator.offload import OFFLOADS
from pipescope.simulator.schedules import generator, named_generator
from pipescope.simulator.readers.units import short_repr

# The 2BW paper's planner space plus the zero-bubble and V families (issue 14); PipeDream's weight stashing rarely
# fits, but the planner says so rather than leaving it out.
DEFAULT_SCHEDULES = ("2bw", "1f1b", "gpipe", "pipedream", "interleaved", "zb-h1", "zb-v", "v-half")
DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)
PLAN_KEYS = ("schedule", "tensor", "width", "depth", "microbatch_size", "recompute", "sequence", "vocab", "zero",
             "offload", "shard_group", "context")
RECOMPUTE = ("none", "selective", "full")  # schedule.recompute (simulator/parallel.py)
VOCAB_METHODS = ("naive", "redistribute", "vocab-1", "vocab-2", "interlaced")  # simulator/vocab.py VocabMethod
# What every candidate sets (``Candidate.overrides``), so a config file's value for one is not used
CANDIDATE_KEYS = ("schedule.name", "schedule.stages", "schedule.microbatches", "schedule.recompute", "schedule.vocab",
                  "model.microbatch_size", "cluster.data_parallel", "parallel.tensor", "parallel.sequence")
ZERO_KEYS = ("parallel.zero", "parallel.distributed_optimizer")  # what a searched ZeRO stage sets too
OFFLOAD_KEYS = ("parallel.offload",)  # what a searched offload sets
HSDP_KEYS = ("parallel.shard_group",)  # what a searched shard group sets
CONTEXT_KEYS = ("parallel.context",)  # what a searched context degree sets
# The axes searched only when asked: PlanRequest's field (None: not searched) and the config keys it sets
OPTIONAL_AXES = (("zero", ZERO_KEYS), ("offload", OFFLOAD_KEYS), ("shard_groups", HSDP_KEYS),
                 ("context", CONTEXT_KEYS))


@dataclass(frozen=True)
class Candidate:
    """One point of the search: what ``best`` reports (``PLAN_KEYS``)."""

    schedule: str
    tensor: int
    width: int
    depth: int
    microbatch_size: int
    recompute: str  # one of RECOMPUTE
    sequence: bool = False  # sequence parallelism (only with tensor > 1)
    vocab: str = "naive"  # schedule.vocab (docs/schedules.md section 7)
    zero: int | None = None  # parallel.zero; None: not searched (the config's applies, where it means something)
    offload: str | None = None  # parallel.offload; None: not searched
    shard_group: int | None = None  # HSDP's group in replicas (the width: every replica, no HSDP); None: not searched
    context: int | None = None  # parallel.context, GPUs per tensor rank splitting the sequence; None: not searched

    def overrides(self, global_batch: int) -> dict[str, Any]:
        """The dotted config keys this candidate sets (``global_batch`` divisible by width x microbatch size)."""
        keys = {"schedule.name": self.schedule, "schedule.stages": self.depth,
                "schedule.microbatches": global_batch // (self.width * self.microbatch_size),
                "schedule.recompute": self.recompute, "model.microbatch_size": self.microbatch_size,
                "cluster.data_parallel": self.width, "schedule.vocab": self.vocab,
                "parallel.tensor": self.tensor, "parallel.sequence": self.sequence}
        # A base key the search does not vary applies only where it means something (docs/planner.md)
        if not self.sequence:
            keys["parallel.tp_comm_overlap"] = False  # it splits sequence parallelism's collectives
        if self.zero is not None:
            keys.update({"parallel.zero": self.zero, "parallel.distributed_optimizer": False})
        elif not _flushes(self.schedule):
            keys.update({"parallel.zero": 0, "parallel.distributed_optimizer": False})  # it steps no shard
        if self.offload is not None:
            keys["parallel.offload"] = self.offload
        elif not _flushes(self.schedule):
            keys["parallel.offload"] = "none"  # its steps are not one an iteration for the host to take
        if self.context is not None:
            keys["parallel.context"] = self.context
        if self.shard_group is not None:
            keys["parallel.shard_group"] = None if self.shard_group == self.width else self.shard_group
        elif self.zero == 0:
            keys["parallel.shard_group"] = None  # nothing sharded, so no group to shard in
        return keys

    def as_dict(self) -> dict[str, Any]:
        """The plan's keys as the config reads them: no HSDP group (None) where one group holds every replica or
        nothing is sharded."""
        row = {key: getattr(self, key) for key in PLAN_KEYS}
        if self.shard_group is not None and (not self.zero or self.shard_group == self.width):
            row["shard_group"] = None
        return row

    @property
    def run_id(self) -> str:  # the sweep's drain names what a dead worker lost by it
        return ", ".join(f"{key}={value}" for key, value in self.as_dict().items())


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a config mapping (the sections of docs/cli.md: model, cluster with topology, nodes and memory,
    costs) and the search space."""

    base: dict[str, Any]
    global_batch: int
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCH_SIZES
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] | None = None  # ZeRO stages to try; None: not searched
    offload: tuple[str, ...] | None = None  # parallel.offload values to try; None: not searched
    shard_groups: tuple[int, ...] | None = None  # HSDP groups (replicas) to try beside all of them; needs zero
    context: tuple[int, ...] | None = None  # context-parallel degrees to try; None: the config's (1 unless set)
    tensor: tuple[int, ...] = (1, 2, 4, 8)
    sequence: tuple[bool, ...] = (False, True)
    depths: tuple[int, ...] | None = None  # None: every pipeline depth that divides the GPUs
    vocab: tuple[str, ...] = VOCAB_METHODS
    top: int = 5

    def __post_init__(self) -> None:
        # ZB-V, zb-v and an alias are one schedule: the search and its tables use the generator's own name, once
        if isinstance(self.schedules, tuple) and all(isinstance(name, str) for name in self.schedules):
            object.__setattr__(self, "schedules", tuple(dict.fromkeys(map(_generator_name, self.schedules))))


def _generator_name(name: str) -> str:
    """The registered name of the generator ``name`` calls (any case, aliases); an unknown name as given, for
    ``check_request`` to refuse."""
    try:
        return generator(name).name
    except KeyError:
        return name


def _flushes(schedule: str) -> bool:
    """Whether the schedule steps once an iteration (the ones with an ``iterations`` option do not): ZeRO shards only
    such a step."""
    return "iterations" not in named_generator(schedule).options


def planned_cluster(base: dict[str, Any]) -> tuple[int, str, list[str]]:
    """(GPUs, what is planned for: ``gpt-355m on 2 x dgx-a100, 16 a100 GPUs``, warnings: a memory cap above the
    GPU's) of the base config's model on its topology x nodes; ConfigError naming the key if it cannot be built."""
    from pipescope.runner import memory_above_gpu
    from pipescope.topologies.cluster import gpu_nodes
    from pipescope.topologies.topology_io import load_topology

    config = validated_config(base, {})
    cluster = config.cluster
    try:
        graph = load_topology(cluster.topology, cluster.nodes, cluster.fabric, cluster.oversubscription)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    gpus = len(gpu_nodes(graph))
    warnings = [w for w in (memory_above_gpu(config, graph),) if w]
    return gpus, (f"{config.model.label} on {cluster.nodes} x {cluster.topology}, {gpus} {graph.graph['device']} "
                  f"GPUs"), warnings


def _as_flag(values) -> str:
    """Values as the flag takes them: ``1,2,4``, not a Python list."""
    return ",".join(map(str, values))


def candidates(request: PlanRequest, gpus: int) -> list[Candidate]:
    """Every point of the space that uses all ``gpus``, in a fixed order; ConfigError naming the field that leaves
    none (a plan of nothing would only say that nothing fits), or that leaves only data parallelism where the
    space had pipelines: ``vocab`` methods none of the schedules run."""
    out = _points(request, gpus)
    _check_shard_groups(request, out)
    if any(c.depth > 1 for c in out):
        return out
    if out and not any(c.depth > 1 for c in _points(replace(request, vocab=("naive",)), gpus)):
        return out  # only data parallelism was asked for, where the vocabulary method changes nothing
    contexts = _contexts(request)
    per_device = [t * cp for t in request.tensor for cp in contexts if gpus % (t * cp) == 0]
    if not per_device and not any(gpus % cp == 0 for cp in contexts):  # the searched degrees, or the config's
        key, got = ("context", _as_flag(contexts)) if request.context is not None else ("parallel.context", contexts[0])
        raise ConfigError(f"{key}: got {got}, expected a degree that divides the {gpus} GPUs")
    if not per_device:
        raise ConfigError(f"tensor: got {_as_flag(request.tensor)}, expected a width that divides the {gpus} GPUs"
                          + (f" with context {_as_flag(contexts)}" if max(contexts) > 1 else ""))
    tensors = [t for t in request.tensor if gpus % t == 0]
    depths = sorted({gpus // g // w for g in per_device for w in _divisors(gpus // g)})
    if request.depths is not None and not set(request.depths) & set(depths):
        raise ConfigError(f"depths: got {_as_flag(request.depths)}, expected some of {_as_flag(depths)} (the depths "
                          f"that use all {gpus} GPUs at tensor width {_as_flag(tensors)})")
    for key in ("offload", "zero"):  # sharding and offload run with flush schedules and replicas only
        asked, without = getattr(request, key), _points(replace(request, **{key: None}), gpus)
        if asked is not None and (any(c.depth > 1 for c in without) or (without and not out)):
            raise ConfigError(f"{key}: got {_as_flag(asked)}, expected a setting these schedules and widths run "
                              f"(ZeRO and offload need a schedule with a flush and replicas; offload parameters needs "
                              f"ZeRO-3, searched or from the config)")
    raise ConfigError(f"vocab: got {_as_flag(request.vocab)}, expected a method these schedules and widths run "
                      f"({_why_no_vocab(request)})")


def _check_shard_groups(request: PlanRequest, points: list[Candidate]) -> None:
    """ConfigError when none of the asked HSDP groups splits any candidate's replicas into 2 or more groups (each
    would be planned as no HSDP at all, silently)."""
    if request.shard_groups is None:
        return
    if any(c.shard_group is not None and c.shard_group < c.width for c in points):
        return
    widths = sorted({c.width for c in points if c.zero})
    raise ConfigError(f"shard_groups: got {_as_flag(request.shard_groups)}, expected a group size that divides a "
                      f"candidate's replicas into 2 or more groups (the sharded candidates' replicas: "
                      f"{', '.join(map(str, widths)) or 'none'})")


def _why_no_vocab(request: PlanRequest) -> str:
    """Why the asked vocabulary methods run nowhere: a method none of the schedules is defined with, else tensor
    parallelism (the sharded methods split the vocabulary over the pipeline's devices only)."""
    from pipescope.simulator.vocab import vocab_method

    for method in request.vocab:
        refusals = []
        for schedule in request.schedules:
            try:
                vocab_method(method, schedule)
            except ValueError as err:
                refusals.append(str(err))
        if len(refusals) == len(request.schedules):
            return refusals[0]
    return "the sharded methods run without tensor parallelism only"


def _contexts(request: PlanRequest) -> tuple[int, ...]:
    """The context degrees to plan: the searched ones, else the base config's one."""
    return request.context if request.context is not None else (validated_config(request.base, {}).parallel.context,)


def _points(request: PlanRequest, gpus: int) -> list[Candidate]:
    out, contexts = [], _contexts(request)
    # offloaded weights need ZeRO-3: the candidate's, or where the search leaves it the config's
    config_zero = validated_config(request.base, {}).parallel.zero_stage if request.zero is None else None
    for tensor, cp in ((t, cp) for t in request.tensor for cp in contexts):
        if gpus % (tensor * cp):
            continue
        searched_cp = cp if request.context is not None else None
        for width in _divisors(gpus // (tensor * cp)):  # a device is tensor x context GPUs
            depth = gpus // (tensor * cp) // width
            if request.depths is not None and depth not in request.depths:
                continue
            for b in request.microbatch_sizes:
                for name in _schedules_at(depth, request.schedules):
                    out += [Candidate(name, tensor, width, depth, b, r, q, v, z, o, g, searched_cp)
                            for r in request.recompute for q in (request.sequence if tensor > 1 else (False,))
                            for v in _vocab_methods(name, depth, tensor, request.vocab)
                            for z in _zero_stages(name, width, request.zero)
                            for o in _offloads(name, request.offload)
                            if o != "parameters" or (config_zero if z is None else z) == 3
                            for g in _shard_groups(width, z, request.shard_groups)]
    return out


def _zero_stages(schedule: str, width: int, stages: tuple[int, ...] | None) -> list[int | None]:
    """The ZeRO stages that change something: with replicas to shard over and a flush schedule (else stage 0)."""
    if stages is None:
        return [None]
    if width == 1 or not _flushes(schedule):
        return [0] if 0 in stages else []
    return list(stages)


def _offloads(schedule: str, options: tuple[str, ...] | None) -> list[str | None]:
    """The offload settings that run: the host steps a flush schedule's one update an iteration, so the others stay
    on the GPU."""
    if options is None:
        return [None]
    if not _flushes(schedule):
        return ["none"] if "none" in options else []
    return list(options)


def _shard_groups(width: int, zero: int | None, sizes: tuple[int, ...] | None) -> list[int | None]:
    """HSDP's shard groups that change something: every replica (``width``), and each asked size that divides the
    replicas into more than one group, where a stage shards something."""
    if sizes is None:
        return [None]
    if not zero:
        return [width]
    return [width, *sorted({g for g in sizes if g < width and width % g == 0})]


def _vocab_methods(schedule: str, depth: int, tensor: int, methods: tuple[str, ...]) -> list[str]:
    """The vocabulary methods that exist for this schedule (the sharded ones with 1F1B and V-Half only, and not
    with tensor parallelism) and change something (none without pipelining)."""
    from pipescope.simulator.vocab import SHARDED, VocabMethod, vocab_method

    if depth == 1:  # one stage holds the whole vocabulary, whichever method was asked for
        return [VocabMethod.NAIVE.value]
    kept = []
    for method in methods:
        try:
            parsed = vocab_method(method, schedule)
        except ValueError:
            continue
        if not (tensor > 1 and parsed in SHARDED):
            kept.append(method)
    return kept


def _schedules_at(depth: int, schedules: tuple[str, ...]) -> tuple[str, ...]:
    """Without pipelining every schedule is the same data-parallel run: plan it once (as 1F1B when asked for)."""
    if depth > 1:
        return schedules
    return ("1f1b",) if "1f1b" in schedules else schedules[:1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# PlanRequest's fields built in Python: (type of each entry, what to call it); the CLI's flags arrive converted.
FIELD_TYPES = {"schedules": (str, "schedule names"), "microbatch_sizes": (int, "positive integers"),
               "recompute": (str, "recompute names"), "tensor": (int, "positive integers"),
               "sequence": (bool, "booleans"), "depths": (int, "positive integers"), "vocab": (str, "method names"),
               "zero": (int, "ZeRO stages 0 to 3"), "offload": (str, "offload names"),
               "shard_groups": (int, "positive integers"), "context": (int, "positive integers")}


def _check_types(request: PlanRequest) -> None:
    """Each field of the type the planner reads, or a ConfigError naming it: a string where a tuple belongs would
    be read letter by letter, and ``16.5`` as a global batch would leave nothing that divides it."""
    if not isinstance(request.base, dict):
        raise ConfigError(f"base: got {short_repr(request.base)}, expected a mapping of config sections")
    for name in ("global_batch", "top"):
        value = getattr(request, name)
        if not _is_int(value):
            raise ConfigError(f"{name}: got {short_repr(value)} ({type(value).__name__}), expected a positive integer")
    for name, (kind, what) in FIELD_TYPES.items():
        values = getattr(request, name)
        if values is None and name in ("depths", "zero", "offload", "shard_groups", "context"):
            continue
        entries_ok = isinstance(values, (tuple, list)) and all(
            _is_int(v) if kind is int else isinstance(v, kind) for v in values)
        if not entries_ok:
            raise ConfigError(f"{name}: got {short_repr(values)}, expected a tuple of {what}")


def _is_int(value: object) -> bool:
    """An integer, numpy's included, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_request(request: PlanRequest) -> None:
    _check_types(request)
    config = validated_config(request.base, {})
    if config.costs.kind is CostKind.UNIFORM:
        raise ConfigError("costs.kind: got uniform, expected analytic or profile: the planner compares candidates "
                          "by what their model, microbatch size and widths cost, which uniform costs leave out")
    if request.global_batch < 1:
        raise ConfigError(f"global_batch: got {request.global_batch}, expected a positive integer")
    for key, values in (("microbatch_sizes", request.microbatch_sizes), ("tensor", request.tensor),
                        ("depths", request.depths or (1,))):
        if not values or any(v < 1 for v in values):
            raise ConfigError(f"{key}: got {_as_flag(values)}, expected positive integers")
    if not request.schedules:
        raise ConfigError("schedules: got none, expected at least one schedule name")
    if request.zero is not None and (not request.zero or any(z not in ZERO_STAGES for z in request.zero)):
        raise ConfigError(f"zero: got {_as_flag(request.zero)}, expected some of 0, 1, 2, 3")
    if request.offload is not None and (not request.offload or any(o not in OFFLOADS for o in request.offload)):
        raise ConfigError(f"offload: got {_as_flag(request.offload)}, expected some of {', '.join(OFFLOADS)}")
    if request.context is not None and (not request.context or any(cp < 1 for cp in request.context)):
        raise ConfigError(f"context: got {_as_flag(request.context)}, expected positive integers")
    if request.shard_groups is not None:
        if not request.shard_groups or any(g < 2 for g in request.shard_groups):
            raise ConfigError(f"shard_groups: got {_as_flag(request.shard_groups)}, expected group sizes of 2 or more "
                              f"(a group of 1 replica shards nothing)")
        if not any(request.zero or ()):  # (HSDP's groups need a stage above 0)
            raise ConfigError(f"shard_groups: got {_as_flag(request.shard_groups)} without a ZeRO stage to search, "
                              f"expected a ZeRO stage from 1 to 3 searched beside them (HSDP shards within the groups)")
    bad_vocab = [v for v in request.vocab if v not in VOCAB_METHODS]
    if bad_vocab or not request.vocab:
        raise ConfigError(f"vocab: got {_as_flag(request.vocab)}, expected some of {', '.join(VOCAB_METHODS)}")
    bad = [r for r in request.recompute if r not in RECOMPUTE]
    if bad or not request.recompute:
        raise ConfigError(f"recompute: got {_as_flag(request.recompute)}, expected some of {', '.join(RECOMPUTE)}")
    for name in request.schedules:  # a typo fails before any work, not once per candidate
        if name.startswith(("csv:", "torch:")):
            raise ConfigError(f"schedules: got {name!r}, expected generator names (a csv: or torch: schedule has "
                              "its size fixed, so the planner cannot vary its depth or microbatches)")
        try:
            named_generator(name)
        except ValueError as err:
            raise ConfigError(f"schedules: {err}") from None
    if request.top < 1:
        raise ConfigError(f"top: got {request.top}, expected a positive integer")


DEFAULT_TOPOLOGY = "dgx-h100"


def base_config(model: str | None, topology: str | None, nodes: int | None, memory_cap: int | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config mapping of ``pipescope plan``'s flags over ``extra`` (a config file's sections): a flag given
    (not None) overrides the file, a flag not given leaves the file's key, and a key in neither takes the default
    (``gpt-1.3b``, ``DEFAULT_TOPOLOGY``, 1 node, the GPU's memory)."""
    base = copy.deepcopy(extra or {})
    model_section, cluster = base.setdefault("model", {}), base.setdefault("cluster", {})
    if not isinstance(model_section, dict) or not isinstance(cluster, dict):
        return base  # the config's own check names the section
    if model is not None:
        model_section["preset"] = model
        model_section.pop("from_hf", None)  # the flag's model, not the file's
    if topology is not None or "topology" not in cluster:
        cluster["topology"] = topology or DEFAULT_TOPOLOGY
    if nodes is not None or "nodes" not in cluster:
        cluster["nodes"] = nodes or 1
    if memory_cap is not None:
        cluster["memory"] = memory_cap
    return base


def searched_keys(request: PlanRequest) -> tuple[str, ...]:
    """The config keys every candidate sets for itself (``Candidate.overrides``), and those of the axes searched."""
    return CANDIDATE_KEYS + tuple(key for field, keys in OPTIONAL_AXES if getattr(request, field) is not None
                                  for key in keys)


def config_fixed(request: PlanRequest) -> dict[str, Any]:
    """The parallel settings of the request's base config that the search does not set and that change every plan
    (ZeRO, HSDP, offload, context parallelism, and ZeRO-3's and context parallelism's own choices where those run,
    each where it is not its default): each candidate runs with them, and its row does not show them."""
    p = validated_config(request.base, {}).parallel
    zero_3 = 3 in (request.zero or (p.zero_stage,))  # stage 3's own choices matter where it runs
    context = any(cp > 1 for cp in (request.context or (p.context,)))
    fixed = {"parallel.zero": p.zero_stage if request.zero is None and p.zero_stage else None,
             "parallel.shard_group": p.shard_group if request.shard_groups is None else None,
             "parallel.offload": p.offload if request.offload is None and p.offload != "none" else None,
             "parallel.context": p.context if request.context is None and p.context > 1 else None,
             "parallel.reshard_after_forward": False if zero_3 and not p.reshard_after_forward else None,
             "parallel.zero_prefetch": p.zero_prefetch if zero_3 and p.zero_prefetch != 1 else None,
             "parallel.context_comm": p.context_comm if context and p.context_comm != "p2p" else None}
    return {key: value for key, value in fixed.items() if value is not None}


FLUSH_ONLY_KEYS = ("parallel.zero", "parallel.shard_group", "parallel.offload")  # a shard or host step per flush


def config_fixed_not_for(request: PlanRequest) -> list[str]:
    """The searched schedules that run without the config's fixed ZeRO, HSDP or offload (``config_fixed``): those
    that step without a flush (2BW, PipeDream) have no one step an iteration to shard or send to the host."""
    if not any(key in FLUSH_ONLY_KEYS for key in config_fixed(request)):
        return []
    return [name for name in request.schedules if not _flushes(name)]


def file_keys_searched(request: PlanRequest) -> dict[str, Any]:
    """The keys of the request's base config that the search sets (``searched_keys``), with the values they had:
    the search's to set, so the plan says it did not use them."""
    base, out = request.base, {}
    for key in searched_keys(request):
        section, name = key.split(".")
        values = base.get(section)
        if isinstance(values, dict) and name in values:
            out[key] = values[name]
    return out
