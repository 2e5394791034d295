"""Hostile configs, ``--set`` values and machine files: each gives a right answer or a one-line error naming the key
or file, never a traceback, and nothing grows past the documented limits (docs/cli.md, "Limits").

The property-based tests generate the classes the hostile-input issue found (huge integers, NaN and infinity,
YAML 1.1 number spellings, aliases, complex keys, deep nesting, undecodable bytes) rather than listing cases.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import typing

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipescope.config import Config, ConfigError, load_config
from pipescope.runner import run
from pipescope.simulator.ir import ScheduleError
from pipescope.simulator.readers.safe_yaml import MAX_YAML_BYTES, YamlError, parse_yaml
from pipescope.topologies.topology_io import load_topology

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
                                           "optimizer", "efficiency", "memory_efficiency", "profile")]
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
        loaded = load_topology(str(file))
    except ValueError as err:
        _one_line(err)
        assert str(file) in str(err)
        return
    assert 1 <= loaded.graph["gpus_per_node"] <= 256
    assert all(e["bandwidth"] > 0 and e["latency_ns"] >= 0 for _, _, e in loaded.edges(data=True))


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
    loop = tmp_path / "l1.yaml"
    loop.symlink_to(tmp_path / "l2.yaml")
    (tmp_path / "l2.yaml").symlink_to(loop)  # resolving it raised RuntimeError inside the message
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")  # a mistake more likely than a wish for the defaults
    for path, expected in ((big, "larger than 1,048,576 bytes"), (bad, "is not UTF-8"),
                           (empty, r"is empty, expected a mapping of sections \(\{\} for the defaults\)"),
                           (loop, "is not a file")):
        with pytest.raises(ConfigError, match=expected) as err:
            load_config(str(path))
        assert str(path) in str(err.value)


@pytest.mark.parametrize(("args", "expected"), [
    (["--stages", "1_6"], "schedule.stages: got '1_6', expected a plain decimal integer"),
    (["--microbatches", "1:30"], "schedule.microbatches: got '1:30', expected a plain decimal integer"),
    (["--stages", "0x4"], "schedule.stages: got '0x4', expected a plain decimal integer"),
    (["--stages", "9" * 400], "schedule.stages: got '9999"),
    (["--set", "costs.efficiency=" + "9" * 400], "costs.efficiency: got '9999"),
    (["--set", "cluster.memory=" + "9" * 400], "cluster.memory: got '9999"),
    (["--set", "cluster.memory=1e999999999"], "cluster.memory: got inf, expected a finite size"),
    (["--set", "costs.kind=uniform", "--set", "costs.forward=1e-10"], "costs.forward: got 1e-10 s, expected 0 or 1 ns"),
    (["--set", "costs.kind=uniform", "--set", "costs.forward=1e6", "--set", "costs.p2p=1e6", "--microbatches", "5000"],
     "costs: the run would last beyond"),
    (["--set", "model.seq=16777216", "--set", "model.hidden=16", "--set", "model.heads=1",
      "--set", "model.attention=eager"],  # eager stashes the s x s scores (flash none): 10^15 bytes per layer
     "costs: stage 0: activation_bytes would be"),
    (["--set", "cluster.data_parallel=30000", "--microbatches", "1"], "= 120,000 GPUs, expected at most"),
    (["--set", "model.hidden=" + "1" * 19], "model.hidden: got 1111111111111111111, expected an integer from 1 to"),
    (["--set", "model.hidden=" + "1" * 20], "model.hidden: got '11111111111111111111', expected a plain decimal"),
    (["--set", f"seed={2 ** 63}"], "seed: got 9223372036854775808, expected an integer from 0 to "
                                   "9,223,372,036,854,775,807"),
    # YAML's null for a key that has no null: not the word 'None' offered a choice
    (["--set", "parallel.offload=null"], "parallel.offload: got null, expected a value (leave the key out"),
])
def test_hostile_numbers_are_one_line_errors_at_once(args: list[str], expected: str, cli) -> None:
    start = time.perf_counter()
    code, out, err = cli(["simulate", *args])
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err
    assert time.perf_counter() - start < 2.0


def test_the_largest_seed_the_docs_name_is_taken(cli, tmp_path) -> None:
    """int64's largest has 19 digits: the documented top of ``seed`` is reachable from --set and from a file."""
    config = tmp_path / "seed.yaml"
    config.write_text(f"seed: {2 ** 63 - 1}\ncosts: {{kind: uniform}}\n")
    for args in (["--set", f"seed={2 ** 63 - 1}", "--set", "costs.kind=uniform"], ["--config", str(config)]):
        code, out, err = cli(["simulate", *args, "--json"])
        assert code == 0 and err == "" and json.loads(out)["iteration_time_s"] > 0


def test_leading_zeros_are_decimal_not_octal(cli) -> None:
    code, out, _ = cli(["simulate", "--stages", "010", "--microbatches", "010", "--set", "costs.kind=uniform",
                        "--set", "cluster.nodes=2", "--json"])
    assert code == 0 and json.loads(out)["devices"] == 10 and json.loads(out)["microbatches"] == 10


def test_positive_times_never_round_to_zero() -> None:
    from pipescope.simulator.costs import seconds_to_ns
    assert (seconds_to_ns(1e-12), seconds_to_ns(0.0), seconds_to_ns(1.4e-9)) == (1, 0, 1)
    tiny = ["model.hidden=1", "model.heads=1", "model.seq=1", "model.vocab=1", "model.layers=4"]
    result = run(load_config(None, tiny))
    assert result.iteration_time_s > 0 and all(d.busy_s > 0 for d in result.devices)


@pytest.mark.parametrize(("key", "word", "expected"), [("parallel.context_comm", "no", "one of p2p, all_gather"),
                                                       ("model.attention", "off", "one of flash, eager"),
                                                       ("cluster.topology", "yes", "text")])
def test_a_word_yaml_reads_as_a_boolean_is_named_as_one(key: str, word: str, expected: str, tmp_path) -> None:
    """YAML 1.1 reads an unquoted no, off or yes as a boolean; the error said 'False', which no one had written."""
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {word}\n")
    value = str(word in ("yes", "on")).lower()
    with pytest.raises(ConfigError, match=rf"^{key}: got {value}, a boolean \(YAML reads an unquoted yes, no, on, off, "
                                          rf"true or false as one; quote the word\), expected {expected}$"):
        load_config(str(path))
    path.write_text(f"{section}:\n  {name}: '{word}'\n")  # quoted, it is the word, and the usual error names it
    with pytest.raises(ConfigError, match=rf"^{key}: got '{word}'"):
        run(load_config(str(path)))


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("model.attention", "[eager]", "got a list, ['eager'], expected one of flash, eager"),
    ("schedule.name", "{a: 1}", "got a mapping, {'a': 1}, expected one value"),
    ("faults.stragglers", "['3:1.5']", "got a list, ['3:1.5'], expected one value"),
])
def test_a_list_or_mapping_where_one_value_belongs_is_named_as_one(key: str, value: str, expected: str,
                                                                   tmp_path) -> None:
    """A YAML list or mapping given to a text key was read as its Python text (``"['eager']"``, with a 'did you
    mean eager?'); it is named as what it is."""
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key + ': ' + expected)}$"):
        load_config(str(path))
