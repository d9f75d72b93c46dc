"""GGUF files (llama.cpp's format) -> LlamaModel, read with llama.cpp's `gguf` package.

A GGUF holds the hyperparameters as metadata (`{arch}.block_count`, ...) and every tensor in one of ggml's
types (F32, F16, BF16, Q8_0, Q4_1, K-quants, ...). `gguf.quants.dequantize` turns any type it knows into a
float32 numpy array whose shape is already row-major [out, in] (GGUF lists dims innermost first; the reader
reverses them), i.e. Hugging Face's layout, so each tensor maps onto our params exactly as in hf_loader.

Two things differ from a Hugging Face checkpoint:
- llama.cpp's converter permutes the rows of q_proj / k_proj (and their biases) of llama and mistral models
  from HF's rotate-half RoPE layout (pairs (i, i + D/2)) to interleaved pairs (2i, 2i + 1): per head, rows
  [2, D/2] become [D/2, 2]. We undo it. Qwen2 is converted without the permutation.
- The output head is absent when the embeddings are tied.

Memory: tensors are dequantized one at a time from the memory-mapped file: dequantize, cast, `device_put`,
drop the host copy, so peak host memory stays near one float32 tensor; with `shardings` each tensor goes straight
into its shards (as in hf_loader).
"""

from __future__ import annotations

import os
import pathlib
import struct
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, RopeScaling, rope_inv_freq
from .gguf_tokenizer import gguf_eos_ids  # the tokenizer module decides what ends a turn
from .llama import LlamaModel
from .weights import CheckpointError, Shardings, assemble, placement

GGUF_SUFFIX = ".gguf"
# GGUF `general.architecture` -> our architecture name.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# Architectures whose converter applies the rotary row permutation to Q/K.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
_REQUIRED = object()


def find_gguf(path: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file that `path` names: the file itself, or the one `.gguf` in a folder without a config.json.
    None when `path` is not a GGUF (a Hugging Face folder, a checkpoint). Several GGUFs in one folder are an
    error naming them (which one is meant is not ours to guess)."""
    path = pathlib.Path(path)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        raise CheckpointError(
            f"{len(found)} GGUF files in {path}: {', '.join(p.name for p in found)}; pass the file to load"
        )
    return found[0] if found else None


def open_gguf(file: str | os.PathLike):
    """A `gguf.GGUFReader` on `file` (memory-mapped; nothing is read yet), or CheckpointError naming it."""
    import gguf

    try:
        return gguf.GGUFReader(file, "r")
    except (OSError, ValueError, KeyError, IndexError, EOFError, struct.error) as err:
        # the reader walks the header by offsets: a file cut short (a partial download) or not GGUF at all fails
        # as an index past the end, a bad reshape or a bad struct read
        size = os.path.getsize(file) if os.path.isfile(file) else None
        raise CheckpointError(f"cannot read GGUF file {file} ({size} bytes): {err!r}; is it cut short (a partial "
                              "download) or not a GGUF file?") from err


def metadata(reader, key: str, default: Any = _REQUIRED) -> Any:
    """One metadata value as a Python scalar, str or list; `default` when absent (absent and no default: an
    error naming the key)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"GGUF metadata key {key!r} missing from {reader.data.filename}")
        return default
    return field.contents()


def _decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.999999747e-06 -> 1e-05): the shortest
    repr that round-trips through float32."""
    return float(str(np.float32(value)))


def gguf_config(reader) -> ModelConfig:
    """ModelConfig from a GGUF's metadata (and the presence of bias / output tensors)."""
    file = reader.data.filename
    gguf_arch = metadata(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r} in {file} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    arch = GGUF_ARCHITECTURES[gguf_arch]

    def m(key: str, default: Any = _REQUIRED) -> Any:
        return metadata(reader, f"{gguf_arch}.{key}", default)

    hidden = int(m("embedding_length"))
    num_heads = int(m("attention.head_count"))
    num_kv_heads = int(m("attention.head_count_kv", num_heads))
    head_dim = int(m("attention.key_length", hidden // num_heads))
    value_dim = int(m("attention.value_length", head_dim))
    rope_dim = int(m("rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"unsupported GGUF {file}: value_length {value_dim} != key_length {head_dim}")
    if rope_dim != head_dim:
        raise ValueError(f"unsupported GGUF {file}: partial RoPE (rope.dimension_count {rope_dim} != {head_dim})")

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise CheckpointError(f"GGUF {file} has no token_embd.weight")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(m("vocab_size", int(embd.shape[1])))
    if int(embd.shape[1]) != vocab:
        raise CheckpointError(f"GGUF {file}: token_embd.weight has {int(embd.shape[1])} rows, vocab is {vocab}")

    rope_theta = _decimal(m("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(reader, gguf_arch, rope_theta, head_dim, names)
    sliding = m("attention.sliding_window", None) if arch == "mistral" else None
    bos = metadata(reader, "tokenizer.ggml.bos_token_id", None)

    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(m("feed_forward_length")),
        num_layers=int(m("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=_decimal(m("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        sliding_window=int(sliding) if sliding else None,
        max_position_embeddings=int(m("context_length", 8192)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=gguf_eos_ids(reader),
    )


def _rope_scaling(reader, gguf_arch: str, theta: float, head_dim: int, names: set[str]) -> RopeScaling | None:
    """RoPE scaling from `{arch}.rope.scaling.*` keys, or from a `rope_freqs.weight` tensor (llama.cpp stores
    Llama 3.1's banded scaling as per-frequency divisors, not as parameters: we match it against llama3
    scalings with the usual parameters and refuse it when none fits)."""
    file = reader.data.filename
    kind = metadata(reader, f"{gguf_arch}.rope.scaling.type", None)
    factor = metadata(reader, f"{gguf_arch}.rope.scaling.factor", None)
    if kind is None and metadata(reader, f"{gguf_arch}.rope.scale_linear", None) is not None:
        kind, factor = "linear", metadata(reader, f"{gguf_arch}.rope.scale_linear")
    scaling = None
    if kind not in (None, "none") and not (kind == "linear" and factor in (None, 1.0)):
        if kind != "linear":
            raise ValueError(f"unsupported GGUF rope scaling type {kind!r} in {file} (supported: none, linear)")
        scaling = RopeScaling("linear", _decimal(factor))
    if "rope_freqs.weight" not in names:
        return scaling
    if scaling is not None:
        raise ValueError(f"unsupported GGUF {file}: both rope.scaling.type={kind!r} and a rope_freqs tensor")
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    divisors = np.asarray(_dequantize(t, file), np.float64).reshape(-1)  # [D/2]
    if divisors.shape != (head_dim // 2,):
        raise CheckpointError(f"GGUF {file}: rope_freqs.weight has shape {divisors.shape}, need ({head_dim // 2},)")
    if np.allclose(divisors, 1.0):
        return None
    base = np.asarray(rope_inv_freq(_probe_config(theta, head_dim, None)))
    want = base / divisors
    factor = float(divisors.max())
    for orig in (8192, 4096, 16384, 32768, 2048):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            cand = RopeScaling("llama3", factor, low, high, orig)
            got = np.asarray(rope_inv_freq(_probe_config(theta, head_dim, cand)))
            if np.allclose(got, want, rtol=1e-5, atol=0):
                return cand
    raise ValueError(
        f"unsupported GGUF {file}: rope_freqs.weight (max divisor {factor:g}) matches no llama3 rope scaling"
    )


def _probe_config(theta: float, head_dim: int, scaling: RopeScaling | None) -> ModelConfig:
    return ModelConfig("llama", 1, 1, 1, 1, 1, 1, head_dim, rope_theta=theta, rope_scaling=scaling)


# One GGUF tensor: state path, the [out, in] numpy shape it must have, the param's shape, and the head count
# of the rotary row permutation to undo (None: not permuted).
_Target = tuple[tuple[str | int, ...], tuple[int, ...], tuple[int, ...], int | None]


def gguf_tensor_map(config: ModelConfig) -> dict[str, _Target]:
    """GGUF tensor name -> (state path, numpy shape, param shape, permuted heads) for every needed tensor."""
    e, f, h, k, d, v = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.vocab_size,
    )
    permuted = config.architecture in _PERMUTED_ARCHITECTURES
    ph, pk = (h, k) if permuted else (None, None)
    out: dict[str, _Target] = {
        "token_embd.weight": (("embed_tokens",), (v, e), (v, e), None),
        "output_norm.weight": (("norm", "weight"), (e,), (e,), None),
    }
    if not config.tie_word_embeddings:
        out["output.weight"] = (("lm_head",), (v, e), (v, e), None)
    for i in range(config.num_layers):
        g, p = f"blk.{i}.", ("layers", i)
        a, mlp = (*p, "self_attn"), (*p, "mlp")
        out[g + "attn_norm.weight"] = ((*p, "input_layernorm", "weight"), (e,), (e,), None)
        out[g + "ffn_norm.weight"] = ((*p, "post_attention_layernorm", "weight"), (e,), (e,), None)
        out[g + "attn_q.weight"] = ((*a, "q_proj"), (h * d, e), (h, d, e), ph)
        out[g + "attn_k.weight"] = ((*a, "k_proj"), (k * d, e), (k, d, e), pk)
        out[g + "attn_v.weight"] = ((*a, "v_proj"), (k * d, e), (k, d, e), None)
        out[g + "attn_output.weight"] = ((*a, "o_proj"), (e, h * d), (e, h, d), None)
        if config.attention_bias:
            out[g + "attn_q.bias"] = ((*a, "q_bias"), (h * d,), (h, d), ph)
            out[g + "attn_k.bias"] = ((*a, "k_bias"), (k * d,), (k, d), pk)
            out[g + "attn_v.bias"] = ((*a, "v_bias"), (k * d,), (k, d), None)
        if config.attention_out_bias:
            out[g + "attn_output.bias"] = ((*a, "o_bias"), (e,), (e,), None)
        out[g + "ffn_gate.weight"] = ((*mlp, "gate_proj"), (f, e), (f, e), None)
        out[g + "ffn_up.weight"] = ((*mlp, "up_proj"), (f, e), (f, e), None)
        out[g + "ffn_down.weight"] = ((*mlp, "down_proj"), (e, f), (e, f), None)
    return out


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_heads)`: rows [N * D] (or a bias [N * D]) in interleaved-pair order
    [N, D/2, 2] back to HF's rotate-half order [N, 2, D/2]."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation (HF rotate-half rows -> interleaved pairs); for writing test files."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t, file) -> np.ndarray:
    """One tensor as float32 numpy [out, in] (or [n] for 1-D); an unsupported ggml type is an error naming it."""
    import gguf

    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as err:
        raise CheckpointError(
            f"GGUF {file}: tensor {t.name} has type {t.tensor_type.name}, which gguf cannot dequantize ({err})"
        ) from None
    return np.asarray(w, np.float32) if w.dtype != np.float32 else w


def from_gguf(
    path: str | os.PathLike,
    dtype=jnp.bfloat16,
    *,
    device: jax.Device | jax.sharding.Sharding | None = None,
    shardings: Shardings | None = None,
) -> LlamaModel:
    """Loads a GGUF (a `.gguf` file, or a folder holding exactly one) into a LlamaModel with params in `dtype`.
    `device` or `shardings` (a function from each param's state path to its Sharding): where params go, as in
    hf_loader.from_pretrained.

    Raises ValueError naming an unsupported architecture or feature, CheckpointError naming the file or tensor
    for an unsupported tensor type, missing, unexpected or misshapen tensors."""
    file = find_gguf(path)
    if file is None:
        raise CheckpointError(f"no .gguf file at {path}")
    reader = open_gguf(file)
    config = gguf_config(reader)
    expected = gguf_tensor_map(config)
    np_dtype = np.dtype(dtype)
    params: dict[tuple[str | int, ...], jax.Array] = {}
    unexpected: list[str] = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into config.rope_scaling by gguf_config
            continue
        if t.name not in expected:
            unexpected.append(t.name)
            continue
        state_path, shape, param_shape, heads = expected[t.name]
        w = _dequantize(t, file)
        if tuple(w.shape) != shape:
            raise CheckpointError(f"tensor {t.name} in {file} has shape {tuple(w.shape)}, config implies {shape}")
        if heads is not None:
            w = unpermute_rotary(w, heads)
        host = w.reshape(param_shape).astype(np_dtype)  # a fresh array: the memmap / float32 copy can go
        del w
        params[state_path] = jax.device_put(host, placement(device, shardings, state_path))
        del host
    loaded = {expected_name for expected_name, target in expected.items() if target[0] in params}
    return assemble(config, dtype, params, where=file, unexpected=unexpected, missing=sorted(set(expected) - loaded),
                    source="gguf_tensor_map", device=device, shardings=shardings)
