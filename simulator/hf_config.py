"""``model.from_hf``: a Hugging Face ``config.json`` read into the model section's shape keys (standard library only).

Two families are understood, by ``model_type``: ``llama`` (Llama 2 and 3: SwiGLU, grouped-query attention, RMSNorm,
rotary positions, untied embeddings) and ``gpt2``. The sequence length is ``max_position_embeddings`` (``n_positions``
for GPT-2), the context the model was trained at for Llama 2 and 3 8B/70B; set ``model.seq`` to train at another.
The file is a user's: it is read up to ``MAX_BYTES``, and every field is checked (``models.check_shape`` checks the
values' ranges), so a hostile file gets a one-line error naming the field.
"""

from __future__ import annotations

import functools
import json
import os

from pipescope.simulator.readers.files import read_small_text
from pipescope.simulator.readers.units import short_repr

KEY = "model.from_hf"
MAX_BYTES = 1 << 20  # Hugging Face model configs are a few KB

# model_type -> (family, {shape key: the config.json field})
FIELDS: dict[str, tuple[str, dict[str, str]]] = {
    "llama": ("llama", {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                        "kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
                        "seq": "max_position_embeddings", "vocab": "vocab_size"}),
    "gpt2": ("gpt", {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn_hidden": "n_inner",
                     "seq": "n_positions", "vocab": "vocab_size"}),
}
# Absent or null, these take the family's default: as many key/value heads as heads (Llama 2 7B); GPT-2's MLP 4h wide
OPTIONAL = {"num_key_value_heads", "n_inner"}


def read_hf_config(path: str, given: frozenset[str] = frozenset()) -> dict[str, int | str]:
    """The shape keys and ``family`` of the model ``path`` describes; the shape keys in ``given`` (set beside the file,
    which replace its values) are neither read nor required.

    Raises:
        ValueError: ``model.from_hf: ...`` naming the file and the field: unreadable, too big, not a JSON object, a
            ``model_type`` other than llama or gpt2, a field missing or not a positive integer, or an activation or
            embedding tying the family does not have.
    """
    try:  # keyed by the file's size and time too: a file edited in a notebook's session is read again
        stat = os.stat(path)
        version = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        version = None  # _read names why it cannot read it
    return dict(_read(path, version, given))


@functools.lru_cache(maxsize=16)
def _read(path: str, version: tuple[int, int] | None, given: frozenset[str]) -> tuple[tuple[str, int | str], ...]:
    where = f"{KEY}: {short_repr(path)}"
    text = read_small_text(path, MAX_BYTES, where, "a Hugging Face config.json", "JSON")
    try:  # a byte-order mark, which some Windows editors write, is not part of the JSON
        tree = json.loads(text.removeprefix("\ufeff"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as err:
        detail = str(err).splitlines()[0]
        if "integer string conversion" in detail:  # Python's own limit, whose message names its own workaround
            detail = "an integer of more than 4,300 digits"
        raise ValueError(f"{where}: not JSON ({detail[:120]}), expected a Hugging Face config.json") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: got a JSON {_json_type(tree)}, expected an object (a config.json)")
    model_type = tree.get("model_type")
    if model_type not in FIELDS:
        got = "is missing" if "model_type" not in tree else _shown(model_type)
        raise ValueError(f"{where}: model_type {got}, expected one of {', '.join(FIELDS)}")
    family, fields = FIELDS[model_type]
    shape: dict[str, int | str] = {"family": family}
    for key, field in fields.items():
        if key in given or (tree.get(field) is None and field in OPTIONAL):
            continue
        if field not in tree:
            raise ValueError(f"{where}: {field} is missing, expected a positive integer (or model.{key} set beside "
                             f"the file)")
        shape[key] = _positive_int(tree, field, where)
    _check_architecture(tree, family, where)
    return tuple(shape.items())


def _positive_int(tree: dict, field: str, where: str) -> int:
    """``tree[field]``, refused unless a positive integer (JSON's 4096.0 and true are not)."""
    value = tree[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {field} is {_shown(value)}, expected a positive integer")
    return value


def _shown(value: object) -> str:
    """A value as the file wrote it: JSON's true, false and null, not Python's True, False and None."""
    return json.dumps(value) if value is None or isinstance(value, bool) else short_repr(value)


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type (null, boolean, number, string, array), as a user wrote it."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(type(value), "value")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refused when it names a key twice (json keeps the last silently; YAML files are refused too)."""
    tree: dict = {}
    for key, value in pairs:
        if key in tree:
            raise ValueError(f"the key {short_repr(key)} twice")
        tree[key] = value
    return tree


# GPT-2's activations that Hugging Face runs as GeLU (transformers' ACT2FN): the gelu the GPT family is modelled with
GPT2_ACTIVATIONS = ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh")


def _check_architecture(tree: dict, family: str, where: str) -> None:
    """What the family's cost model assumes, where the file says otherwise: GPT-2's GeLU MLP and output layer tied
    to the embedding; a Llama's SiLU-gated MLP, untied output layer, heads of hidden / heads each and no biases."""
    if family != "llama":
        act = tree.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise ValueError(f"{where}: activation_function {short_repr(act)}, expected one of "
                             f"{', '.join(GPT2_ACTIVATIONS)} (the GeLU MLP the gpt family is modelled with)")
        if tree.get("tie_word_embeddings", True) is not True:
            raise ValueError(f"{where}: tie_word_embeddings {_shown(tree.get('tie_word_embeddings'))}, expected "
                             f"true (the gpt family's output layer is its embedding)")
        return
    heads, hidden = tree.get("num_attention_heads"), tree.get("hidden_size")  # absent where set beside the file
    head_dim = _positive_int(tree, "head_dim", where) if tree.get("head_dim") is not None else None
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        raise ValueError(f"{where}: head_dim {short_repr(head_dim)}, expected hidden_size / num_attention_heads = "
                         f"{hidden / heads:g} (the llama family's heads split the hidden size)")
    for bias in ("attention_bias", "mlp_bias"):
        if tree.get(bias, False) is not False:
            raise ValueError(f"{where}: {bias} {_shown(tree[bias])}, expected false (the llama family's "
                             f"matmuls have no biases)")
    act = tree.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {short_repr(act)}, expected silu (the SwiGLU MLP the llama family "
                         f"is modelled with)")
    if tree.get("tie_word_embeddings", False) is not False:
        raise ValueError(f"{where}: tie_word_embeddings {_shown(tree.get('tie_word_embeddings'))}, expected "
                         f"false (the llama family's output layer is its own)")
