"""Hugging Face model folders (config.json + safetensors, single or sharded) -> LlamaModel.

Memory: tensors are read one at a time from the memory-mapped safetensors files: read, reshape (a view), cast,
`device_put`, drop the host copy. The device arrays then become the params of an abstractly built model
(`nnx.eval_shape`: shapes only, no arrays), so no initialized weights are ever materialized. Peak host memory
is about one tensor. With `shardings` (a function from a param's state path to its Sharding, e.g. the tensor-
parallel rules of ulacache_jax/runtime/tp.py) each tensor goes from the host straight into its shards, one slice per
device, so a model larger than one device is never held by one.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .gguf_loader import find_gguf, from_gguf
from .llama import LlamaModel
from .pretrained import PRETRAINED, resolve_model_path
from .weights import CheckpointError, Shardings, assemble, placement  # noqa: F401 (CheckpointError, placement: re-exported)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that the model recomputes (RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# One HF tensor: where it goes in the model state (a path of attribute names / layer indices), the shape the
# file must hold, and how to reshape it into the param's shape.
_Target = tuple[tuple[str | int, ...], tuple[int, ...], tuple[int, ...]]


def hf_tensor_map(config: ModelConfig) -> dict[str, _Target]:
    """HF tensor name -> (state path, HF shape, param shape) for every tensor the model needs."""
    e, f, h, k, d, v = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.vocab_size,
    )
    out: dict[str, _Target] = {
        "model.embed_tokens.weight": (("embed_tokens",), (v, e), (v, e)),
        "model.norm.weight": (("norm", "weight"), (e,), (e,)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head",), (v, e), (v, e))
    for i in range(config.num_layers):
        hf, p = f"model.layers.{i}.", ("layers", i)
        out[hf + "input_layernorm.weight"] = ((*p, "input_layernorm", "weight"), (e,), (e,))
        out[hf + "post_attention_layernorm.weight"] = ((*p, "post_attention_layernorm", "weight"), (e,), (e,))
        a = (*p, "self_attn")
        out[hf + "self_attn.q_proj.weight"] = ((*a, "q_proj"), (h * d, e), (h, d, e))
        out[hf + "self_attn.k_proj.weight"] = ((*a, "k_proj"), (k * d, e), (k, d, e))
        out[hf + "self_attn.v_proj.weight"] = ((*a, "v_proj"), (k * d, e), (k, d, e))
        out[hf + "self_attn.o_proj.weight"] = ((*a, "o_proj"), (e, h * d), (e, h, d))
        if config.attention_bias:
            out[hf + "self_attn.q_proj.bias"] = ((*a, "q_bias"), (h * d,), (h, d))
            out[hf + "self_attn.k_proj.bias"] = ((*a, "k_bias"), (k * d,), (k, d))
            out[hf + "self_attn.v_proj.bias"] = ((*a, "v_bias"), (k * d,), (k, d))
        if config.attention_out_bias:
            out[hf + "self_attn.o_proj.bias"] = ((*a, "o_bias"), (e,), (e,))
        m = (*p, "mlp")
        out[hf + "mlp.gate_proj.weight"] = ((*m, "gate_proj"), (f, e), (f, e))
        out[hf + "mlp.up_proj.weight"] = ((*m, "up_proj"), (f, e), (f, e))
        out[hf + "mlp.down_proj.weight"] = ((*m, "down_proj"), (e, f), (e, f))
    return out


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    config_file = pathlib.Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in model folder {path}")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"cannot parse {config_file}: {err}") from err
    try:
        return ModelConfig.from_hf_dict(hf)
    except (ValueError, TypeError) as err:   # from_hf_dict names the key; the file is named here
        raise CheckpointError(f"{config_file}: {err}") from None


def _tensor_files(folder: pathlib.Path) -> dict[str, list[str] | None]:
    """safetensors file name -> the tensor names the index assigns to it (None: unindexed, take all)."""
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"cannot parse {index_file}: {err!r}") from err
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = sorted(f for f in files if not (folder / f).is_file())
        if missing:
            raise CheckpointError(f"missing shard file(s) listed in {index_file}: {', '.join(missing)}")
        return dict(files)
    if (folder / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in model folder {folder}")


def from_pretrained(
    path: str | os.PathLike,
    dtype=jnp.bfloat16,
    *,
    device: jax.Device | jax.sharding.Sharding | None = None,
    shardings: Shardings | None = None,
) -> LlamaModel:
    """Loads a Llama / Qwen2 / Mistral model into a LlamaModel with params in `dtype`: a Hugging Face folder,
    a GGUF file or a folder holding one (gguf_loader.from_gguf), or a pretrained preset name
    (pretrained.PRETRAINED, e.g. "smollm2-135m").

    `device`: where params go (default: jax's default device); or `shardings`: a function from each param's state
    path to its Sharding, each tensor placed into its shards as it is read (tp.load_model). Raises
    CheckpointError naming the file or tensor for missing/corrupt shards, missing or unexpected tensors and shape
    mismatches, and ValueError naming an unsupported architecture.
    """
    folder = resolve_model_path(path)
    gguf_file = find_gguf(folder)
    if gguf_file is not None:
        model = from_gguf(gguf_file, dtype, device=device, shardings=shardings)
        preset = PRETRAINED.get(path) if isinstance(path, str) else None
        if getattr(preset, "sha256", None):     # a preset's pinned file: its shipped label table is found by it
            model.config = model.config.replace(file_sha256=preset.sha256)
        return model
    config = read_hf_config(folder)
    files = _tensor_files(folder)
    expected = hf_tensor_map(config)
    np_dtype = np.dtype(dtype)

    params: dict[tuple[str | int, ...], jax.Array] = {}  # state path -> device array
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file, names in files.items():
        _load_file(folder / file, names, expected, np_dtype, device, shardings, params, loaded, unexpected)

    return assemble(config, dtype, params, where=folder, unexpected=unexpected, missing=sorted(set(expected) - loaded),
                    source="hf_tensor_map", device=device, shardings=shardings)


def _load_file(
    file: pathlib.Path,
    names: list[str] | None,
    expected: dict[str, _Target],
    np_dtype: np.dtype,
    device,
    shardings: Shardings | None,
    params: dict[tuple[str | int, ...], jax.Array],
    loaded: set[str],
    unexpected: list[str],
) -> None:
    try:
        with safe_open(file, framework="numpy") as f:
            keys = set(f.keys())
            if names is not None:
                absent = sorted(set(names) - keys)
                if absent:
                    raise CheckpointError(f"tensor(s) {', '.join(absent[:8])} listed in the index missing from {file}")
            for name in sorted(keys if names is None else names):
                if name not in expected:
                    if not (name.endswith(_IGNORED_SUFFIXES) or _is_tied_head(name, expected)):
                        unexpected.append(name)
                    continue
                path, hf_shape, param_shape = expected[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != hf_shape:
                    raise CheckpointError(f"tensor {name} in {file} has shape {shape}, config implies {hf_shape}")
                host = f.get_tensor(name).reshape(param_shape).astype(np_dtype, copy=False)
                params[path] = jax.device_put(host, placement(device, shardings, path))
                del host  # the host copy dies here, before the next tensor is read
                loaded.add(name)
    except SafetensorError as err:
        raise CheckpointError(f"corrupt or unreadable safetensors file {file}: {err}") from err
    except OSError as err:
        raise CheckpointError(f"cannot read safetensors file {file}: {err}") from err


def _is_tied_head(name: str, expected: dict[str, _Target]) -> bool:
    # Some tied checkpoints still store lm_head.weight (a copy of the embedding); the model ignores it.
    return name == "lm_head.weight" and "lm_head.weight" not in expected
