"""Llama-family models (Llama 2/3/3.1, Qwen2, Mistral) in Flax NNX: Hugging Face checkpoints and GGUF files
in, orbax checkpoints out, pluggable attention for the paged cache; tokenizers with chat templates; trained
models shipped in registry packages (`PRETRAINED`, e.g. "smollm2-135m")."""

from .attention import AttnFn, dense_attention
from .chat_template import ChatTemplateError, render_chat_template
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
from .gguf_loader import find_gguf, from_gguf, gguf_config, open_gguf
from .hf_loader import from_pretrained, read_hf_config
from .llama import DecoderLayer, LlamaModel
from .pretrained import PRETRAINED, resolve_model_path, resolve_pretrained
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from .weights import CheckpointError

__all__ = [
    "AttnFn",
    "BYTE_BOS_ID",
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "ByteTokenizer",
    "ChatTemplateError",
    "CheckpointError",
    "DecoderLayer",
    "HFTokenizer",
    "LlamaModel",
    "ModelConfig",
    "PRESETS",
    "PRETRAINED",
    "RopeScaling",
    "Tokenizer",
    "dense_attention",
    "find_gguf",
    "from_gguf",
    "from_pretrained",
    "get_preset",
    "gguf_config",
    "load",
    "load_tokenizer",
    "open_gguf",
    "read_hf_config",
    "render_chat_template",
    "resolve_model_path",
    "resolve_pretrained",
    "save",
]
