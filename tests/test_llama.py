"""The Llama family (docs/costs.md, "Llama"; docs/memory.md): SwiGLU MLP with its own width, grouped-query
attention, RMSNorm, rotary positions and untied embeddings; the published shapes as presets; ``model.from_hf``."""

from __future__ import annotations

import json

import pytest

from pipescope import ConfigError, load_config, run
from pipescope.runner import model_flops, prepare
from pipescope.simulator.kernels import layer_kernels
from pipescope.simulator.models import PRESETS, layer_work

# Published parameter counts: the Hugging Face checkpoints' totals (meta-llama/Llama-2-7b-hf, Llama-2-13b-hf,
# Llama-2-70b-hf; Meta-Llama-3-8B, Meta-Llama-3-70B; Llama-3.1-405B), as each repository's safetensors index states.
PUBLISHED_PARAMS = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
                    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}

# Meta-Llama-3-8B's config.json (the fields the model reads, as published on the Hugging Face Hub)
LLAMA3_8B_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "vocab_size": 128256}

SMALL = ["model.layers=4", "model.seq=1024", "schedule.stages=2", "schedule.microbatches=4",
         "cluster.topology=dgx-h100", "cluster.nodes=1"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_each_presets_parameters_are_the_published_checkpoints(name: str) -> None:
    assert PRESETS[name].total_params() == PUBLISHED_PARAMS[name]


def test_json_reports_the_models_parameters_and_a_pipeline_holds_each_once() -> None:
    """Llama 3 8B: 8.03e9, in ``--json`` and as the sum of the stages' parameters (untied: nothing held twice)."""
    result = run(load_config(None, ["model.preset=llama3-8b", "schedule.stages=4", "cluster.topology=dgx-h100",
                                    "cluster.nodes=1"]))
    assert result.summary()["model_params"] == 8_030_261_248
    assert sum(c.params for c in result.stage_costs) == 8_030_261_248


def test_a_layers_flops_are_palms_six_n_plus_attention() -> None:
    """Per token, F + I + W of every layer and the output layer: 6 N + 12 L h s (Chowdhery et al. 2022, PaLM,
    Appendix B), N the matmuls' weights (no norms, no input embedding)."""
    config = load_config(None, ["model.preset=llama3-8b", "schedule.stages=1", "schedule.microbatches=1",
                                "cluster.topology=dgx-h100"])
    built = prepare(config)
    m = built.model
    kv = m.kv_heads * m.hidden // m.heads
    n = m.layers * (2 * m.hidden ** 2 + 2 * m.hidden * kv + 3 * m.hidden * m.ffn_hidden) + m.vocab * m.hidden
    tokens = m.seq
    assert model_flops(m, built.config, built.schedule) == 6 * n * tokens + 12 * m.layers * m.hidden * m.seq * tokens


def test_the_kernels_are_a_llama_blocks_and_add_up_to_its_flops() -> None:
    """Llama 3 8B's block: QKV of h + 2 kv-widths (4096 + 2 x 1024), gate and up in one matmul (2 x 14336), RMSNorms
    and SwiGLU and rotary, no biases or dropouts; the matmul FLOPs of each pass are layer_work's."""
    spec = PRESETS["llama3-8b"]
    kernels = layer_kernels(spec, 1, "bf16")
    names = [k.name for k in kernels if k.op == "F"]
    assert names == ["RMSNorm 1", "QKV", "rotary", "flash attention", "out projection", "residual add 1",
                     "RMSNorm 2", "MLP up", "SwiGLU", "MLP down", "residual add 2"]
    shapes = {k.name: k.gemm for k in kernels if k.op == "F" and k.gemm is not None}
    assert (shapes["QKV"].cols, shapes["MLP up"].cols, shapes["MLP down"].inner) == (6144, 28672, 14336)
    work = layer_work(spec, 1, "bf16")
    for op, flops in (("F", work.forward_flops), ("I", work.input_grad_flops), ("W", work.weight_grad_flops)):
        assert sum(k.flops for k in kernels if k.op == op) == pytest.approx(flops, rel=1e-12)


def test_tensor_parallelism_splits_whole_key_value_groups() -> None:
    with pytest.raises(ConfigError, match=r"parallel.tensor: got 8, expected a divisor of model.kv_heads \(=4\)"):
        run(load_config(None, ["model.preset=llama3-8b", "model.kv_heads=4", "parallel.tensor=8", *SMALL,
                               "cluster.nodes=2"]))
    split = run(load_config(None, ["model.preset=llama3-8b", "parallel.tensor=8", *SMALL, "cluster.nodes=2"]))
    whole = run(load_config(None, ["model.preset=llama3-8b", *SMALL]))
    assert split.stage_costs[1].params < whole.stage_costs[1].params / 7  # 1/8 of the matmuls, the norms whole


def test_from_hf_predicts_exactly_what_the_preset_predicts(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_HF))
    sets = ["schedule.stages=4", "schedule.microbatches=8", "cluster.topology=dgx-h100", "cluster.nodes=1"]
    preset = run(load_config(None, ["model.preset=llama3-8b", *sets]))
    read = run(load_config(None, [f"model.from_hf={path}", *sets]))
    assert read.iteration_time_s == preset.iteration_time_s and read.peak_memory_bytes == preset.peak_memory_bytes
    assert read.summary()["model_params"] == 8_030_261_248
    # beside a config file, a relative name is the file's folder's
    (tmp_path / "run.yaml").write_text("model:\n  from_hf: config.json\n")
    assert load_config(str(tmp_path / "run.yaml")).model.from_hf == str(path)


GPT2_HF = {"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4, "n_positions": 1024, "vocab_size": 50257,
           "activation_function": "gelu_new", "tie_word_embeddings": True}


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ("[1, 2]", "got a JSON array, expected an object"),
    ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "not JSON (an integer of more than 4,300 digits)"),
    ("null", "got a JSON null, expected an object"),
    ('{"model_type": "bert"}', "model_type 'bert', expected one of llama, gpt2"),
    (json.dumps({**LLAMA3_8B_HF, "hidden_size": -4096}), "hidden_size is -4096, expected a positive integer"),
    (json.dumps({**LLAMA3_8B_HF, "num_attention_heads": True}), "num_attention_heads is true, expected a positive"),
    (json.dumps({**LLAMA3_8B_HF, "vocab_size": 10**12}), "model.vocab: got 1000000000000"),
    (json.dumps({**LLAMA3_8B_HF, "hidden_act": "gelu"}), "hidden_act 'gelu', expected silu"),
    (json.dumps({**LLAMA3_8B_HF, "tie_word_embeddings": True}), "tie_word_embeddings true, expected false"),
    (json.dumps({**LLAMA3_8B_HF, "head_dim": 64}), "head_dim 64, expected hidden_size / num_attention_heads = 128"),
    (json.dumps({**LLAMA3_8B_HF, "head_dim": 128.0}), "head_dim is 128.0, expected a positive integer"),
    (json.dumps({**LLAMA3_8B_HF, "attention_bias": True}), "attention_bias true, expected false"),
    (json.dumps({**LLAMA3_8B_HF, "mlp_bias": True}), "mlp_bias true, expected false"),
    (json.dumps({k: v for k, v in LLAMA3_8B_HF.items() if k != "num_attention_heads"}),
     "num_attention_heads is missing, expected a positive integer"),
    ('{"model_type": "gpt2", "n_layer": 2, "n_layer": 3}', "the key 'n_layer' twice"),
    (json.dumps({**GPT2_HF, "tie_word_embeddings": False}), "tie_word_embeddings false, expected true"),
    (json.dumps({**GPT2_HF, "activation_function": "relu"}), "activation_function 'relu', expected one of gelu_new"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),
    (" " * (2 << 20), "larger than 1,048,576 bytes"),
])
def test_a_hostile_hf_config_gets_one_line_naming_the_key(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        run(load_config(None, [f"model.from_hf={path}", *SMALL]))
    assert str(err.value).startswith("model.") and message in str(err.value) and "\n" not in str(err.value)


def test_a_key_set_beside_the_file_replaces_a_missing_or_out_of_range_field(tmp_path) -> None:
    """Keys set beside ``model.from_hf`` override the file's (docs/cli.md): a field they replace is neither required
    nor checked, so a file without max_position_embeddings, or with a hidden size past the limits, runs with
    model.seq or model.hidden set (both were refused before the override applied; a new user's finding). Unset, the
    message names the key that would replace it."""
    sets = [item for item in SMALL if not item.startswith(("model.seq", "model.hidden"))]
    no_seq = tmp_path / "no_seq.json"
    no_seq.write_text(json.dumps({k: v for k, v in LLAMA3_8B_HF.items() if k != "max_position_embeddings"}))
    with pytest.raises(ConfigError, match=r"max_position_embeddings is missing, expected a positive integer \(or "
                                          r"model\.seq set beside the file\)$"):
        run(load_config(None, [f"model.from_hf={no_seq}", *sets]))
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({**LLAMA3_8B_HF, "hidden_size": 10**12}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(LLAMA3_8B_HF))
    fixed = [run(load_config(None, [f"model.from_hf={path}", *sets, *beside])).summary()["model_params"]
             for path, beside in ((no_seq, ["model.seq=8192"]), (wide, ["model.hidden=4096"]), (plain, []))]
    assert fixed[0] == fixed[1] == fixed[2] > 0


def test_a_config_json_with_a_byte_order_mark_reads_as_without(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("\ufeff" + json.dumps(LLAMA3_8B_HF), encoding="utf-8")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(LLAMA3_8B_HF))
    marked, unmarked = (run(load_config(None, [f"model.from_hf={p}", *SMALL])) for p in (path, plain))
    assert marked.summary()["model_params"] == unmarked.summary()["model_params"] > 0


def test_gpt2s_mlp_width_is_read_from_n_inner(tmp_path) -> None:
    """GPT-2's ``n_inner`` is its MLP width (null: 4 x hidden), as ``model.ffn_hidden`` sets it."""
    gpt2 = {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024,
            "vocab_size": 50257}
    params = {}
    for name, extra in (("narrow", {"n_inner": 2048}), ("default", {"n_inner": None})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**gpt2, **extra}))
        params[name] = run(load_config(None, [f"model.from_hf={path}", *SMALL])).summary()["model_params"]
    narrow = run(load_config(None, ["model.preset=gpt-355m", "model.ffn_hidden=2048", *SMALL]))
    assert params["narrow"] == narrow.summary()["model_params"] < params["default"]


def test_the_harness_refuses_a_model_it_cannot_build() -> None:
    from pipescope.calibration.presets import resolve

    with pytest.raises(ValueError, match="--model: got 'llama3-8b'.*GPT"):
        resolve("llama3-8b")
