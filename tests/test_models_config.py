"""ModelConfig parsing / validation / presets, RoPE scaling frequencies, tokenizers."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ulacache_jax import models
from ulacache_jax.models import ByteTokenizer, LlamaModel, ModelConfig, RopeScaling
from ulacache_jax.models.config import rope_inv_freq
from ulacache_jax.models.hf_loader import hf_tensor_map

# meta-llama/Llama-3.1-8B-Instruct config.json (Hub style: rope_scaling + top-level rope_theta).
LLAMA31_8B_HUB = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# Qwen/Qwen2.5-72B-Instruct config.json.
QWEN25_72B_HUB = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 70,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# mistralai/Mistral-7B-v0.1 config.json (no head_dim: derived from hidden / heads).
MISTRAL_7B_HUB = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}


def _without_token_ids(config: ModelConfig) -> ModelConfig:
    return config.replace(bos_token_id=None, eos_token_ids=())


def test_hub_configs_match_presets():
    assert ModelConfig.from_hf_dict(LLAMA31_8B_HUB) == models.get_preset("llama-3.1-8b")
    qwen = ModelConfig.from_hf_dict(QWEN25_72B_HUB)
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.sliding_window is None
    assert _without_token_ids(qwen) == _without_token_ids(models.get_preset("qwen2.5-72b"))
    mistral = ModelConfig.from_hf_dict(MISTRAL_7B_HUB)
    assert (mistral.architecture, mistral.head_dim, mistral.sliding_window) == ("mistral", 128, 4096)
    assert mistral.eos_token_ids == (2,) and mistral.rope_scaling is None


def test_transformers5_rope_parameters_equal_hub_style():
    hf5 = {k: v for k, v in LLAMA31_8B_HUB.items() if k not in ("rope_scaling", "rope_theta")}
    hf5["rope_parameters"] = {**LLAMA31_8B_HUB["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf_dict(hf5) == ModelConfig.from_hf_dict(LLAMA31_8B_HUB)
    default = {**hf5, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    assert ModelConfig.from_hf_dict(default).rope_scaling is None
    assert ModelConfig.from_hf_dict(default).rope_theta == 1234.0


def test_linear_rope_and_llama_attention_bias():
    old_style = {**LLAMA31_8B_HUB, "rope_scaling": {"type": "linear", "factor": 4.0}, "attention_bias": True}
    config = ModelConfig.from_hf_dict(old_style)
    assert config.rope_scaling == RopeScaling("linear", 4.0)
    assert config.attention_bias and config.attention_out_bias  # Llama's flag covers q/k/v and o
    base = rope_inv_freq(config.replace(rope_scaling=None))
    np.testing.assert_allclose(rope_inv_freq(config), np.asarray(base) / 4.0, rtol=1e-12)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "gemma"}, "model_type='gemma'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 5}, r"multiple of num_kv_heads \(5\)"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192}}, "high_freq_factor > low_freq_factor"),
    ],
)
def test_hf_config_errors_name_the_problem(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**LLAMA31_8B_HUB, **change})


def test_qwen2_sliding_window_rejected():
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**QWEN25_72B_HUB, "use_sliding_window": True})


def test_validation():
    tiny = models.get_preset("tiny")
    for change, match in [
        ({"architecture": "gpt2"}, "unknown architecture 'gpt2'"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"eos_token_ids": (999,)}, "outside vocab"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny.replace(**change)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.num_layers = 3
    with pytest.raises(KeyError, match="available: tiny"):
        models.get_preset("gpt-5")


def stacked_gate_up(mapped: dict) -> dict:
    """Tensor-map shapes as the model holds them: each MLP's gate_proj and up_proj [F, E] as gate_up_proj
    [2, F, E] (hf_loader.fuse_gate_up)."""
    out = {}
    for path, shape in mapped.items():
        if path[-1] in ("gate_proj", "up_proj"):
            out[(*path[:-1], "gate_up_proj")] = (2, *shape)
        else:
            out[path] = shape
    return out


@pytest.mark.parametrize("name", list(models.PRESETS))
def test_presets_round_trip_and_shapes(name):
    config = models.get_preset(name)
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.num_queries_per_kv > 1
    # Shapes only (eval_shape): the 70B presets cost nothing to check.
    model = nnx.eval_shape(lambda: LlamaModel(config, dtype=jnp.bfloat16))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    assert sum(math.prod(v.shape) for v in flat.values()) == config.num_params()
    # The HF name map targets exactly the model's params with their shapes (the loader relies on it).
    mapped = stacked_gate_up({path: shape for path, _, shape in hf_tensor_map(config).values()})
    assert mapped == {path: tuple(v.shape) for path, v in flat.items()}


def test_hf_tensor_map_with_out_bias():
    config = models.get_preset("tiny").replace(attention_bias=True, attention_out_bias=True, tie_word_embeddings=True)
    flat = dict(nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: LlamaModel(config)))))
    mapped = stacked_gate_up({path: shape for path, _, shape in hf_tensor_map(config).values()})
    assert mapped == {path: tuple(v.shape) for path, v in flat.items()}
    assert "model.layers.1.self_attn.o_proj.bias" in hf_tensor_map(config)


def test_known_parameter_counts():
    assert models.get_preset("llama-3.1-8b").num_params() == 8_030_261_248
    assert models.get_preset("llama-3.1-70b").num_params() == 70_553_706_496


def test_llama3_rope_bands():
    """Llama 3.1: wavelengths < 8192/4 keep their frequency, > 8192/1 are divided by 8, smooth in between."""
    config = models.get_preset("llama-3.1-8b")
    scaled = np.asarray(rope_inv_freq(config))
    base = np.asarray(rope_inv_freq(config.replace(rope_scaling=None)))
    wavelen = 2 * np.pi / base
    high, low = wavelen < 2048, wavelen > 8192
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-12)
    mid = ~high & ~low
    assert mid.any() and np.all((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8))
    assert np.all(np.diff(scaled) < 0)  # still monotone across the bands


# --- tokenizers -------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False) + [tok.eos_ids[0]]) == text


def test_byte_tokenizer_matches_tiny_presets():
    tok = ByteTokenizer()
    for name in ("tiny", "tiny-gqa8"):
        config = models.get_preset(name)
        assert config.vocab_size == tok.vocab_size
        assert (config.bos_token_id, config.eos_token_ids) == (tok.bos_id, tok.eos_ids)
    assert tok.decode([104, 105, tok.eos_ids[0]], skip_special_tokens=False) == "hi<eos>"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # a cut multi-byte character does not raise
    with pytest.raises(ValueError, match="outside the byte vocab"):
        tok.decode([300])


def test_load_tokenizer_from_folder(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    )
    loaded = models.load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_ids, loaded.vocab_size) == (0, (1,), 5)
    assert loaded.encode("hello world") == [0, 3, 4]
    assert loaded.encode("hello world", add_special_tokens=False) == [3, 4]
    assert loaded.decode([0, 3, 4, 1]) == "hello world"
    assert models.load_tokenizer(tmp_path / "tokenizer.json").encode("world") == [0, 4]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        models.load_tokenizer(tmp_path / "nowhere")
