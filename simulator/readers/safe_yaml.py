"""The one YAML reader for files and ``--set`` values a user hands us (configs, machine files).

PyYAML's ``safe_load`` is safe from code execution but not from size: a few hundred bytes of nested aliases
expand to gigabytes (the "billion laughs"), deep nesting raises RecursionError, and YAML 1.1 reads ``010`` as 8,
``1:30`` as 90 and ``0x4``, ``0b100``, ``1_6`` as numbers. This loader refuses aliases (configs are short, so
nothing is lost), bounds the file size and the nesting depth, refuses duplicate and non-scalar keys, and reads
numbers as plain decimal only (``010`` is 10; ``0x4`` stays the string it looks like, which a numeric key then
refuses). docs/cli.md lists the limits.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from pipescope.simulator.readers.files import read_small_text

MAX_YAML_BYTES = 1 << 20  # a config or machine file is a few hundred bytes; 1 MiB leaves room for comments
MAX_YAML_DEPTH = 32  # the deepest config section is two levels; 32 is far below Python's recursion limit

MAX_INT_DIGITS = 19  # int64's largest, 9,223,372,036,854,775,807, has 19; each key's range refuses the rest

_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^(?:[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                    r"|\.(?:nan|NaN|NAN))$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class YamlError(ValueError):
    """A YAML text this project refuses; the message is one line (callers prefix the file or flag)."""


class _Loader(yaml.SafeLoader):
    """SafeLoader without aliases, deep nesting, duplicate or complex keys, or YAML 1.1 number spellings."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            raise YamlError(f"line {mark.line + 1}: an alias (*name), expected plain values (aliases are refused)")
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YamlError(f"nesting deeper than {MAX_YAML_DEPTH} levels, expected a config's few sections")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlError(f"line {key_node.start_mark.line + 1}: a {key_node.id} as a key, expected a name")
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise YamlError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_plain_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        line = node.start_mark.line + 1
        if not _INT.match(text):
            raise YamlError(f"line {line}: {text!r}, expected a plain decimal integer")
        if len(text.lstrip("+-0")) > MAX_INT_DIGITS:  # beyond int64: no key takes it, and int() of 10**6 digits is slow
            raise YamlError(f"line {line}: an integer of {len(text)} digits, expected at most {MAX_INT_DIGITS}")
        return int(text)

    def construct_plain_float(self, node: yaml.ScalarNode) -> float:
        text = self.construct_scalar(node)
        if not _FLOAT.match(text):
            raise YamlError(f"line {node.start_mark.line + 1}: {text!r}, expected a decimal number")
        return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))
_Loader.add_constructor(_INT_TAG, _Loader.construct_plain_int)
_Loader.add_constructor(_FLOAT_TAG, _Loader.construct_plain_float)


def parse_yaml(text: str) -> Any:
    """The value of a YAML text, within the limits above.

    Raises:
        YamlError: one line saying what was refused and where.
    """
    if len(text) > MAX_YAML_BYTES:
        raise YamlError(f"{len(text):,} characters, expected at most {MAX_YAML_BYTES:,}")
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:
        where = f"line {err.problem_mark.line + 1}: " if err.problem_mark else ""
        raise YamlError(f"{where}{err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise YamlError(" ".join(str(err).split())) from None
    except RecursionError:
        raise YamlError(f"nesting too deep, expected at most {MAX_YAML_DEPTH} levels") from None


def read_yaml_file(path: str) -> Any:
    """The value of a YAML file, checked to be a small UTF-8 file first (never reading more than the limit).

    Raises:
        YamlError: missing, unreadable, too big, not UTF-8, or refused by ``parse_yaml``.
    """
    try:
        text = read_small_text(path, MAX_YAML_BYTES, repr(path), "a short YAML file", "text")
    except ValueError as err:
        raise YamlError(str(err)) from None
    try:
        return parse_yaml(text)
    except YamlError as err:
        raise YamlError(f"{path!r}: {err}") from None
