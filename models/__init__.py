"""Llama-family models (Llama 2/3/3.1, Qwen2, Mistral) in Flax NNX: Hugging Face checkpoints in, orbax
checkpoints out, pluggable attention for the paged cache."""

from .attention import AttnFn, dense_attention
from .checkpoint import load, save
from .config import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    PRESETS,
    ModelConfig,
    RopeScaling,
    get_preset,
)
from .hf_loader import CheckpointError, from_pretrained, read_hf_config
from .llama import DecoderLayer, LlamaModel
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "AttnFn",
    "BYTE_BOS_ID",
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "CheckpointError",
    "DecoderLayer",
    "HFTokenizer",
    "LlamaModel",
    "ModelConfig",
    "PRESETS",
    "RopeScaling",
    "Tokenizer",
    "dense_attention",
    "from_pretrained",
    "get_preset",
    "load",
    "load_tokenizer",
    "read_hf_config",
    "save",
]
