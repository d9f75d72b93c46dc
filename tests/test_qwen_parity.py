"""Parity with transformers on the real pretrained preset qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M).

The reference (tests/fixtures/qwen2.5-coder-0.5b.json, written by tests/fixtures/make_qwen_fixture.py in the
3.11 side venv) is transformers loading the SAME GGUF file (`gguf_file=`, float32): one ChatML prompt's token ids,
the last prompt position's float32 logits at their top-20 ids with the full-vocab argmax and logsumexp, and
the 12 greedy new tokens (decoded past the end of the turn, with each step's top-1 / top-2 logit margin).
Skipped unless the GGUF is in the model cache (`ulacache fetch-model qwen2.5-coder-0.5b`).

Tolerance on the logits: both sides dequantise Q4_K / Q6_K to the same float32 weights exactly (the same
formula on the same bytes), so all that differs is float32 rounding in another summation order (XLA's dot and
reduction tiling vs torch's BLAS) over 24 layers. Measured on CPU: at most 1.1e-5 on logits of ~20 (7e-7
relative). We allow 2e-4 x (1 + |logit|) (< 5e-3 here): ~400x the measured difference, room for other BLAS /
XLA builds and CPUs, yet far below what a real mismatch moves (a wrong RoPE, norm, bias or dequantisation
shifts logits by tenths to whole units) and 60x below the smallest greedy top-1/top-2 margin in the fixture
(0.28), so the greedy ids must match exactly. (On a GPU, float32 dots may run as TF32, ~1e-3 relative: this
bound is for CPU, where the model cache is.)

Cost (2 slow cores): the GGUF's header ~10 s (parsed once for the model and its tokenizer: `loaded`), the weights
~10 s, the logits ~10 s, the dense greedy run ~25-35 s; one test does all of it so that pytest-xdist workers do
not each load the 2 GB float32 model. The sparse run (its own compile, 40-100 s) is opt-in: ULACACHE_QWEN_SPARSE=1.
"""

import json
import os
import pathlib
from unittest import mock

import pytest

import jax.numpy as jnp
import numpy as np
from flax import nnx

import ulacache_jax
from ulacache_jax import models
from ulacache_jax.models import gguf_loader, pretrained

NAME = "qwen2.5-coder-0.5b"
FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / f"{NAME}.json"
TOL = 2e-4           # |ours - transformers| <= TOL * (1 + |logit|): see the module docstring
REF = json.loads(FIXTURE.read_text())


def _gguf_path() -> pathlib.Path:
    try:
        return models.resolve_pretrained(NAME)
    except FileNotFoundError:
        pytest.skip(f"{NAME} is not in the model cache: run `ulacache fetch-model {NAME}`")


@pytest.fixture(scope="module")
def loaded():
    """(model in float32, tokenizer), both from the cached GGUF through one reader: the model and the tokenizer
    loaders each open the file (gguf_loader.open_gguf), and parsing its header (the metadata of a 151K-token
    vocabulary and its merges) takes ~10 s a time on CPU; both load from the same parsed header here."""
    path = _gguf_path()
    reader = gguf_loader.open_gguf(path)
    with mock.patch.object(gguf_loader, "open_gguf", lambda file: reader):
        return models.from_pretrained(path, dtype=jnp.float32), models.load_tokenizer(path)


def test_fixture_is_of_the_pinned_gguf():
    path = _gguf_path()
    entry = pretrained.split_model(NAME)
    assert REF["gguf_file"] == entry.file == path.name
    if entry.sha256 is not None:        # hashing 0.5 GB here would cost seconds; the preset pins it
        assert REF["gguf_sha256"] == entry.sha256


def _check_greedy(model, tok, attention):
    g = REF["greedy"]
    # stop_ids=(): decode all 12 tokens past <|im_end|>, as the reference did (eos_token_id=None)
    out = ulacache_jax.generate(model, [REF["prompt_ids"]], tokenizer=tok, max_new_tokens=g["max_new_tokens"],
                                attention=attention, stop_ids=())
    text = tok.decode(out[0], skip_special_tokens=False)
    print(f"\n{attention}: {out[0]} {text!r} (transformers {g['text_with_specials']!r})")
    assert out[0] == g["ids"]
    assert text == g["text_with_specials"]
    assert tok.decode(out[0]) == g["text"]


def test_matches_transformers(loaded):
    model, tok = loaded
    # the chat template (the GGUF's, with its default system prompt) gives transformers' ids
    ids = list(tok.apply_chat_template(REF["messages"], add_generation_prompt=True))
    assert ids == REF["prompt_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == REF["prompt_text"]

    # the last prompt position's float32 logits
    assert model.config.vocab_size == REF["vocab_size"]
    ref = REF["last_logits"]
    x = jnp.asarray([REF["prompt_ids"]], dtype=jnp.int32)
    last = np.asarray(nnx.jit(lambda m, x: m(x)[0, -1])(model, x), dtype=np.float64)   # [V]
    top_ids, want = np.asarray(ref["top_ids"]), np.asarray(ref["top_logits"])
    got = last[top_ids]
    diff = np.abs(got - want)
    print(f"\nmax |logit diff| over the top-20: {diff.max():.3e} (max relative {np.max(diff / np.abs(want)):.3e})")
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    assert int(np.argmax(last)) == ref["argmax"]
    # the whole vocabulary, through its logsumexp (a shift of the full distribution would show here)
    lse = float(np.log(np.sum(np.exp(last - last.max()))) + last.max())
    assert abs(lse - ref["logsumexp"]) <= TOL * (1 + abs(ref["logsumexp"]))
    # our ranking of the top-10 is the reference's (its neighbours differ by >= 0.0075, more than twice the
    # tolerance at these logits, so it follows from the bound; the 21st logit is not recorded, hence not top-20)
    assert list(np.argsort(-last, kind="stable")[:10]) == list(top_ids[:10])

    # greedy decoding through the engine, dense attention
    _check_greedy(model, tok, "dense")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ULACACHE_QWEN_SPARSE") != "1",
                    reason="the sparse run compiles its own program (40-100 s on CPU): set ULACACHE_QWEN_SPARSE=1")
def test_greedy_sparse_matches_transformers(loaded):
    # 41 + 12 tokens are under the default token_budget (2048): sparse selects every page and must equal dense
    _check_greedy(*loaded, "sparse")
