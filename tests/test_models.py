"""Hugging Face loading, parity with transformers, loader errors, orbax round trip (CPU, fp32 parity)."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from checkpoint_v1 import save_format1
from ulacache_jax import models
from ulacache_jax.models import CheckpointError, LlamaModel

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ("tiny_llama", "tiny_qwen2", "tiny_mistral")


def _reference(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    return ref["input_ids"], ref["logits"]  # [B, T] int32, [B, T, V] float32


def _max_rel_err(ours, ref):
    """max |ours - ref| relative to the logit scale max |ref| (the issue's tolerance unit)."""
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def fp32_models():
    return {name: models.from_pretrained(FIXTURES / name, dtype=jnp.float32) for name in FIXTURE_NAMES}


@pytest.fixture
def folder(tmp_path, request):
    """A writable copy of the fixture named by the test's `fixture_name` parameter."""
    dst = tmp_path / request.param
    shutil.copytree(FIXTURES / request.param, dst)
    return dst


# --- parity with transformers -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_parity_with_transformers_fp32(fp32_models, name):
    model = fp32_models[name]
    input_ids, ref_logits = _reference(name)
    assert model.config.num_queries_per_kv > 1  # GQA in every fixture
    logits = model(jnp.asarray(input_ids))
    assert logits.shape == ref_logits.shape and logits.dtype == jnp.float32
    assert _max_rel_err(logits, ref_logits) <= 1e-4


def test_fixtures_cover_the_features(fp32_models):
    llama, qwen2, mistral = (fp32_models[n].config for n in FIXTURE_NAMES)
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert llama.head_dim != llama.hidden_size // llama.num_heads
    assert (FIXTURES / "tiny_llama" / "model.safetensors.index.json").is_file()
    assert len(list((FIXTURES / "tiny_llama").glob("model-*-of-*.safetensors"))) > 1
    assert qwen2.tie_word_embeddings and qwen2.attention_bias and fp32_models["tiny_qwen2"].lm_head is None
    assert not llama.tie_word_embeddings
    seq_len = _reference("tiny_mistral")[0].shape[1]
    assert mistral.sliding_window is not None and mistral.sliding_window < seq_len


@pytest.mark.parametrize(
    "name, change",
    [("tiny_llama", {"rope_scaling": None}), ("tiny_mistral", {"sliding_window": None})],
)
def test_parity_is_sensitive_to_the_feature(fp32_models, name, change):
    """Negative control: without llama3 scaling / the sliding window the same weights miss the reference, so
    the parity test really exercises them."""
    model = fp32_models[name]
    altered = nnx.merge(
        nnx.graphdef(nnx.eval_shape(lambda: LlamaModel(model.config.replace(**change)))), nnx.state(model)
    )
    input_ids, ref_logits = _reference(name)
    assert _max_rel_err(altered(jnp.asarray(input_ids)), ref_logits) > 1e-3


def test_bf16_load_default_dtype():
    model = models.from_pretrained(FIXTURES / "tiny_qwen2")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(model)))
    input_ids, ref_logits = _reference("tiny_qwen2")
    assert _max_rel_err(model(jnp.asarray(input_ids)), ref_logits) < 5e-2  # bf16 weights and activations


def test_jit_matches_eager_and_positions_shift_invariance(fp32_models):
    model = fp32_models["tiny_llama"]
    input_ids = jnp.asarray(_reference("tiny_llama")[0])
    eager = model(input_ids)
    jitted = jax.jit(lambda m, ids: m(ids))(model, input_ids)
    np.testing.assert_allclose(jitted, eager, rtol=0, atol=1e-5 * float(jnp.abs(eager).max()))
    # RoPE scores depend only on position differences, so shifting every position leaves logits unchanged.
    b, t = input_ids.shape
    shifted = model(input_ids, jnp.broadcast_to(jnp.arange(t) + 37, (b, t)))
    assert _max_rel_err(shifted, np.asarray(eager)) <= 1e-4


# --- loader errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["tiny_llama"], indirect=True)
def test_missing_shard_file(folder):
    (folder / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard file.*model-00002-of-00004\.safetensors"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_llama"], indirect=True)
def test_truncated_shard_file(folder):
    shard = folder / "model-00003-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"corrupt.*model-00003-of-00004\.safetensors"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_qwen2"], indirect=True)
def test_garbage_header(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts after an 8-byte length
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt.*model\.safetensors"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_qwen2"], indirect=True)
def test_missing_tensor_single_file(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_llama"], indirect=True)
def test_missing_tensor_in_index(folder):
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_llama"], indirect=True)
def test_index_names_tensor_absent_from_shard(folder):
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"  # it lives in shard 4
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight listed in the index missing from .*00001"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_qwen2"], indirect=True)
def test_unexpected_and_misshapen_tensors(folder):
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}, folder / "x.st")
    (folder / "x.st").replace(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*q_norm\.weight"):
        models.from_pretrained(folder, dtype=jnp.float32)
    tensors["model.norm.weight"] = np.ones(31, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape \(31,\)"):
        models.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.parametrize("folder", ["tiny_qwen2"], indirect=True)
def test_unknown_architecture_and_missing_files(folder):
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        models.from_pretrained(folder)
    config_file.write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        models.from_pretrained(folder)
    config_file.unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        models.from_pretrained(folder)


# --- orbax ------------------------------------------------------------------------------------------------


def _assert_same_model(a: LlamaModel, b: LlamaModel):
    assert a.config == b.config
    flat_a, flat_b = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, va), (_, vb) in zip(flat_a, flat_b):
        assert va[...].dtype == vb[...].dtype, path
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(path))


def test_orbax_round_trip_exact(fp32_models, tmp_path):
    model = fp32_models["tiny_qwen2"]  # tied embeddings and qkv biases
    models.save(model, tmp_path / "ckpt")
    restored = models.load(tmp_path / "ckpt")
    _assert_same_model(model, restored)
    input_ids = jnp.asarray(_reference("tiny_qwen2")[0])
    np.testing.assert_array_equal(restored(input_ids), model(input_ids))
    with pytest.raises(FileExistsError):
        models.save(model, tmp_path / "ckpt")


def test_orbax_round_trip_bf16_preset_and_cast(tmp_path):
    model = LlamaModel(models.get_preset("tiny"), dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    models.save(model, tmp_path / "ckpt")
    _assert_same_model(model, models.load(tmp_path / "ckpt"))
    as_fp32 = models.load(tmp_path / "ckpt", dtype=jnp.float32)
    assert as_fp32.dtype == jnp.float32
    np.testing.assert_array_equal(as_fp32.embed_tokens[...], model.embed_tokens[...].astype(jnp.float32))


def test_format_1_checkpoint_loads_with_gate_and_up_stacked(tmp_path):
    """A checkpoint of format 1 (each MLP's gate_proj and up_proj stored apart) loads into gate_up_proj [2, F, E]:
    written in that layout (checkpoint_v1), restored equal to the model it came from, logits too."""
    model = LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(5))
    restored = models.load(save_format1(model, tmp_path / "v1"))
    _assert_same_model(model, restored)
    ids = jnp.asarray([[1, 5, 9, 2]])
    np.testing.assert_array_equal(restored(ids), model(ids))


def test_load_rejects_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.json"):
        models.load(tmp_path)
