"""The corpus of published runs (``experiments/published/runs.yaml``) and what scoring the simulator on it needs:
each run read and checked, the configs it may have run (one per choice of the settings its source left unstated),
what was measured in the simulator's terms, and the errors (docs/validation.md, "Published runs").

A corpus is a file a user may hand us (``validate --published --corpus FILE``): every key is checked, and a bad one
is a one-line ``ConfigError`` naming the file, the run and the key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipescope.config import ConfigError
from pipescope.simulator.readers.safe_yaml import YamlError, read_yaml_file
from pipescope.simulator.memory_runtime import RUNTIMES
from pipescope.simulator.readers.units import did_you_mean, parse_size, short_repr

CORPUS = Path(__file__).resolve().parent / "published" / "runs.yaml"
GIB = 1 << 30

MEASURES = ("iteration_time_s", "tflops_per_gpu", "samples_per_gpu_per_s", "peak_memory_gib", "peak_memory_gb")
MEMORY_UNITS = {"peak_memory_gib": GIB, "peak_memory_gb": 10**9}  # bytes per unit: as the source counts them
# Inclusive bounds of what a measurement can be, in its own unit: a microsecond to a year an iteration, a GFLOP/s to an
# exaFLOP/s a GPU, a MB to a PB of memory (a typo's 1e-300 s made an error of 10^300 percent)
MEASURE_RANGES = {"iteration_time_s": (1e-6, 3.2e7), "tflops_per_gpu": (1e-3, 1e6),
                  "samples_per_gpu_per_s": (1e-6, 1e9), "peak_memory_gib": (1e-3, 1e6), "peak_memory_gb": (1e-3, 1e6)}
FLOPS_CONVENTIONS = ("megatron-eq3",)
MEMORY_MEASURES = ("allocated", "nvidia-smi")
GRAD_SYNC = ("overlapped", "after-backward")
SOFTWARE_KEYS = {"precision": str, "attention": str, "grad_sync": str, "bucket_size": (str, int),
                 "distributed_optimizer": bool, "tp_comm_overlap": bool, "runtime": str, "cuda_context": (str, int)}
MEMORY_KEYS = ("runtime", "cuda_context")  # software keys that are the config's memory section
SIZES = {"bucket_size", "cuda_context"}  # software keys written as sizes with a unit (25MiB), as the config takes them
SOFTWARE_DEFAULTS = {"precision": "bf16", "attention": "flash", "grad_sync": "overlapped",
                     "distributed_optimizer": False, "tp_comm_overlap": False}
SOURCE_KEYS = {"cite", "settings", "hardware", "flops", "memory_measure", "software", "note"}
RUN_INTS = ("gpus", "tensor", "pipeline", "interleave", "microbatch_size", "global_batch")
UNSTATED_KEYS = ("interleave", "microbatch_size")
RUN_KEYS = {"name", "source", "machine", "model", "schedule", "recompute", "sequence_parallel", "layers_per_stage",
            "unstated", "measured", "note", *RUN_INTS, *SOFTWARE_KEYS}
MODEL_KEYS = ("layers", "hidden", "heads", "seq", "vocab")
MAX_RUNS = 1000
MAX_SIMULATIONS = 4096  # every run times its unstated choices: a few thousand simulations is hours on two cores


@dataclass(frozen=True)
class Source:
    """Where runs come from: its citation, the software its runs used and how it counted FLOPs and memory."""

    name: str
    cite: str
    software: dict[str, Any]
    flops: str | None = None
    memory_measure: str | None = None


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: its source, layout, software and measurement (``measure`` one of ``MEASURES``)."""

    name: str
    source: Source
    machine: str
    gpus: int
    model: dict[str, int]
    tensor: int
    pipeline: int
    microbatch_size: int | None
    global_batch: int
    recompute: str
    measure: str
    value: float
    software: dict[str, Any]
    interleave: int | None = 1
    schedule: str | None = None
    sequence_parallel: bool = False
    layers_per_stage: tuple[int, ...] | None = None
    unstated: dict[str, tuple[int, ...]] = field(default_factory=dict)
    device: int | None = None  # the device whose memory was measured (None: the largest)

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def quantity(self) -> str:
        """``time`` or ``memory``: what the run is scored on."""
        return "memory" if self.measure in MEMORY_UNITS else "time"


def load_corpus(path: str | Path | None = None) -> list[PublishedRun]:
    """The runs of a corpus file (default: the shipped ``published/runs.yaml``).

    Raises:
        ConfigError: one line naming the file, the run or source, the key, the value and what was expected.
    """
    path = Path(path) if path is not None else CORPUS
    where = f"--corpus: {str(path)!r}"
    try:
        raw = read_yaml_file(str(path))
    except YamlError as err:
        raise ConfigError(f"--corpus: {err}", key="--corpus") from None
    if not isinstance(raw, dict) or set(raw) != {"sources", "runs"}:
        got = f"got the keys {', '.join(map(short_repr, raw))}" if isinstance(raw, dict) else f"got {short_repr(raw)}"
        raise ConfigError(f"{where}: {got}, expected a mapping of 'sources' and 'runs'", key="--corpus")
    sources = _sources(raw["sources"], where)
    runs = raw["runs"]
    if not isinstance(runs, list) or not 0 < len(runs) <= MAX_RUNS:
        raise ConfigError(f"{where}: runs: expected a list of 1 to {MAX_RUNS:,} runs", key="--corpus")
    out = [_run(entry, f"{where}: runs[{i}]", sources, path.parent) for i, entry in enumerate(runs)]
    simulations = sum(len(choices(run)) for run in out)
    if simulations > MAX_SIMULATIONS:
        raise ConfigError(f"{where}: runs: {simulations:,} simulations with their unstated choices, expected at most "
                          f"{MAX_SIMULATIONS:,}", key="--corpus")
    names = [run.name for run in out]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"{where}: run name {twice[0]!r} appears twice, expected unique names", key="--corpus")
    return out


def select(runs: list[PublishedRun], names: list[str]) -> list[PublishedRun]:
    """The runs named (a run's name or its source's); all of them when ``names`` is empty.

    Raises:
        ConfigError: a name that is neither, naming what there is.
    """
    if not names:
        return runs
    known = {run.name for run in runs} | {run.source.name for run in runs}
    for name in names:
        if name not in known:
            sources = sorted({run.source.name for run in runs})
            raise ConfigError(f"--published: got {short_repr(name)}, expected a run or a source of the corpus "
                              f"(sources: {', '.join(sources)}){did_you_mean(name, known)}", key="--published")
    return [run for run in runs if run.name in names or run.source.name in names]


def _fail(where: str, key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{where}: {key}: got {short_repr(value)}, expected {expected}", key="--corpus")


def _sources(raw: Any, where: str) -> dict[str, Source]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(where, "sources", raw, "a mapping of source names")
    out = {}
    for name, entry in raw.items():
        at = f"{where}: sources.{short_repr(name)}"
        if not isinstance(entry, dict) or not set(entry) <= SOURCE_KEYS or not isinstance(entry.get("cite"), str):
            raise _fail(at, "keys", entry, f"a mapping with 'cite' and some of {', '.join(sorted(SOURCE_KEYS))}")
        flops, memory = entry.get("flops"), entry.get("memory_measure")
        if flops is not None and flops not in FLOPS_CONVENTIONS:
            raise _fail(at, "flops", flops, f"one of {', '.join(FLOPS_CONVENTIONS)}")
        if memory is not None and memory not in MEMORY_MEASURES:
            raise _fail(at, "memory_measure", memory, f"one of {', '.join(MEMORY_MEASURES)}")
        software = _software(entry.get("software", {}), f"{at}: software")
        out[str(name)] = Source(str(name), entry["cite"], software, flops, memory)
    return out


def _software(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _fail(where, "software", raw, "a mapping")
    for key, value in raw.items():
        if key not in SOFTWARE_KEYS:
            raise _fail(where, str(key), value, f"a key of {', '.join(SOFTWARE_KEYS)}")
        if not isinstance(value, SOFTWARE_KEYS[key]) or (SOFTWARE_KEYS[key] is not bool and isinstance(value, bool)):
            kind = "true or false" if SOFTWARE_KEYS[key] is bool else "a size such as 25MiB" if key in SIZES else \
                "a name"
            raise _fail(where, str(key), value, kind)
    if raw.get("grad_sync", "overlapped") not in GRAD_SYNC:
        raise _fail(where, "grad_sync", raw["grad_sync"], f"one of {', '.join(GRAD_SYNC)}")
    if raw.get("runtime", RUNTIMES[0]) not in RUNTIMES:
        raise _fail(where, "runtime", raw["runtime"], f"one of {', '.join(RUNTIMES)}")
    for key in SIZES & set(raw):  # a number without a unit is bytes, as in the config
        try:
            size = parse_size(str(raw[key]))
        except ValueError:
            size = 0
        if size <= 0:
            raise _fail(where, key, raw[key], "a size such as 1573MiB") from None
    return dict(raw)


def _int(entry: dict, key: str, where: str, required: bool = True) -> int | None:
    value = entry.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40:
        raise _fail(where, key, value, "a positive integer")
    return value


def _run(entry: Any, where: str, sources: dict[str, Source], folder: Path) -> PublishedRun:
    if not isinstance(entry, dict) or not set(entry) <= RUN_KEYS:
        unknown = sorted(set(entry) - RUN_KEYS) if isinstance(entry, dict) else entry
        raise _fail(where, "keys", unknown, f"a mapping of {', '.join(sorted(RUN_KEYS))}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.replace("-", "").replace(".", "").replace("_", "").isalnum():
        raise _fail(where, "name", name, "a name of letters, digits, '-', '.' and '_'")
    where = f"{where} ({name})"
    if entry.get("source") not in sources:
        raise _fail(where, "source", entry.get("source"), f"one of the corpus's sources: {', '.join(sources)}")
    source = sources[entry["source"]]
    ints = {key: _int(entry, key, where, key not in ("interleave", "microbatch_size")) for key in RUN_INTS}
    unstated = _unstated(entry.get("unstated", {}), where)
    for key in UNSTATED_KEYS:  # a value or choices, not both; a plain 1F1B needs no interleave
        given = ints[key] is not None
        if given and key in unstated or not given and key not in unstated and key != "interleave":
            raise _fail(where, key, ints[key], "a value, or choices under 'unstated', not both")
    measure, value, device = _measured(entry.get("measured"), where)
    own = _software({key: entry[key] for key in SOFTWARE_KEYS if key in entry}, where)
    run = PublishedRun(
        name, source, _machine(entry.get("machine"), where, folder), ints["gpus"], _model(entry.get("model"), where),
        ints["tensor"], ints["pipeline"], ints["microbatch_size"], ints["global_batch"],
        _choice(entry, "recompute", ("none", "selective", "full"), where), measure, value,
        {**SOFTWARE_DEFAULTS, **source.software, **own},
        interleave=ints["interleave"] if ints["interleave"] is not None or "interleave" in unstated else 1,
        schedule=_schedule(entry.get("schedule"), where), sequence_parallel=_bool(entry, "sequence_parallel", where),
        layers_per_stage=_layers(entry.get("layers_per_stage"), where), unstated=unstated, device=device)
    if run.gpus % (run.tensor * run.pipeline):
        raise _fail(where, "gpus", run.gpus, f"a multiple of tensor x pipeline = {run.tensor * run.pipeline}")
    if run.quantity == "time" and source.flops is None and measure == "tflops_per_gpu":
        raise _fail(where, "measured", "tflops_per_gpu", f"a source with 'flops' (source {source.name} has none)")
    if run.quantity == "memory" and source.memory_measure is None:
        raise _fail(where, "measured", measure, f"a source with 'memory_measure' (source {source.name} has none)")
    if device is not None and device >= run.pipeline:
        raise _fail(where, "measured.device", device, f"a pipeline device from 0 to {run.pipeline - 1}")
    return run


def _unstated(raw: Any, where: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(raw, dict) or not set(raw) <= set(UNSTATED_KEYS):
        raise _fail(where, "unstated", raw, f"a mapping of {' or '.join(UNSTATED_KEYS)} to choices")
    out = {}
    for key, choices in raw.items():
        if not isinstance(choices, list) or not 0 < len(choices) <= 16 or \
                any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1 << 20 for c in choices):
            raise _fail(where, f"unstated.{key}", choices, "a list of 1 to 16 positive integers")
        out[key] = tuple(choices)
    return out


def _measured(raw: Any, where: str) -> tuple[str, float, int | None]:
    if not isinstance(raw, dict) or not set(raw) <= {*MEASURES, "device"} or \
            len(set(raw) & set(MEASURES)) != 1:
        raise _fail(where, "measured", raw, f"a mapping with one of {', '.join(MEASURES)} (and 'device')")
    measure = next(key for key in raw if key in MEASURES)
    value, (low, high) = raw[measure], MEASURE_RANGES[measure]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _fail(where, f"measured.{measure}", value, f"a number from {low:g} to {high:g}")
    device = raw.get("device")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise _fail(where, "measured.device", device, "a device index")
    return measure, float(value), device


def _machine(value: Any, where: str, folder: Path) -> str:
    """A built-in topology name, or a file in the corpus's folder (no path separators: a corpus names its own)."""
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value.startswith("."):
        raise _fail(where, "machine", value, "a built-in topology or a file name in the corpus's folder")
    return str(folder / value) if value.endswith((".yaml", ".yml", ".graphml")) else value


def _model(raw: Any, where: str) -> dict[str, int | bool]:
    if not isinstance(raw, dict) or not set(MODEL_KEYS) <= set(raw) or set(raw) - set(MODEL_KEYS) - {"embedding_norm"}:
        raise _fail(where, "model", raw, f"a mapping of {', '.join(MODEL_KEYS)} (and embedding_norm, optionally)")
    model: dict[str, int | bool] = {key: _int(raw, key, f"{where}: model") for key in MODEL_KEYS}
    if "embedding_norm" in raw:  # BLOOM's layer norm after the embedding (ModelSpec.embedding_norm)
        if not isinstance(raw["embedding_norm"], bool):
            raise _fail(where, "model.embedding_norm", raw["embedding_norm"], "true or false")
        model["embedding_norm"] = raw["embedding_norm"]
    return model


def _schedule(value: Any, where: str) -> str | None:
    """A built-in schedule's name, or None (1F1B, interleaved where the run interleaves). A corpus is a file a user
    hands us: it names no csv: or torch: file, which would be read from anywhere on the machine."""
    from pipescope.simulator.schedules import ALIASES, GENERATORS

    if value is not None and value not in GENERATORS and value not in ALIASES:
        raise _fail(where, "schedule", value, f"a built-in schedule's name ({', '.join(GENERATORS)}; a corpus names "
                                              f"no csv: or torch: file)")
    return value


def _choice(entry: dict, key: str, choices: tuple[str, ...], where: str) -> str:
    value = entry.get(key)
    if value not in choices:
        raise _fail(where, key, value, f"one of {', '.join(choices)}")
    return value


def _bool(entry: dict, key: str, where: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise _fail(where, key, value, "true or false")
    return value


def _layers(raw: Any, where: str) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not 0 < len(raw) <= 10_000 or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in raw):
        raise _fail(where, "layers_per_stage", raw, "a list of positive integers, one per stage")
    return tuple(raw)


# What was measured, in the simulator's terms ----------------------------------------------------------------------

def megatron_eq3_flops(run: PublishedRun) -> float:
    """FLOPs of one iteration by Narayanan et al. 2021, equation 3 (activation recomputation's extra forward
    counted): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    m, b = run.model, run.global_batch
    s, layers, h, v = m["seq"], m["layers"], m["hidden"], m["vocab"]
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def measured_value(run: PublishedRun) -> float:
    """The measurement as the simulator reports it: seconds per iteration, or bytes of peak memory."""
    if run.measure == "iteration_time_s":
        return run.value
    if run.measure == "tflops_per_gpu":  # the source's FLOPs of an iteration over what every GPU did
        return megatron_eq3_flops(run) / (run.gpus * run.value * 1e12)
    if run.measure == "samples_per_gpu_per_s":
        return run.global_batch / (run.gpus * run.value)
    return run.value * MEMORY_UNITS[run.measure]


# The configs a run may have run ------------------------------------------------------------------------------------

def choices(run: PublishedRun) -> list[dict[str, int]]:
    """Every combination of the run's unstated settings (one empty one when nothing is unstated)."""
    keys = list(run.unstated)
    return [dict(zip(keys, values)) for values in itertools.product(*(run.unstated[key] for key in keys))]


def config_of(run: PublishedRun, chosen: dict[str, int]) -> dict[str, Any]:
    """The config mapping (docs/cli.md's sections) of ``run`` with ``chosen`` unstated settings.

    Raises:
        ConfigError: the layout does not divide (the global batch by data x microbatch size; the GPUs by a node's),
            which the caller names with the run.
    """
    mb = chosen.get("microbatch_size", run.microbatch_size)
    chunks = chosen.get("interleave", run.interleave)
    step = run.data_parallel * mb
    if run.global_batch % step:
        raise ConfigError(f"global_batch {run.global_batch} is not a multiple of data parallel x microbatch size = "
                          f"{step}", key="--published")
    sw = run.software
    schedule = {"name": run.schedule or ("interleaved" if chunks > 1 else "1f1b"), "stages": run.pipeline,
                "microbatches": run.global_batch // step, "recompute": run.recompute}
    if chunks > 1:
        schedule["chunks"] = chunks
    model = {**run.model, "microbatch_size": mb, "precision": sw["precision"], "attention": sw["attention"]}
    if run.layers_per_stage is not None:
        model["layers_per_stage"] = list(run.layers_per_stage)
    cluster: dict[str, Any] = {"topology": run.machine, "nodes": _nodes(run), "data_parallel": run.data_parallel}
    if sw["grad_sync"] == "after-backward":  # one all-reduce of the whole gradient once the backward ends
        cluster |= {"bucket_size": "1PiB", "overlap_grad_sync": False}
    elif "bucket_size" in sw:
        cluster["bucket_size"] = sw["bucket_size"]
    parallel = {"tensor": run.tensor, "sequence": run.sequence_parallel,
                "distributed_optimizer": sw["distributed_optimizer"], "tp_comm_overlap": sw["tp_comm_overlap"]}
    memory = {key: sw[key] for key in MEMORY_KEYS if key in sw}
    return {"schedule": schedule, "model": model, "cluster": cluster, "parallel": parallel, "memory": memory}


def _nodes(run: PublishedRun) -> int:
    from pipescope.topologies.topology_io import load_topology

    per_node = load_topology(run.machine).graph["gpus_per_node"]
    if run.gpus % per_node:
        raise ConfigError(f"gpus {run.gpus} is not a multiple of the {per_node} GPUs of a {Path(run.machine).stem} "
                          f"node", key="--published")
    return run.gpus // per_node


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured
