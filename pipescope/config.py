"""The experiment config: one frozen dataclass per component, owned by that component, loaded from YAML plus
``--set dotted.key=value`` overrides.

Every error is a ConfigError naming the dotted key, the value and what was expected (``key``, ``value`` and
``expected`` are also attributes); the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipescope.simulator.context import CONTEXT_COMMS
from pipescope.simulator.offload import OFFLOADS
from pipescope.simulator.costs import MAX_OP_SECONDS, AnalyticCostsConfig, CostKind, UniformCostsConfig
from pipescope.simulator.models import ATTENTIONS, DIMENSION_RANGES, FAMILIES, PRECISIONS, PRESETS, ModelConfig
from pipescope.simulator.parallel import PARALLEL_RANGES, ParallelConfig, parse_recompute
from pipescope.simulator.profiled import ProfiledCostsConfig
from pipescope.simulator.readers.safe_yaml import MAX_INT_DIGITS, YamlError, parse_yaml, read_yaml_file
from pipescope.simulator.schedules import SCHEDULE_RANGES, ScheduleConfig, check_iterations
from pipescope.simulator.readers.units import (did_you_mean, format_bytes, format_rate, parse_bandwidth, parse_flops,
                                               parse_size, parse_time, short_repr)
from pipescope.simulator.vocab import VocabMethod, vocab_method
from pipescope.simulator.faults import FaultsConfig
from pipescope.simulator.memory_runtime import MEMORY_RANGES, RUNTIMES, MemoryConfig
from pipescope.topologies.cluster import CLUSTER_FLOAT_RANGES, CLUSTER_RANGES, COLLECTIVE_ALGORITHMS, ClusterConfig
from pipescope.topologies.graphs import FABRICS


class ConfigError(ValueError):
    """Bad configuration: the message is one line naming key, value and expectation."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key if key is not None else message.split(":", 1)[0]


CostsConfig = AnalyticCostsConfig | UniformCostsConfig | ProfiledCostsConfig
COSTS_CONFIGS: dict[str, type] = {CostKind.ANALYTIC: AnalyticCostsConfig, CostKind.UNIFORM: UniformCostsConfig,
                                  CostKind.PROFILE: ProfiledCostsConfig}


@dataclass(frozen=True)
class Config:
    """A whole experiment: each section is the config of the component it configures.

    Build one in Python (``Config(schedule=ScheduleConfig("zb-v", stages=8))``) or from YAML and ``--set`` overrides
    with ``load_config``; ``pipescope.run`` checks the first by the second's rules (``check_config``). docs/cli.md
    lists every key.
    """

    schedule: ScheduleConfig = ScheduleConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    costs: CostsConfig = AnalyticCostsConfig()
    faults: FaultsConfig = FaultsConfig()
    parallel: ParallelConfig = ParallelConfig()
    memory: MemoryConfig = MemoryConfig()
    iterations: int | None = None
    seed: int = 0


EXPERIMENT_KEYS = ("sweep", "zip")  # experiments.sweep's grid sections: not a config's



def _in_section(section: str, limits: dict[str, tuple]) -> dict[str, tuple]:
    return {f"{section}.{key}": bounds for key, bounds in limits.items()}


# Inclusive (low, high) of every integer key; docs/cli.md "Limits". The highs keep every product the simulator
# forms (bytes, FLOPs, int64 nanoseconds) finite and refuse sizes no machine has before anything is built. Each
# section's own limits sit beside it (its module's ..._RANGES); only the config's top-level keys are here.
RANGES: dict[str, tuple[int, int]] = {
    **_in_section("schedule", SCHEDULE_RANGES), "iterations": (1, 1_000),
    **_in_section("model", DIMENSION_RANGES), "model.microbatch_size": (1, 1 << 20),
    **_in_section("cluster", CLUSTER_RANGES), "seed": (0, (1 << 63) - 1),
    **_in_section("parallel", PARALLEL_RANGES), **_in_section("memory", MEMORY_RANGES),
}
TIME_KEYS = {"costs.forward", "costs.backward_input", "costs.backward_weight", "costs.p2p", "costs.optimizer",
             "costs.vocab_s", "costs.vocab_t"}
CHOICES = {
    "schedule.vocab": tuple(VocabMethod),
    "model.precision": tuple(PRECISIONS),
    "model.preset": tuple(PRESETS),
    "model.attention": ATTENTIONS,
    "model.family": FAMILIES,
    "parallel.context_comm": CONTEXT_COMMS,
    "parallel.offload": OFFLOADS,
    "cluster.fabric": FABRICS,
    "cluster.collective": COLLECTIVE_ALGORITHMS,
    "memory.runtime": RUNTIMES,
}
# Integer-list keys: (low, high) of each entry; a list of more than MAX_LIST_ENTRIES is refused before converting.
LIST_RANGES: dict[str, tuple[int, int]] = {"model.layers_per_stage": (1, 100_000),
                                           "cluster.placement": (0, 999_999_999)}
MAX_LIST_ENTRIES = 100_000  # one entry per stage, and stages x chunks <= model.layers <= 100,000
# Inclusive (low, high) of every float key that is not a time.
FLOAT_RANGES = {**_in_section("cluster", CLUSTER_FLOAT_RANGES), "faults.jitter": (0.0, 1.0)}
# Fractions of a datasheet number a kernel reaches: in (0, 1].
FRACTION_KEYS = {"costs.efficiency", "costs.memory_efficiency", "costs.eager_efficiency", "costs.sustained"}


def _convert_scalar(key: str, kind: type, value: Any, unit: str | None) -> Any:
    if typing.get_origin(kind) is tuple:
        return _convert_ints(key, value)
    if unit == "time":
        return parse_time(value)
    if unit == "size":
        return parse_size(value)
    if unit == "flops":
        return parse_flops(value)
    if unit == "bandwidth":
        return parse_bandwidth(value)
    if unit == "recompute":
        return parse_recompute(value)
    if unit == "ranks" and isinstance(value, (list, tuple)):  # [0, 8, 1, 9] in YAML or Python: '0,8,1,9'
        return ",".join(str(rank) for rank in _convert_ints(key, value))
    is_enum = isinstance(kind, type) and issubclass(kind, enum.Enum)
    choices = [m.value for m in kind] if is_enum else list(CHOICES.get(key, ()))  # a text key's words, if known
    if isinstance(value, bool) and (is_enum or kind is str):
        raise ValueError(_boolean_for_text(value, choices))
    if isinstance(value, (list, tuple, dict)) and (is_enum or kind is str):  # str() would make "['eager']" of it
        shape = "a mapping" if isinstance(value, dict) else "a list"
        raise ValueError(f"got {shape}, {short_repr(value)}, expected "
                         f"{'one of ' + ', '.join(choices) if choices else 'one value'}")
    if is_enum:
        if str(value) not in choices:
            raise ValueError(f"got {short_repr(value)}, expected one of {', '.join(choices)}"
                             f"{did_you_mean(value, choices)}")
        return kind(str(value))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return str(value).lower() in ("true", "yes", "1", "on")
        raise ValueError(f"got {short_repr(value)}, expected true or false")
    if kind is int:  # numbers.Integral: numpy's integers too, from a Python-built config
        if not isinstance(value, (numbers.Integral, str)) or isinstance(value, bool):  # True, 4.0: not text
            raise ValueError(f"got {short_repr(value)} ({type(value).__name__}), expected an integer")
        text = str(value)
        if not re.fullmatch(rf"[-+]?[0-9]{{1,{MAX_INT_DIGITS}}}", text.strip()):  # plain decimal; int64 has 19
            raise ValueError(f"got {short_repr(value)}, expected a plain decimal integer of at most {MAX_INT_DIGITS} "
                             f"digits")
        return int(text)
    if kind is float:
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"got {short_repr(value)}, expected a finite number")
        return number
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def _boolean_for_text(value: bool, choices: list[str]) -> str:
    """The message for a boolean where a word belongs: YAML 1.1 reads an unquoted no, off or yes as one."""
    expected = f"one of {', '.join(choices)}" if choices else "text"
    return (f"got {str(value).lower()}, a boolean (YAML reads an unquoted yes, no, on, off, true or false as one; "
            f"quote the word), expected {expected}")


def _convert_ints(key: str, value: Any) -> tuple[int, ...]:
    """A ``tuple[int, ...]`` key from a YAML list, a comma-separated string (``5,6,6,5``) or one integer; each entry
    a plain decimal integer within ``LIST_RANGES[key]``."""
    low, high = LIST_RANGES[key]
    converted = []
    for index, item in enumerate(_list_items(value)):
        try:
            number = _convert_scalar(key, int, item, None)
        except ValueError:
            number = None
        if number is None or not low <= number <= high:
            shown = short_repr(item) if number is None else number
            raise ValueError(f"got {shown} at entry {index + 1}, expected an integer from {low:,} to {high:,}")
        converted.append(number)
    return tuple(converted)


def _list_items(value: Any) -> list:
    """The entries of a list value, counted before anything is split or converted (at most MAX_LIST_ENTRIES)."""
    sequence = isinstance(value, (list, tuple))  # a tuple: a Python-built config's value (``check_config``)
    count = value.count(",") + 1 if isinstance(value, str) else len(value) if sequence else 1
    if count > MAX_LIST_ENTRIES:
        raise ValueError(f"got {count:,} entries, expected at most {MAX_LIST_ENTRIES:,}")
    items = value.split(",") if isinstance(value, str) else list(value) if sequence else [value]
    if not items or items == [""]:
        raise ValueError(f"got {short_repr(value)}, expected a list of integers such as 5,6,6,5")
    return items


def _field_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) from an annotation such as ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints``, once per config class: it re-evaluates every annotation string on each call, which
    was most of a config load (a sweep validates thousands)."""
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, prefix: str, typed: bool = False) -> Any:
    """``cls`` from a mapping of its keys, each converted and checked. ``typed``: the values come from a config built
    in Python (``check_config``), so each must already be what conversion makes of it."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: got {short_repr(raw)}, expected a mapping of keys")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for name, value in raw.items():
        key = _key(prefix, name)
        if name not in fields and cls is Config and name in EXPERIMENT_KEYS:  # a --set of one: the file's are dropped
            raise ConfigError(f"{key}: a key of experiment files (a grid of runs), not of one config; pipescope sweep "
                              f"runs the grid (docs/sweeps.md)")
        if name not in fields:
            known = [prefix + f for f in fields] + [k for k in PARALLEL_SPELLINGS if k.startswith(prefix) and prefix]
            raise ConfigError(f"{key}: unknown key, expected one of {', '.join(known)}{did_you_mean(key, known)}")
        kind, optional = _field_type(hints[name])
        if name == "costs" and cls is Config:
            values[name] = _build_costs(value, f"{key}.", typed)
        elif dataclasses.is_dataclass(kind):
            values[name] = _build(kind, value, f"{key}.", typed)
        elif value is None and optional:
            values[name] = None
        elif value is None:  # YAML's null, which str() would make the word 'None'
            raise ConfigError(f"{key}: got null, expected a value (leave the key out for its default)")
        else:
            try:
                values[name] = _convert_scalar(key, kind, value, fields[name].metadata.get("unit"))
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
            if typed:
                _check_typed(key, value, values[name])
            _check_value(key, values[name], fields[name].metadata.get("unit"))
    return cls(**values)


def _check_typed(key: str, given: Any, converted: Any) -> None:
    """A Python value must be what YAML's would convert to: text such as '4' or '2ms' is read only from YAML and
    --set, and an int in a float key or a list in a tuple key is the same value. A bool never passes as an integer:
    ``_convert_scalar`` refuses it before this."""
    if given == converted or isinstance(given, list) and tuple(given) == converted or \
            isinstance(given, os.PathLike) and os.fspath(given) == converted or \
            isinstance(given, (list, tuple)) and converted == ",".join(map(str, given)):  # cluster.placement
        return
    # str(4) is no example of a name: only a converted number, list or size shows what to write
    example = "" if given is None or isinstance(converted, str) else f", e.g. {short_repr(converted)}"
    raise ConfigError(f"{key}: got {short_repr(given)} ({type(given).__name__}), expected "
                      f"{type(converted).__name__}{example}")


def _key(prefix: str, name: Any) -> str:
    """The dotted key for messages; quoted and cut short when a hostile file makes it odd (newlines, megabytes)."""
    key = f"{prefix}{name}"
    return key if re.fullmatch(r"[\w.-]{1,60}", key) else short_repr(key)


def _build_costs(raw: Any, prefix: str, typed: bool = False) -> CostsConfig:
    """The costs section: ``kind`` picks the config class. Keys of another kind are valid but not in effect (so
    ``--set costs.kind=uniform`` on a file that sets ``efficiency`` works); keys of no kind are errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"costs: got {short_repr(raw)}, expected a mapping of keys")
    kind = str(raw.get("kind", CostKind.ANALYTIC))
    if kind not in COSTS_CONFIGS:
        raise ConfigError(f"{prefix}kind: got {short_repr(kind)}, expected one of {', '.join(COSTS_CONFIGS)}"
                          f"{did_you_mean(kind, COSTS_CONFIGS)}")
    known = {f.name for cls in COSTS_CONFIGS.values() for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in known:
            raise ConfigError(f"{_key(prefix, name)}: unknown key, expected one of "
                              f"{', '.join(prefix + f for f in sorted(known))}"
                              f"{did_you_mean(_key(prefix, name), [prefix + f for f in known])}")
    built = {}  # every value must be valid, also where another kind is in effect
    for name, cls in COSTS_CONFIGS.items():
        own = {f.name for f in dataclasses.fields(cls)} - {"kind"}
        built[name] = _build(cls, {key: value for key, value in raw.items() if key in own}, prefix, typed)
    return built[kind]


RATE_UNITS = {"bandwidth": ("bandwidth", "B/s"), "flops": ("compute rate", "FLOP/s")}  # unit -> (what, its suffix)
EXAMPLES = {"bandwidth": "'25GB/s' or '100Gbit/s'", "flops": "'989TFLOP/s'"}


def _check_value(key: str, value: Any, unit: str | None = None) -> None:
    if key in RANGES and not RANGES[key][0] <= value <= RANGES[key][1]:
        low, high = RANGES[key]
        if unit == "size":
            hint = " (a number without a unit is bytes: write 16GiB)" if value < low else ""
            raise ConfigError(f"{key}: got {format_bytes(value)}, expected a size from {format_bytes(low)} to "
                              f"{format_bytes(high)}{hint}")
        raise ConfigError(f"{key}: got {short_repr(value)}, expected an integer from {low:,} to {high:,}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key}: got {short_repr(value)}, expected one of {', '.join(CHOICES[key])}"
                          f"{did_you_mean(value, CHOICES[key])}")
    if key in FLOAT_RANGES and not FLOAT_RANGES[key][0] <= value <= FLOAT_RANGES[key][1]:
        low, high = FLOAT_RANGES[key]
        if unit in RATE_UNITS:  # in the unit a user writes it in: '0.0' of a bandwidth reads as bytes/s
            name, suffix = RATE_UNITS[unit]
            raise ConfigError(f"{key}: got {format_rate(value, suffix)}, expected a {name} from "
                              f"{format_rate(low, suffix)} to {format_rate(high, suffix)} (e.g. {EXAMPLES[unit]})")
        raise ConfigError(f"{key}: got {short_repr(value)}, expected a number from {low:g} to {high:g}")
    if key in FRACTION_KEYS and not 0 < value <= 1:
        raise ConfigError(f"{key}: got {short_repr(value)}, expected a number in (0, 1]")
    if key in TIME_KEYS and not (value == 0 or 1e-9 <= value <= MAX_OP_SECONDS):
        raise ConfigError(f"{key}: got {short_repr(value)} s, expected 0 or 1 ns (the clock's resolution) to "
                          f"{MAX_OP_SECONDS:g} s")


def parse_set(item: str) -> tuple[list[str], Any]:
    """``schedule.stages=8`` -> (['schedule', 'stages'], 8); values are read as YAML scalars (plain decimal numbers:
    ``010`` is 10), and a value YAML refuses (``*x``, ``@x``) is kept as the string it is."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"--set {short_repr(item)}: expected dotted.key=value, e.g. schedule.stages=8")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except YamlError:
        value = text
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def config_path(name: str) -> Path:
    """A config file by path, or a shipped example by name (``demo`` is pipescope/configs/demo.yaml).

    Raises:
        ConfigError: neither exists; the message says where both were looked for.
    """
    path = Path(name)
    if path.is_file():
        return path
    shipped = _shipped_configs()
    stem = path.name.removesuffix(".yaml")
    if str(path.parent) == "." and stem in shipped:
        return shipped[stem]
    raise ConfigError(f"--config: {short_repr(name)} is not a file (looked for {os.path.abspath(path)!r}) nor a "
                      f"shipped config, expected a YAML file or one of {', '.join(sorted(shipped))}")


def _shipped_configs() -> dict[str, Path]:
    folder = Path(__file__).parent / "configs"  # package data, installed or in the source tree
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def read_yaml(name: str) -> dict:
    """A config file (see ``config_path``) as a mapping; ConfigError if missing, refused or not a mapping."""
    path = config_path(name)
    suffix = path.suffix.lower()
    other_format = suffix not in ("", ".yaml", ".yml", ".json")  # results.csv, results.parquet: a sweep's tables
    expected = "expected a YAML mapping of sections (schedule:, model:, cluster:, ...; docs/cli.md)"
    try:
        raw = read_yaml_file(str(path))
    except YamlError as err:
        if other_format:  # a binary table fails as bytes that are not text: name its format, not the byte
            raise ConfigError(f"--config: {str(path)!r} is a {suffix[1:].upper()} file, not a YAML config, "
                              f"{expected}") from None
        raise ConfigError(f"--config: {err}") from None
    if raw is None:  # an empty file is more likely a mistake than a wish for the defaults ({} asks for those)
        raise ConfigError(f"--config: {str(path)!r} is empty, expected a mapping of sections ({{}} for the defaults)")
    if not isinstance(raw, dict):
        what = f"is a {suffix[1:].upper()} file, not a YAML config" if other_format else f"holds {type(raw).__name__}"
        raise ConfigError(f"--config: {str(path)!r} {what}, {expected}")
    return _files_beside(raw, path.parent)


# Keys whose value may name a file: a CSV schedule (``csv:FILE``), a profile or GEMM table folder, a topology file.
FILE_KEYS = {"schedule.name": "csv:", "costs.profile": "", "costs.gemms": "", "cluster.topology": "",
             "model.from_hf": ""}
TOPOLOGY_FILES = (".yaml", ".yml", ".graphml")  # any other cluster.topology is a built-in's name


def _files_beside(tree: dict, folder: Path) -> dict:
    """A config file's relative file names made absolute from the file's folder, as a reader of the file expects
    (a ``--set`` value stays the working folder's): in its sections, in its ``sweep``/``zip`` lists of one key,
    and in their lists of whole sections. Absolute, so a sweep's run ids do not depend on the folder it ran from."""
    for section in {key.split(".")[0] for key in FILE_KEYS}:
        _section_beside(section, tree.get(section), folder)
    for grid in EXPERIMENT_KEYS:
        axes = tree.get(grid)
        for key, values in axes.items() if isinstance(axes, dict) else ():
            if not isinstance(values, list):
                continue
            if key in FILE_KEYS:
                axes[key] = [_beside(key, value, folder) for value in values]
            else:  # a whole section swept: each value is a mapping of its keys
                for part in values:
                    _section_beside(key, part, folder)
    return tree


def _section_beside(section: str, part: object, folder: Path) -> None:
    """The file keys of one section's mapping, resolved in place."""
    if not isinstance(part, dict):
        return
    for key in FILE_KEYS:
        owner, name = key.split(".")
        if owner == section and name in part:
            part[name] = _beside(key, part[name], folder)


def _beside(key: str, value: object, folder: Path) -> object:
    prefix = FILE_KEYS[key]
    if not isinstance(value, str) or not value.startswith(prefix):
        return value
    name = value[len(prefix):]
    if not name or (key == "cluster.topology" and not name.lower().endswith(TOPOLOGY_FILES)):
        return value
    return prefix + os.path.abspath(os.path.join(folder, os.path.expanduser(name)))


def load_config(path: str | None = None, sets: list[str] = (), raw: dict | None = None) -> Config:
    """Defaults, then the YAML file (or ``raw``), then each ``--set`` in order."""
    # a str would be read character by character, a dict by its keys
    if not isinstance(sets, (list, tuple)) or not all(isinstance(item, str) for item in sets):
        raise ConfigError(f"sets: got {short_repr(sets)}, expected a list of dotted.key=value texts, e.g. "
                          f"['schedule.stages=8']")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path: got {short_repr(path)} ({type(path).__name__}), expected a file name or None "
                          f"(a mapping of keys goes in raw=)")
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"raw: got {short_repr(raw)} ({type(raw).__name__}), expected a mapping of sections, "
                          f"e.g. {{'schedule': {{'stages': 8}}}}")
    if raw is not None and path is not None:  # one of them would be dropped
        raise ConfigError(f"raw: given beside path {short_repr(os.fspath(path))}, expected one of the two (sets= "
                          f"changes either)")
    tree, spelled = _spelled_tree(path, sets, raw)
    try:
        return _check_combinations(_build(Config, tree, ""))
    except ConfigError as err:  # named as the user wrote it: parallel.data, not the cluster.data_parallel it sets
        if err.key not in spelled:
            raise
        raise ConfigError(spelled[err.key] + str(err)[len(err.key):], key=spelled[err.key]) from None


# Every degree in the parallel section (docs/cli.md, "parallel"): its spelling there -> the key that holds it. Either
# spelling works; one file giving both must give one value.
PARALLEL_SPELLINGS = {"parallel.pipeline": "schedule.stages", "parallel.data": "cluster.data_parallel",
                      "parallel.bucket_size": "cluster.bucket_size",
                      "parallel.overlap_grad_sync": "cluster.overlap_grad_sync"}


def _sections_copied(tree: dict) -> dict:
    """``tree`` with every mapping in it copied (the values shared): what merging writes into is the copy's."""
    return {key: _sections_copied(value) if isinstance(value, dict) else value for key, value in tree.items()}


def _spelled_tree(path: str | None, sets: list[str], raw: dict | None) -> tuple[dict, dict[str, str]]:
    """``config_tree``, and for each key the parallel section's spelling set: that key -> the spelling used."""
    tree = _sections_copied(raw or {}) if path is None else read_yaml(path)  # the sets merge in, not into the caller's
    tree, grid = without_grid(tree)
    if grid:  # as simulate --config does (experiments.cli.config_file), with the note as a warning
        where = "raw" if path is None else os.fspath(path)
        warnings.warn(f"{where}: building its config without its {' and '.join(grid)} grid (pipescope sweep runs the "
                      f"grid, docs/sweeps.md)", stacklevel=3)
    spelled = _hold_at_home(tree)
    for item in sets:
        key, value = parse_set(item)
        dotted = ".".join(key)
        if dotted in PARALLEL_SPELLINGS:  # a later --set of either spelling replaces an earlier value, as for any key
            spelled[PARALLEL_SPELLINGS[dotted]] = dotted
            key = PARALLEL_SPELLINGS[dotted].split(".")
        else:
            spelled.pop(dotted, None)  # the value is now this key's, under its own name
        _merge(tree, key, value)
    _check_zero_spellings(tree)
    return tree, spelled


def _check_zero_spellings(tree: dict) -> None:
    """ConfigError where the parallel section gives ``distributed_optimizer: true`` (the older spelling of
    ``zero: 1``) beside another ZeRO stage: one of the two would be dropped silently. A value neither reads as is
    left to the section's build, which names it."""
    section = tree.get("parallel")
    if not isinstance(section, dict) or "zero" not in section or "distributed_optimizer" not in section:
        return
    try:
        zero = _convert_scalar("parallel.zero", int, section["zero"], None)
        older = _convert_scalar("parallel.distributed_optimizer", bool, section["distributed_optimizer"], None)
    except ValueError:
        return
    if older and zero != 1:
        raise _beside_zero(zero)


def _beside_zero(zero: int) -> ConfigError:
    """``distributed_optimizer: true`` beside another ZeRO stage: one of the two would be dropped."""
    return ConfigError(f"parallel.distributed_optimizer: got true beside parallel.zero {zero}, expected one of them "
                       f"(distributed_optimizer is the older spelling of zero: 1)",
                       key="parallel.distributed_optimizer")


def _hold_at_home(tree: dict) -> dict[str, str]:
    """Moves each of PARALLEL_SPELLINGS a file's parallel section gives to the key that holds it (copying the
    sections it changes: ``raw`` is the caller's); ConfigError naming both when the file gives both, apart."""
    section, spelled = tree.get("parallel"), {}
    if not isinstance(section, dict) or not any(alias.split(".")[1] in section for alias in PARALLEL_SPELLINGS):
        return spelled
    tree["parallel"] = section = dict(section)
    for alias, home in PARALLEL_SPELLINGS.items():
        home_section, home_key = home.split(".")
        target = tree.get(home_section, {})
        if alias.split(".")[1] not in section or not isinstance(target, dict):
            continue  # not given, or a section that is no mapping: _build names it
        value = section.pop(alias.split(".")[1])
        if home_key in target and target[home_key] != value:
            raise ConfigError(f"{alias}: got {short_repr(value)} beside {home} {short_repr(target[home_key])}, "
                              f"expected one of them (both name the same setting)", key=alias)
        tree[home_section] = {**target, home_key: value}
        spelled[home] = alias
    return spelled


def without_grid(tree: dict) -> tuple[dict, list[str]]:
    """An experiment file's mapping without its grid (``sweep``, ``zip``), and the grid keys it had: the config
    every run of the grid starts from."""
    return {key: value for key, value in tree.items() if key not in EXPERIMENT_KEYS}, \
        [key for key in EXPERIMENT_KEYS if key in tree]


def check_config(config: Config) -> Config:
    """``config``, built in Python, checked by ``load_config``'s rules and returned as ``load_config`` would build it
    from the same values (``efficiency=1`` becomes 1.0), so both paths run alike.

    Raises:
        ConfigError: a section of the wrong class, a value of the wrong type, or any value or combination
            ``load_config`` refuses, naming the dotted key.
    """
    built = _check_combinations(_build(Config, _section_tree(config, Config, ""), "", typed=True))
    if type(built.costs) is not type(config.costs):  # kind picks the class from a mapping: it must agree here
        raise ConfigError(f"costs.kind: got {short_repr(config.costs.kind)} in {type(config.costs).__name__}, "
                          f"expected {type(config.costs)().kind.value} (leave kind unset)")
    return built


def _section_tree(section: Any, kind: Any, key: str) -> dict:
    """A Python-built section as the mapping ``_build`` takes, each section checked to be of its class first (a str
    where a ScheduleConfig belongs would otherwise fail deep inside the run). ``kind``: a class or a union of them;
    ``key``: the section's dotted key, "" for the whole config."""
    if not isinstance(section, kind):
        classes = " or ".join(c.__name__ for c in typing.get_args(kind) or (kind,))
        raise ConfigError(f"{key or 'config'}: got {short_repr(section)}, expected {classes}", key=key or "config")
    tree = {field.name: getattr(section, field.name) for field in dataclasses.fields(section)}
    for name, hint in _subsections(type(section)).items():
        tree[name] = _section_tree(tree[name], hint, f"{key}.{name}" if key else name)
    return tree


@functools.cache
def _subsections(cls: type) -> dict[str, Any]:
    """Field name -> the class (or union of classes) of each field of ``cls`` that is a section; once per class, as
    ``_type_hints``: each run checks its config."""
    hints = _type_hints(cls)
    return {name: hint for name, hint in hints.items()
            if any(dataclasses.is_dataclass(c) for c in typing.get_args(hint) or (hint,))}


def config_tree(path: str | None = None, sets: list[str] = (), raw: dict | None = None) -> dict:
    """The YAML file (or ``raw``) with each ``--set`` merged in, as a mapping not yet checked (the planner varies
    keys of it before ``load_config(raw=...)`` checks each point), every degree at the key that holds it."""
    return _spelled_tree(path, sets, raw)[0]


def _check_combinations(config: Config) -> Config:
    """Checks that involve more than one key."""
    c = config.costs
    if isinstance(c, UniformCostsConfig) and c.forward + c.backward_input + c.backward_weight == 0:
        raise ConfigError("costs.forward: got 0 with backward_input and backward_weight 0 too, "
                          "expected at least one op time > 0")
    try:  # schedule.vocab and iterations against schedule.name, so a sweep refuses them before running
        vocab_method(config.schedule.vocab, config.schedule.name)  # docs/schedules.md section 7
        check_iterations(config.schedule.name, config.iterations)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    p = config.parallel
    if p.distributed_optimizer and p.zero > 1:  # a Config built in Python: zero 0 is its default, so only 2 and 3
        raise _beside_zero(p.zero)
    _check_sharding(config)
    return config


def _check_sharding(config: Config) -> None:
    """``parallel.shard_group`` (HSDP) needs ZeRO and must divide the replicas, ZeRO-3's own choices need ZeRO-3, and
    offloaded weights need ZeRO-3 over replicas, naming the key otherwise."""
    p = config.parallel
    if p.offloads_parameters and (p.zero_stage < 3 or config.cluster.data_parallel < 2):
        raise ConfigError(f"parallel.offload: got parameters with parallel.zero {p.zero_stage} and "
                          f"cluster.data_parallel {config.cluster.data_parallel}, expected parallel.zero 3 and "
                          f"cluster.data_parallel >= 2 (the host holds ZeRO-3's weight shards, which its gathers "
                          f"fetch)")
    for key, value, default in (("zero_prefetch", p.zero_prefetch, 1),
                                ("reshard_after_forward", p.reshard_after_forward, True)):
        if value != default and p.zero_stage < 3:
            raise ConfigError(f"parallel.{key}: got {str(value).lower()} with parallel.zero {p.zero_stage}, expected "
                              f"parallel.zero 3 (only ZeRO-3 gathers the weights it sets)")
    if p.zero_prefetch != 1 and not p.reshard_after_forward:
        raise ConfigError(f"parallel.zero_prefetch: got {p.zero_prefetch} with parallel.reshard_after_forward false, "
                          f"expected 1 (without resharding, torch's UNSHARD actions gather each stage once: there is "
                          f"no gather per op to issue ahead)")
    group, width = p.shard_group, config.cluster.data_parallel
    if group is None:
        return
    if not config.parallel.zero_stage:
        raise ConfigError(f"parallel.shard_group: got {group} with parallel.zero 0, expected parallel.zero 1 to 3 "
                          f"(the group shards ZeRO's states)")
    if width % group:
        raise ConfigError(f"parallel.shard_group: got {group}, expected a divisor of cluster.data_parallel "
                          f"(={width}): each shard group holds one whole set of shards")
