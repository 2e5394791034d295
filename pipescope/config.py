"""The experiment config: one frozen dataclass per component, owned by that component, loaded from YAML plus
``--set dotted.key=value`` overrides.

Every error is a ConfigError naming the dotted key, the value and what was expected (``key``, ``value`` and
``expected`` are also attributes); the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from pipescope.simulator.costs import AnalyticCostsConfig, CostKind, UniformCostsConfig
from pipescope.simulator.models import PRECISIONS, ModelConfig
from pipescope.simulator.profiled import ProfiledCostsConfig
from pipescope.simulator.schedules import ScheduleConfig
from pipescope.simulator.units import parse_size, parse_time
from pipescope.topologies.cluster import PLACEMENTS, ClusterConfig


class ConfigError(ValueError):
    """Bad configuration: the message is one line naming key, value and expectation."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key if key is not None else message.split(":", 1)[0]


class StrictLoader(yaml.SafeLoader):
    """safe_load's loader, but a key given twice in one mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


CostsConfig = AnalyticCostsConfig | UniformCostsConfig | ProfiledCostsConfig
COSTS_CONFIGS: dict[str, type] = {CostKind.ANALYTIC: AnalyticCostsConfig, CostKind.UNIFORM: UniformCostsConfig,
                                  CostKind.PROFILE: ProfiledCostsConfig}


@dataclass(frozen=True)
class Config:
    """A whole experiment: each section is the config of the component it configures.

    Build one in Python (``Config(schedule=ScheduleConfig("zb-v", stages=8))``) or from YAML and ``--set`` overrides
    with ``load_config``. docs/cli.md lists every key.
    """

    schedule: ScheduleConfig = ScheduleConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    costs: CostsConfig = AnalyticCostsConfig()
    iterations: int | None = None


POSITIVE = {"schedule.stages", "schedule.microbatches", "schedule.chunks", "model.microbatch_size",
            "cluster.nodes", "cluster.data_parallel", "iterations", "model.layers", "model.hidden", "model.heads",
            "model.seq", "model.vocab", "cluster.memory"}
TIME_KEYS = {"costs.forward", "costs.backward_input", "costs.backward_weight", "costs.p2p"}
MAX_TIME_S = 1e6  # a per-op time beyond 11 days is a typo, and would overflow the integer-ns clock's floats
CHOICES = {
    "schedule.vocab": ("naive",),
    "model.precision": tuple(PRECISIONS),
    "cluster.placement": PLACEMENTS,
}


def _convert_scalar(key: str, kind: type, value: Any, unit: str | None) -> Any:
    if unit == "time":
        return parse_time(value)
    if unit == "size":
        return parse_size(value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if str(value) not in {m.value for m in kind}:
            raise ValueError(f"got {value!r}, expected one of {', '.join(m.value for m in kind)}")
        return kind(str(value))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return str(value).lower() in ("true", "yes", "1", "on")
        raise ValueError(f"got {value!r}, expected true or false")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"-?[0-9]+", str(value)):
            raise ValueError(f"got {value!r}, expected an integer")
        return int(value)
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}, expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"got {value!r}, expected a number") from None
    return str(value)


def _field_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional?) from an annotation such as ``int | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: got {raw!r}, expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"{key}: unknown key, expected one of {', '.join(prefix + f for f in fields)}")
        kind, optional = _field_type(hints[name])
        if name == "costs" and cls is Config:
            values[name] = _build_costs(value, f"{key}.")
        elif dataclasses.is_dataclass(kind):
            values[name] = _build(kind, value, f"{key}.")
        elif value is None and optional:
            values[name] = None
        else:
            try:
                values[name] = _convert_scalar(key, kind, value, fields[name].metadata.get("unit"))
            except ValueError as err:
                raise ConfigError(f"{key}: {err}") from None
            _check_value(key, values[name])
    return cls(**values)


def _build_costs(raw: Any, prefix: str) -> CostsConfig:
    """The costs section: ``kind`` picks the config class. Keys of another kind are valid but not in effect (so
    ``--set costs.kind=uniform`` on a file that sets ``efficiency`` works); keys of no kind are errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"costs: got {raw!r}, expected a mapping of keys")
    kind = str(raw.get("kind", CostKind.ANALYTIC))
    if kind not in COSTS_CONFIGS:
        raise ConfigError(f"{prefix}kind: got {kind!r}, expected one of {', '.join(COSTS_CONFIGS)}")
    known = {f.name for cls in COSTS_CONFIGS.values() for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in known:
            raise ConfigError(f"{prefix}{name}: unknown key, expected one of "
                              f"{', '.join(prefix + f for f in sorted(known))}")
    built = {}  # every value must be valid, also where another kind is in effect
    for name, cls in COSTS_CONFIGS.items():
        own = {f.name for f in dataclasses.fields(cls)} - {"kind"}
        built[name] = _build(cls, {key: value for key, value in raw.items() if key in own}, prefix)
    return built[kind]


def _check_value(key: str, value: Any) -> None:
    if key in POSITIVE and value < 1:
        raise ConfigError(f"{key}: got {value!r}, expected an integer >= 1")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key}: got {value!r}, expected one of {', '.join(CHOICES[key])}")
    if key == "costs.efficiency" and not 0 < value <= 1:
        raise ConfigError(f"{key}: got {value!r}, expected a number in (0, 1]")
    if key in TIME_KEYS and value > MAX_TIME_S:
        raise ConfigError(f"{key}: got {value!r} s, expected at most {MAX_TIME_S:g} s")


def parse_set(item: str) -> tuple[list[str], Any]:
    """``schedule.stages=8`` -> (['schedule', 'stages'], 8); values are read as YAML scalars."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. schedule.stages=8")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
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


def read_yaml(path: str) -> dict:
    """A config file as a mapping; ConfigError if missing, unreadable or not a mapping."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config: {path!r} does not exist or is not a file")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = yaml.load(handle, Loader=StrictLoader)
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config: {path!r} is not readable YAML ({str(err).splitlines()[0]})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path!r} holds {type(raw).__name__}, expected a mapping of sections")
    return raw


def load_config(path: str | None = None, sets: list[str] = (), raw: dict | None = None) -> Config:
    """Defaults, then the YAML file (or ``raw``), then each ``--set`` in order."""
    tree = dict(raw or {}) if path is None else read_yaml(path)
    for item in sets:
        key, value = parse_set(item)
        _merge(tree, key, value)
    return _check_combinations(_build(Config, tree, ""))


def _check_combinations(config: Config) -> Config:
    """Checks that involve more than one key."""
    c = config.costs
    if isinstance(c, UniformCostsConfig) and c.forward + c.backward_input + c.backward_weight == 0:
        raise ConfigError("costs.forward: got 0 with backward_input and backward_weight 0 too, "
                          "expected at least one op time > 0")
    return config
