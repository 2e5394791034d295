"""Hostile configs, ``--set`` values and machine files: each gives a right answer or a one-line error naming the key
or file, never a traceback, and nothing grows past the documented limits (docs/cli.md, "Limits").

The property-based tests generate the classes the hostile-input issue found (huge integers, NaN and infinity,
YAML 1.1 number spellings, aliases, complex keys, deep nesting, undecodable bytes) rather than listing cases.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipescope.config import Config, ConfigError, load_config
from pipescope.runner import run
from pipescope.simulator.ir import ScheduleError
from pipescope.simulator.safe_yaml import MAX_YAML_BYTES, YamlError, parse_yaml
from pipescope.topologies.cluster import load_machine

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = ["costs.kind=uniform", "schedule.stages=2", "schedule.microbatches=4"]


def _keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config, from the dataclasses themselves (so a new key is fuzzed too)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys += _keys(kind, f"{prefix}{f.name}.")
        elif f.name == "costs":
            keys += [f"costs.{k}" for k in ("kind", "forward", "backward_input", "backward_weight", "p2p",
                                           "efficiency", "profile")]
        else:
            keys.append(prefix + f.name)
    return keys


KEYS = _keys()
HOSTILE_TEXT = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["010", "1:30", "0b100", "1_6", "0x4", "0o7", ".inf", "-.nan", "1e400", "1e-10", "yes", "~",
                     "[1, 2]", "{a: 1}", "*alias", "&a 1", "!!int 0x10", "!!python/name:os.system", "'8'", "8.0",
                     "1e-300s", "5GiB", "-1", "0", "9" * 5000, "16GiB", "100Gbit/s", "2us", "nan ms",
                     "csv:/nonexistent.csv", "torch:Nope", "torch:GPipe", "zb-v", "interleaved", "2bw", "profile",
                     "analytic", "fp32", "bf16", "v100", "p3dn-v100", "spread"]),
    st.integers(min_value=1, max_value=16).map(str),
    st.text(max_size=40),
)


def _one_line(err: BaseException) -> None:
    message = str(err)
    assert message and "\n" not in message, repr(message)


@FUZZ
@given(key=st.sampled_from(KEYS), text=HOSTILE_TEXT)
def test_any_set_value_is_a_config_or_a_one_line_error_naming_the_key(key: str, text: str) -> None:
    try:
        config = load_config(None, [*SMALL, f"{key}={text}"])
    except ConfigError as err:
        _one_line(err)
        assert str(err).startswith(key.split(".")[0]) or str(err).startswith("--set"), str(err)
        return
    if config.schedule.p * config.schedule.m > 4096 or (config.iterations or 1) > 50:
        return  # a valid size: its time is the simulator's, not this test's
    event("simulated")
    try:
        result = run(config)
    except (ConfigError, ScheduleError) as err:
        _one_line(err) if isinstance(err, ConfigError) else None
        return
    assert math.isfinite(result.iteration_time_s) and result.iteration_time_s > 0
    assert 0 <= result.bubble_rate < 1


def _nested(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=12)


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**25), max_value=10**25),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))


@FUZZ
@given(body=st.dictionaries(st.sampled_from(["schedule", "model", "cluster", "costs", "iterations", "extra"]),
                            _nested(SCALARS), max_size=4))
def test_any_config_file_is_a_config_or_a_one_line_error(body: dict, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(body))
    try:
        load_config(str(path))
    except ConfigError as err:
        _one_line(err)


MACHINE = {"device": "h100", "gpus_per_node": 8, "intra_node": {"bandwidth": "450GB/s", "latency": "2us"},
           "inter_node": {"bandwidth": "50GB/s", "latency": "5us"}}
PATHS = [("device",), ("gpus_per_node",), ("intra_node",), ("inter_node",), ("intra_node", "bandwidth"),
         ("intra_node", "latency"), ("inter_node", "bandwidth"), ("inter_node", "latency")]


@FUZZ
@given(path=st.sampled_from(PATHS), value=_nested(SCALARS) | HOSTILE_TEXT, drop=st.booleans())
def test_any_machine_file_is_a_machine_or_a_one_line_error_naming_the_file(path, value, drop, tmp_path_factory):
    machine = {k: dict(v) if isinstance(v, dict) else v for k, v in MACHINE.items()}
    node = machine
    for part in path[:-1]:
        node = node[part]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    file = tmp_path_factory.mktemp("machine") / "m.yaml"
    file.write_text(yaml.safe_dump(machine))
    try:
        loaded = load_machine(str(file))
    except ValueError as err:
        _one_line(err)
        assert str(file) in str(err)
        return
    assert 1 <= loaded.gpus_per_node <= 256 and loaded.intra_bandwidth > 0 and loaded.inter_latency_ns >= 0


@pytest.mark.parametrize("text", [
    "a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b]\n",
    "schedule: {stages: 4}\nschedule: {stages: 8}\n",  # a duplicate key is not a silent overwrite
    "? [a, b]\n: 1\n",  # a complex key
    "a: " + "[" * 10_000 + "]" * 10_000 + "\n",  # RecursionError in PyYAML's composer
    "a: " + "{b: " * 40 + "1" + "}" * 40 + "\n",
])
def test_yaml_bombs_and_odd_shapes_are_refused_at_once(text: str) -> None:
    start = time.perf_counter()
    with pytest.raises(YamlError) as err:
        parse_yaml(text)
    _one_line(err.value)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(("text", "value"), [
    ("010", 10), ("1:30", "1:30"), ("0x4", "0x4"), ("0b100", "0b100"), ("1_6", "1_6"), ("+7", 7), ("1e3", 1000.0),
    ("yes", True), ("~", None),
])
def test_numbers_are_plain_decimal(text: str, value: object) -> None:
    assert parse_yaml(text) == value


def test_an_oversized_or_undecodable_config_file_is_refused_naming_it(tmp_path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * MAX_YAML_BYTES + "\n")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"schedule:\n  name: \xff\xfe\n")
    for path, expected in ((big, "larger than 1,048,576 bytes"), (bad, "is not UTF-8")):
        with pytest.raises(ConfigError, match=expected) as err:
            load_config(str(path))
        assert str(path) in str(err.value)
