"""A GGUF's tokenizer metadata -> a Hugging Face `tokenizers.Tokenizer` (byte-level BPE, the `gpt2` model).

GGUF stores the vocabulary (`tokenizer.ggml.tokens`), the merges, per-token types (control and user-defined
tokens are the special ones) and the name of the pre-tokenizer (`tokenizer.ggml.pre`) but not the pre-tokenizer
itself: llama.cpp keeps one regex per name in its source. `PRE_TOKENIZERS` rebuilds, for the names we know,
the pre-tokenizer of the model's original tokenizer.json; an unknown name is an error rather than a silently
different split.
"""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

# llama.cpp's token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
# Texts of special tokens that end a turn in the chat formats we know (ChatML, Llama 3, Phi, Gemma); those in a
# vocab as special tokens join the GGUF's eos/eot ids as stop ids, as llama.cpp's end-of-generation set does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _gpt2(add_prefix_space: bool):
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _digits_gpt2(add_prefix_space: bool):  # SmolLM / StarCoder: every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2(add_prefix_space)]
    )


def _split(regex: str):
    def make(add_prefix_space: bool):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )

    return make


# `tokenizer.ggml.pre` -> (pre-tokenizer factory taking add_prefix_space, BPE ignore_merges). Llama 3's
# tokenizer looks a whole pre-token up in the vocab before merging (ignore_merges), as llama.cpp does for it.
PRE_TOKENIZERS = {
    "default": (_gpt2, False),
    "gpt-2": (_gpt2, False),
    "gpt2": (_gpt2, False),
    "smollm": (_digits_gpt2, False),
    "starcoder": (_digits_gpt2, False),
    "llama-bpe": (_split(_LLAMA3_REGEX), True),
    "llama3": (_split(_LLAMA3_REGEX), True),
    "llama-v3": (_split(_LLAMA3_REGEX), True),
    "qwen2": (_split(_QWEN2_REGEX), False),
}


def _meta(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_special_ids(reader) -> dict[str, int]:
    """{"bos": id, "eos": id, "pad": id, "unk": id, "eot": id, "eom": id} for those the metadata names."""
    out = {}
    for name in ("bos", "eos", "padding", "unknown", "eot", "eom"):
        value = _meta(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            out[{"padding": "pad", "unknown": "unk"}.get(name, name)] = int(value)
    return out


def gguf_eos_ids(reader) -> tuple[int, ...]:
    """Ids that end generation: the metadata's eos / eot / eom ids, then the special tokens of the vocab whose
    text is a known end-of-turn marker (`END_OF_TURN_TOKENS`, e.g. SmolLM2's `<|im_end|>`). Eos first."""
    specials = gguf_special_ids(reader)
    ids = [specials[k] for k in ("eos", "eot", "eom") if k in specials]
    tokens = _meta(reader, "tokenizer.ggml.tokens") or []
    types = _meta(reader, "tokenizer.ggml.token_type")
    wanted = set(END_OF_TURN_TOKENS)
    for i, text in enumerate(tokens):
        if text in wanted and (types is None or types[i] in _SPECIAL_TYPES) and i not in ids:
            ids.append(i)
    return tuple(dict.fromkeys(ids))


def gguf_tokenizer(reader) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer a GGUF's metadata describes (`tokenizer.ggml.model == "gpt2"`).

    Control and user-defined tokens become special added tokens (matched in the text before pre-tokenizing,
    skipped by decode(skip_special_tokens=True)); `tokenizer.ggml.add_bos_token` / `add_eos_token` become the
    post-processor that encode(add_special_tokens=True) applies."""
    file = reader.data.filename
    model = _meta(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"GGUF {file} has no tokenizer metadata (tokenizer.ggml.model)")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} in {file} (supported: gpt2, byte-level BPE)")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} in {file} (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = list(_meta(reader, "tokenizer.ggml.tokens"))
    types = _meta(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges_raw = _meta(reader, "tokenizer.ggml.merges") or []
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ValueError(f"GGUF {file}: token {dup!r} appears more than once in tokenizer.ggml.tokens")
    merges = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"GGUF {file}: merge {m!r} is not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    add_prefix_space = bool(_meta(reader, "tokenizer.ggml.add_space_prefix", False))
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
    )
    tok.pre_tokenizer = make_pre(add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in _SPECIAL_TYPES]
    )
    specials = gguf_special_ids(reader)
    add_bos = bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)) and "bos" in specials
    add_eos = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)) and "eos" in specials
    if add_bos or add_eos:
        pieces = {k: (tokens[specials[k]], specials[k]) for k in ("bos", "eos") if k in specials}
        single = ["$A"]
        pair = ["$A", "$B"]
        if add_bos:
            single, pair = [pieces["bos"][0], *single], [pieces["bos"][0], "$A", pieces["bos"][0], "$B"]
        if add_eos:
            single, pair = [*single, pieces["eos"][0]], [*pair, pieces["eos"][0]]
        used = [pieces[k] for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=used)
    return tok
