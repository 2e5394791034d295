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
    "gpt2": ("gpt", {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "seq": "n_positions",
                     "vocab": "vocab_size"}),
}
OPTIONAL = {"num_key_value_heads"}  # a Llama config without it has as many key/value heads as heads (Llama 2 7B)


def read_hf_config(path: str) -> dict[str, int | str]:
    """The shape keys and ``family`` of the model ``path`` describes.

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
    return dict(_read(path, version))


@functools.lru_cache(maxsize=16)
def _read(path: str, version: tuple[int, int] | None) -> tuple[tuple[str, int | str], ...]:
    where = f"{KEY}: {short_repr(path)}"
    text = read_small_text(path, MAX_BYTES, where, "a Hugging Face config.json", "JSON")
    try:
        tree = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{where}: not JSON ({str(err).splitlines()[0][:120]}), expected a Hugging Face "
                         f"config.json") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: got a JSON {type(tree).__name__}, expected an object (a config.json)")
    model_type = tree.get("model_type")
    if model_type not in FIELDS:
        raise ValueError(f"{where}: model_type {short_repr(model_type)}, expected one of {', '.join(FIELDS)}")
    family, fields = FIELDS[model_type]
    shape: dict[str, int | str] = {"family": family}
    for key, field in fields.items():
        if field not in tree and field in OPTIONAL:
            continue
        value = tree.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} is {short_repr(value)}, expected a positive integer")
        shape[key] = value
    _check_architecture(tree, family, where)
    return tuple(shape.items())


def _check_architecture(tree: dict, family: str, where: str) -> None:
    """What the family's cost model assumes, where the file says otherwise: a Llama's SiLU-gated MLP and untied
    output layer."""
    if family != "llama":
        return
    act = tree.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {short_repr(act)}, expected silu (the SwiGLU MLP the llama family "
                         f"is modelled with)")
    if tree.get("tie_word_embeddings", False) is not False:
        raise ValueError(f"{where}: tie_word_embeddings {short_repr(tree.get('tie_word_embeddings'))}, expected "
                         f"false (the llama family's output layer is its own)")
