"""Deterministic speculative decoding (SpecConfig.deterministic, issue 51): every step is a K + 1-row verification,
so greedy speculative tokens equal those of method "none" (plain decoding through the same program) token for
token in bfloat16, on the dense and the sparse cache, with drafts accepted; no one-row program (the plain decode
chunk, the chunk's one-row branch) runs; bad values and CLI flags.

On CPU the tiny random model's bfloat16 greedy tokens agree in the default mode as well (its logits are far from
ties), so token equality alone would not show that the one-row programs are gone: `decode_layers`, the body of
every one-row step, raises if it is traced, and the program entry points are spied on.
Shapes: the tiny model in bfloat16, 2 slots, page 16, token budget 64, K = 3, copy-heavy prompts (one queues)."""
import dataclasses

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.runtime import program as program_module
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.runtime.speculative.rules import SpecConfig

K = 3
MAX_NEW = 40


@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    # max_tokens of its own: a Program (shared by config) that no other test module traced, so the decode_layers
    # spy below sees every trace
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=240, page_size=16, token_budget=64, verify_rows=K + 1,
                               dtype=jnp.bfloat16)
    rng = np.random.default_rng(3)
    unit = [int(t) for t in rng.integers(0, 256, 12)]
    prompts = [unit * 6 + unit[:5], (unit[::-1] * 8)[:90], (unit[:7] * 12)[:80]]
    return model, cfg, prompts


def run(gen, prompts, spec, monkeypatch, params=None):
    """Greedy tokens of an Engine over `gen` with `spec`, where no one-row program may run: decode_layers raises if
    traced, and the host's entry points are recorded -> (tokens, SpecDecoder, verify row counts, chunk fixed
    flags)."""
    def no_one_row(*a, **kw):
        raise AssertionError("a one-row decode step was traced in deterministic mode")
    monkeypatch.setattr(program_module, "decode_layers", no_one_row)
    monkeypatch.setattr(gen, "decode_chunk", no_one_row)
    rows, fixed = [], []
    verify, spec_chunk = gen.program.verify, gen.program.spec_chunk
    monkeypatch.setattr(gen.program, "verify", lambda r, *a: rows.append(r) or verify(r, *a))
    monkeypatch.setattr(gen.program, "spec_chunk",
                        lambda *a, **kw: fixed.append(kw.get("fixed")) or spec_chunk(*a, **kw))
    eng = Engine(generator=gen, speculative=spec)
    reqs = eng.run(prompts, params or SamplingParams(max_new_tokens=MAX_NEW))
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    monkeypatch.undo()
    return [r.tokens for r in reqs], eng.spec, rows, fixed


@pytest.mark.parametrize("attention", [pytest.param("dense", marks=pytest.mark.slow), "sparse"])
def test_deterministic_speculative_equals_deterministic_plain_bf16(setup, monkeypatch, attention):
    """The ngram drafter (device chunks, per-step verifications) against method "none": the same greedy tokens in
    bfloat16, drafts accepted, every verification K + 1 rows (no batch gate although most drafts are rejected)."""
    model, cfg, prompts = setup
    gen = Generator(model, cfg, attention=attention)
    params = [SamplingParams(max_new_tokens=n) for n in (MAX_NEW, 13, 29)]     # lengths that end mid-chunk
    plain, none, rows, fixed = run(gen, prompts, SpecConfig("none", K, deterministic=True), monkeypatch, params)
    assert none.proposed == 0 and none.chunks > 0 and fixed and all(fixed) and not rows
    spec, sp, rows, fixed = run(gen, prompts, SpecConfig("ngram", K, deterministic=True), monkeypatch, params)
    assert spec == plain
    assert sp.accepted > 0 and sp.chunks > 0 and all(fixed) and not rows
    # one verification per Engine step (the path of oracle drafters and the draft model): K + 1 rows each
    tokens, sp, rows, _ = run_per_step(gen, prompts, SpecConfig("ngram", K, deterministic=True), monkeypatch, params)
    assert tokens == plain and sp.accepted > 0 and rows and set(rows) == {K + 1}


def run_per_step(gen, prompts, spec, monkeypatch, params):
    """`run` with the SpecDecoder's device chunk off (chunk_steps = 0: one verification per Engine step)."""
    real_init = Engine.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        self.spec.chunk_steps = 0
    monkeypatch.setattr(Engine, "__init__", init)
    return run(gen, prompts, spec, monkeypatch, params)


@pytest.mark.slow
def test_deterministic_draft_model_equals_deterministic_plain_bf16(setup, monkeypatch):
    """A draft model (the target itself: every draft accepted) on the dense cache: verifications of K + 1 rows with
    the draft's distributions, the same greedy tokens as method "none"."""
    model, cfg, prompts = setup
    gen = Generator(model, cfg, attention="dense")
    plain, *_ = run(gen, prompts[:2], SpecConfig("none", K, deterministic=True), monkeypatch)
    spec = SpecConfig("draft", K, draft_model=model, deterministic=True)
    tokens, sp, rows, fixed = run(gen, prompts[:2], spec, monkeypatch)
    assert tokens == plain
    assert sp.acceptance_rate > 0.9 and set(rows) == {K + 1} and not fixed


def test_deterministic_config_errors():
    with pytest.raises(ValueError, match=r"method 'none' .* needs deterministic=True"):
        SpecConfig("none", 4)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="deterministic"):
            SpecConfig("ngram", 4, deterministic=bad)
    with pytest.raises(ValueError, match="method 'none' takes no draft_model"):
        SpecConfig("none", 4, draft_model="x", deterministic=True)
    assert SpecConfig("none", 4, deterministic=True).deterministic
    assert dataclasses.replace(SpecConfig("ngram", 4), deterministic=True).method == "ngram"


def test_cli_deterministic_flag():
    from ulacache_jax.app import cli, jsonl_io, resume
    p = cli.build_parser()
    base = ["generate", "--input", "in.jsonl", "--output", "out.jsonl"]
    assert cli._spec_config(p.parse_args(base + ["--deterministic"])) == SpecConfig("none", 4, deterministic=True)
    got = cli._spec_config(p.parse_args(base + ["--deterministic", "--speculative", "ngram",
                                                "--num-speculative-tokens", "6"]))
    assert got == SpecConfig("ngram", 6, deterministic=True)
    got = cli._spec_config(p.parse_args(base + ["--deterministic", "--num-speculative-tokens", "2"]))
    assert got == SpecConfig("none", 2, deterministic=True)
    for bad in (["--num-speculative-tokens", "2"], ["--deterministic", "--num-speculative-tokens", "64"],
                ["--deterministic", "--draft-model", "m"]):
        with pytest.raises(cli.UsageError):
            cli._spec_config(p.parse_args(base + bad))
    # it changes bfloat16 tokens: a run with it does not resume a file written without it
    fp = [jsonl_io.settings_fingerprint(resume.run_settings(p.parse_args(base + extra)))
          for extra in ([], ["--deterministic"])]
    assert fp[0] != fp[1]
    serve = p.parse_args(["serve", "--deterministic"])
    assert cli.decode_chunk_steps(serve) is None            # page-long chunks, as with --speculative
