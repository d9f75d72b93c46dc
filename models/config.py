"""Frozen model configuration for the Llama family (Llama 2/3/3.1, Qwen2, Mistral), with presets.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` in both the Hub style (top-level `rope_theta` plus
`rope_scaling`) and the transformers 5 style (`rope_parameters`); `to_dict` / `from_dict` are our own JSON form,
used by the orbax checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping

# HF `architectures` entry -> our architecture name. All three share one decoder; they differ only in config
# (qkv bias, sliding window, tied embeddings), so one module covers them.
HF_ARCHITECTURES = types.MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
    }
)
ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3`: Llama 3.1's banded rescaling of the inverse frequencies (wavelengths
    above original/low_freq_factor divided by `factor`, below original/high_freq_factor kept, smooth in
    between). `linear`: every inverse frequency divided by `factor` (position interpolation)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError(
                    "llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                    f"{self.high_freq_factor} and {self.low_freq_factor}"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope scaling needs original_max_position_embeddings > 0")


# keys a Hugging Face config.json must hold (positive ints); the others have defaults
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder. Param dtype is not part of it (a model argument)."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias=True)
    attention_out_bias: bool = False  # bias on o_proj (only Llama with attention_bias=True)
    sliding_window: int | None = None  # Mistral: a query attends to keys with q_pos - k_pos < sliding_window
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    file_sha256: str | None = None  # the weights file's sha256 where known (a pretrained preset's pin): finds the
                                    # model's shipped label-channel table (calibration.py); None: none is looked up

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {self.sliding_window}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        for tok in (self.bos_token_id, *self.eos_token_ids):
            if tok is not None and (not isinstance(tok, int) or isinstance(tok, bool)):
                raise ValueError(f"special token id {tok!r} must be an int")
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(f"special token id {tok} outside vocab of {self.vocab_size}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.file_sha256 is not None and (not isinstance(self.file_sha256, str) or len(self.file_sha256) != 64):
            raise ValueError(f"file_sha256 must be None or 64 hex digits, got {self.file_sha256!r}")

    @property
    def num_queries_per_kv(self) -> int:
        """GQA group size: query heads sharing one kv head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        e, f, h, k, d, v = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
        )
        attn = e * (h + 2 * k) * d + h * d * e
        attn += (h + 2 * k) * d * self.attention_bias + e * self.attention_out_bias
        per_layer = attn + 3 * e * f + 2 * e
        return v * e * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + e

    # --- serialization -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; unknown keys are an error so a typo cannot silently change a model. Every bad
        input is a ValueError naming the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a ModelConfig dict must be a mapping of its fields, got {type(d).__name__}")
        d = dict(d)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {sorted(unknown)}")
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in d]
        if missing:
            raise ValueError(f"missing ModelConfig keys: {missing}")
        if d.get("rope_scaling") is not None:
            rs = d["rope_scaling"]
            if not isinstance(rs, Mapping):
                raise ValueError(f"rope_scaling must be a mapping or null, got {rs!r}")
            try:
                d["rope_scaling"] = RopeScaling(**rs)
            except TypeError as e:
                raise ValueError(f"rope_scaling {dict(rs)!r}: {e}") from None
        if "eos_token_ids" in d:
            if not isinstance(d["eos_token_ids"], (list, tuple)):
                raise ValueError(f"eos_token_ids must be a list of ints, got {d['eos_token_ids']!r}")
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict (Llama, Qwen2 or Mistral). Every bad input is a
        ValueError naming the key (hf_loader.read_hf_config adds the file)."""
        if not isinstance(hf, Mapping):
            raise ValueError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
        missing = [k for k in _HF_REQUIRED if hf.get(k) is None]
        if missing:
            raise ValueError(f"missing required key(s) {', '.join(map(repr, missing))}")
        for k in _HF_REQUIRED:
            if not isinstance(hf[k], int) or isinstance(hf[k], bool) or hf[k] <= 0:
                raise ValueError(f"{k!r} must be a positive int, got {hf[k]!r}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"'architectures' must be a list of names, got {archs!r}")
        known = [a for a in archs if a in HF_ARCHITECTURES]
        if known:
            arch = HF_ARCHITECTURES[known[0]]
        elif not archs and hf.get("model_type") in ARCHITECTURES:
            arch = hf["model_type"]
        else:
            named = ", ".join(archs) if archs else f"model_type={hf.get('model_type')!r}"
            raise ValueError(
                f"unsupported architecture {named} (supported: {', '.join(HF_ARCHITECTURES)})"
            )

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}: only SwiGLU (silu) is implemented")
        if hf.get("mlp_bias", False):
            raise ValueError("unsupported mlp_bias=True: the MLP has no biases in this implementation")
        if arch == "qwen2" and hf.get("use_sliding_window", False):
            # Qwen2 applies the window only to layers >= max_window_layers; no released Qwen2.5 enables it.
            raise ValueError("unsupported Qwen2 use_sliding_window=True (per-layer sliding windows)")

        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _hf_rope(hf)
        if arch == "qwen2":
            attention_bias, attention_out_bias = True, False  # Qwen2 hard-codes qkv bias, no o_proj bias
        elif arch == "llama":
            attention_bias = attention_out_bias = bool(hf.get("attention_bias", False))
        else:
            attention_bias = attention_out_bias = False
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        for key, value in (("rope_theta", rope_theta), ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{key!r} must be a number, got {value!r}")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # Llama/Qwen2/Mistral configs default to untied (PretrainedConfig's generic default is tied).
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            sliding_window=hf.get("sliding_window") if arch == "mistral" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params is not None:
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise ValueError("unsupported per-layer-type rope_parameters (keys: " + ", ".join(params) + ")")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
    if not scaling:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"'rope_scaling' must be an object or null, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, {', '.join(ROPE_TYPES)})")
    try:
        return theta, _hf_rope_scaling(rope_type, scaling)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope scaling {rope_type!r}: missing or bad value ({type(e).__name__}: {e}) in "
                         f"{dict(scaling)!r}") from None


def _hf_rope_scaling(rope_type: str, scaling: Mapping[str, Any]) -> RopeScaling | None:
    """A supported rope_type's RopeScaling from its HF dict (KeyError / TypeError / ValueError on bad values)."""
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    raise AssertionError(rope_type)   # _hf_rope checked the type


# --- presets -----------------------------------------------------------------------------------------------

# Byte-level vocab: ids 0..255 are bytes, 256 = BOS, 257 = EOS (see tokenizer.ByteTokenizer).
BYTE_VOCAB_SIZE = 258
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257

_LLAMA31_ROPE = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA31_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>

PRESETS = types.MappingProxyType(
    {
        # Tests and CPU demos: GQA ratio 2, byte vocab.
        "tiny": ModelConfig(
            architecture="llama",
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            bos_token_id=BYTE_BOS_ID,
            eos_token_ids=(BYTE_EOS_ID,),
        ),
        # GQA ratio 8 as in Llama-3.1-8B/70B and Qwen2.5-72B, head_dim 128 like the real models.
        "tiny-gqa8": ModelConfig(
            architecture="llama",
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=8,
            num_kv_heads=1,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            max_position_embeddings=131072,
            bos_token_id=BYTE_BOS_ID,
            eos_token_ids=(BYTE_EOS_ID,),
        ),
        "llama-3.1-8b": ModelConfig(
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_ids=_LLAMA31_EOS,
        ),
        "llama-3.1-70b": ModelConfig(
            architecture="llama",
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            rope_scaling=_LLAMA31_ROPE,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_ids=_LLAMA31_EOS,
        ),
        "qwen2.5-72b": ModelConfig(
            architecture="qwen2",
            vocab_size=152064,
            hidden_size=8192,
            intermediate_size=29568,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            attention_bias=True,
            max_position_embeddings=32768,
            bos_token_id=None,  # Qwen's tokenizer adds no BOS
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
    }
)


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r} (available: {', '.join(PRESETS)})") from None


def rope_inv_freq(config: ModelConfig) -> tuple[float, ...]:
    """Inverse frequencies [head_dim // 2] after rope scaling, in float64 (cast at use).

    Mirrors transformers' `_compute_llama3_parameters` / linear scaling, evaluated in float64 so the only
    rounding is the final cast to float32.
    """
    d = config.head_dim
    inv = [1.0 / config.rope_theta ** (2 * i / d) for i in range(d // 2)]
    s = config.rope_scaling
    if s is None:
        return tuple(inv)
    if s.rope_type == "linear":
        return tuple(f / s.factor for f in inv)
    old = s.original_max_position_embeddings
    low_freq_wavelen = old / s.low_freq_factor
    high_freq_wavelen = old / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:
            out.append(f)
        elif wavelen > low_freq_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return tuple(out)
