"""The two-stage rule (ulacache_jax/cache/select/two_stage.py): Quest's page bound shortlists pages and the second
stage scores only those; a shortlist of every page scores as the second stage alone, a smaller one keeps Quest's
top pages; a covering budget gives dense attention's tokens; a small budget runs through the Engine with shared
prefixes, speculative decoding and chunked prefill, unchanged by them; its bytes; the CLI's --two-stage."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.cache.select.key_copy import KeyCopy, KeyCopyState
from ulacache_jax.cache.select.labels import Labels
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.registry import resolve
from ulacache_jax.cache.select.two_stage import TwoStage, TwoStageState, parse_spec, shortlist, spread
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

PAGE, D = 8, 16
TABLE = (((0, 1, 8, 9), (2, 3, 10, 11)), ((4, 5, 12, 13), (6, 7, 14, 15)))     # tiny: [L][KV][C], whole pairs
ALL = ((tuple(range(D)),) * 2,) * 2                                              # [L][KV][D]: every channel


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _config(rule, **kw):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=3, max_pages_per_seq=32, page_size=PAGE,
                       num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=32, dtype="float32",
                       sink_pages=1, recent_pages=1, selection=rule, **kw)


def test_shortlist_and_spread():
    """The keep_pages flushed pages of highest bound; fewer flushed pages than that: the rest are not ok; spread puts
    the ok pages' scores at their ids and -inf everywhere else."""
    first = jnp.asarray([[[5.0, 1.0, 9.0, 7.0, 3.0, 8.0, 20.0, 6.0]]])                 # [1, 1, 8] page bounds
    pages, ok = shortlist(first, jnp.asarray([6]), keep_pages=3)                       # pages 6, 7 not flushed
    assert sorted(np.asarray(pages[0, 0]).tolist()) == [2, 3, 5] and np.asarray(ok).all()
    full = np.asarray(spread(jnp.asarray([[[1.0, 2.0, 3.0]]]), pages, ok, 8))[0, 0]
    assert np.isneginf(full[[0, 1, 4, 6, 7]]).all()
    assert full[np.asarray(pages[0, 0])].tolist() == [1.0, 2.0, 3.0]
    pages, ok = shortlist(first, jnp.asarray([2]), keep_pages=3)                       # only pages 0, 1 flushed
    assert pages.shape == (1, 1, 3) and sorted(np.asarray(pages[0, 0])[np.asarray(ok[0, 0])].tolist()) == [0, 1]
    full = np.asarray(spread(jnp.asarray([[[1.0, 2.0, 3.0]]]), pages, ok, 8))[0, 0]
    assert np.isfinite(full).sum() == 2 and np.isfinite(full[[0, 1]]).all()            # the not-ok one dropped
    pages, ok = shortlist(first, jnp.asarray([8]), keep_pages=20)                      # more than P: every page
    assert sorted(np.asarray(pages[0, 0]).tolist()) == list(range(8)) and np.asarray(ok).all()


def test_shortlist_radix_kernel_equals_reference():
    """The shortlist through the radix-select kernel (impl 'pallas', interpret mode here) picks the reference's
    pages (lax.top_k) on random bounds with ties, -inf and NaN, at every flushed count: the same ids in page order
    and the same ok."""
    rng = np.random.default_rng(3)
    S, G, P = 3, 2, 64
    first = rng.integers(-4, 5, (S, G, P)).astype(np.float32)                         # many ties
    first[0, 0, :5] = -np.inf
    first[1, 1, 7] = np.nan
    for fl in ([64, 10, 0], [3, 64, 40], [63, 1, 64]):
        for keep in (1, 8, 40, 64):
            args = (jnp.asarray(first), jnp.asarray(fl, jnp.int32))
            want = shortlist(*args, keep_pages=keep, impl="ref")
            got = shortlist(*args, keep_pages=keep, impl="pallas")
            for w, g in zip(want, got):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            pages, ok = np.asarray(want[0]), np.asarray(want[1])
            assert (ok.sum(-1) == np.minimum(np.asarray(fl), keep)[:, None]).all()
            assert (pages < np.asarray(fl)[:, None, None])[ok].all()                  # flushed pages only


@pytest.mark.parametrize("second", [Quest(), KeyCopy(channels=4), Labels(channels=4, bits=8)],
                         ids=["quest", "key_copy", "labels"])
@pytest.mark.slow
def test_whole_shortlist_scores_as_the_second_stage(second):
    """A shortlist of every page (keep_pages = P): the gathered second stage ranks the flushed pages as the second
    rule scoring every page does (Quest: equal bounds; the key copy / labels: mass normalised over the same
    pages, so equal too), on the same state: the second stage's state rides in CacheState.sel as is."""
    c = _config(TwoStage(second, keep_pages=32))
    rng = np.random.default_rng(1)
    _, state, _, _ = ingest_and_decode(c, [50, 77, 20], 3, rng)
    assert (state.sel is None) if isinstance(second, Quest) else isinstance(state.sel, KeyCopyState)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, D)), jnp.float32)
    flushed = state.seqs.flushed
    two = np.asarray(resolve(c).score(state, 1, q, flushed, DecodeOptions(scores="ref")))
    one = np.asarray(second.score(state, 1, q, flushed, DecodeOptions(scores="ref")))
    for s in range(3):
        f = int(flushed[s])
        np.testing.assert_allclose(two[s, :, :f], one[s, :, :f], rtol=1e-5, atol=1e-6)
        assert np.isneginf(two[s, :, f:]).all()


@pytest.mark.slow
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("second", [Quest(), KeyCopy(channels=4)], ids=["quest", "key_copy"])
def test_small_shortlist_holds_quests_top_pages(second, split):
    """keep_pages 5 of up to 9 flushed pages: the pages scored are exactly the 5 of highest Quest bound (with the
    config's sub-page summaries: split 2), the rest -inf; a Quest second stage gives them their bounds."""
    second = dataclasses.replace(second, split=split) if isinstance(second, Quest) else second
    c = _config(TwoStage(second, keep_pages=5), summary_split=split)
    rng = np.random.default_rng(6)
    _, state, _, _ = ingest_and_decode(c, [50, 77, 20], 3, rng)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, D)), jnp.float32)
    flushed = state.seqs.flushed
    opts = DecodeOptions(scores="ref")
    two = np.asarray(resolve(c).score(state, 0, q, flushed, opts))                    # [S, G, P]
    bound = np.asarray(Quest(split).score(state, 0, q, flushed, opts))
    for s in range(3):
        f = int(flushed[s])
        for g in range(2):
            top = np.argsort(-bound[s, g, :f], kind="stable")[:min(5, f)]
            assert set(np.flatnonzero(np.isfinite(two[s, g])).tolist()) == set(top.tolist())
            if isinstance(second, Quest):
                np.testing.assert_allclose(two[s, g, top], bound[s, g, top], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_label_first_stage_shortlists_its_top_pages_and_keeps_both_states():
    """A first rule (labels over 4 channels) in place of Quest's bound: the state holds both stages' own (each rule's
    hooks wrote its part as it would alone: the same codes as that rule's cache), the pages scored are exactly the
    5 of highest first-stage mass, and a shortlist of every page scores as the second stage alone."""
    first, second = Labels(channels=4, bits=4), Labels(channels=D, bits=4)
    rng = np.random.default_rng(7)
    c = _config(TwoStage(second, keep_pages=5, first=first))
    _, state, _, _ = ingest_and_decode(c, [50, 77, 20], 3, rng)
    assert isinstance(state.sel, TwoStageState) and state.sel.first.kc.shape[-1] == 2
    assert state.sel.second.kc.shape[-1] == D // 2
    for rule, sel in ((first, state.sel.first), (second, state.sel.second)):   # each stage as if it ran alone
        _, alone, _, _ = ingest_and_decode(_config(rule), [50, 77, 20], 3, np.random.default_rng(7))
        for a, b in zip(jax.tree.leaves(alone.sel), jax.tree.leaves(sel)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = jnp.asarray(rng.standard_normal((3, 1, 4, D)), jnp.float32)
    flushed = state.seqs.flushed
    opts = DecodeOptions(scores="ref")
    two = np.asarray(resolve(c).score(state, 1, q, flushed, opts))                    # [S, G, P]
    view = lambda part: dataclasses.replace(state, sel=part)
    mass = np.asarray(first.score(view(state.sel.first), 1, q, flushed, opts))
    for s in range(3):
        f = int(flushed[s])
        for g in range(2):
            top = np.argsort(-mass[s, g, :f], kind="stable")[:min(5, f)]
            assert set(np.flatnonzero(np.isfinite(two[s, g])).tolist()) == set(top.tolist())
    every = dataclasses.replace(c, selection=TwoStage(second, keep_pages=32, first=first))
    two = np.asarray(every.selection.score(dataclasses.replace(state, config=every), 1, q, flushed, opts))
    one = np.asarray(second.score(view(state.sel.second), 1, q, flushed, opts))
    for s in range(3):
        f = int(flushed[s])
        np.testing.assert_allclose(two[s, :, :f], one[s, :, :f], rtol=1e-5, atol=1e-6)
        assert np.isneginf(two[s, :, f:]).all()


@pytest.mark.parametrize("rule", [TwoStage(Quest(), keep_pages=8), TwoStage(Labels(channels=4, bits=4), keep_pages=8),
                                  pytest.param(TwoStage(Labels(channels=D, bits=4), keep_pages=8,
                                                        first=Labels(channels=4, bits=4)), marks=pytest.mark.slow)],
                         ids=["quest", "labels", "labels_first"])
def test_covering_budget_equals_dense(model, rule):
    assert_covering_budget_equals_dense(model, selection=rule)


@pytest.mark.slow
def test_small_budget_with_shared_prefixes_and_speculative(model):
    """Budget 4 pages of 16, a shortlist of 8 chosen by labels over 4 channels and reranked by labels over all 16,
    both over fixed channel tables (both rules' hooks run through the two-stage rule, each on its own state; tables
    allow shared prefixes): the Engine's tokens are the same with shared prefixes (attach writes both stages'
    labels) and with greedy speculative decoding (commit rewrites the tail's). The chunked-prefill test below runs
    a Quest first stage through the Engine."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    rule = TwoStage(Labels(channels=D, bits=4, table=ALL), keep_pages=8,
                    first=Labels(channels=4, bits=4, table=TABLE))
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               verify_rows=4, selection=rule)
    outs = {}
    for name, kw in (("plain", dict(prefix_cache=False)), ("shared", dict(prefix_cache=True)),
                     ("spec", dict(prefix_cache=False, speculative=SpecConfig("ngram", 3)))):
        eng = Engine(generator=Generator(model, cfg, attention="sparse"), **kw)
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=16))
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs[name] = [r.tokens for r in reqs]
        if name == "shared":
            assert eng.prefix_stats().hits >= 1
    assert outs["shared"] == outs["plain"]
    assert outs["spec"] == outs["plain"]


def test_bad_values_and_bytes():
    for kw, msg in ((dict(keep_pages=2), "keep_pages = 2 must be >= "), (dict(keep_pages=0), "keep_pages = 0 must "
                                                                         "be an int >= 1"),
                    (dict(keep_pages=True), "keep_pages = True"), (dict(keep_pages=8.0), "keep_pages = 8.0")):
        with pytest.raises(ValueError, match=msg):
            _config(TwoStage(Quest(), **kw))
    with pytest.raises(ValueError, match="the second stage cannot be another TwoStage"):
        _config(TwoStage(TwoStage(Quest(), keep_pages=8), keep_pages=8))
    with pytest.raises(ValueError, match="the first stage cannot be another TwoStage"):
        _config(TwoStage(Quest(), keep_pages=8, first=TwoStage(Quest(), keep_pages=8)))
    with pytest.raises(ValueError, match="the first stage 'quest' is not a SelectionRule"):
        _config(TwoStage(Quest(), keep_pages=8, first="quest"))
    with pytest.raises(ValueError, match="Labels: bits = 3"):                           # the first rule's own check
        _config(TwoStage(Quest(), keep_pages=8, first=Labels(channels=4, bits=3)))
    with pytest.raises(ValueError, match=r"channels = 20 must be in \[1, head_dim = 16\]"):
        _config(TwoStage(Quest(), keep_pages=8, first=Labels(channels=20, bits=4)))
    with pytest.raises(TypeError):
        TwoStage(Quest(), keep_pages=8, group_pages=8)                                 # page groups are gone
    for spec, mult in (("4", 4), ("1", 1), ("16", 16)):
        assert parse_spec(spec) == mult
    for bad in ("0", "-2", "a", "8:4", "", "2.5"):
        with pytest.raises(ValueError, match=f"--two-stage {bad!r} must be MULT, an int >= 1"):
            parse_spec(bad)
    # the 8B shape at 256K, budget 8K (128 pages of 64): Quest reads 0.54 GB a step; 16-channel 4-bit labels over
    # a 4x shortlist add their bytes over 512 pages only (0.07 GB), where over the whole context they read 0.57 GB
    shape = dict(context=262144, num_layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=64)
    quest = Quest().step_bytes(**shape)
    labels = Labels(channels=16, bits=4)
    two = TwoStage(labels, keep_pages=512).step_bytes(**shape)
    assert abs(quest - 0.537e9) < 0.01e9
    assert two == quest + labels.step_bytes(**dict(shape, context=512 * 64))
    assert two - quest == pytest.approx(labels.step_bytes(**shape) / 8) and two < 1.14 * quest   # 512 of 4096 pages
    # a label first stage: 32 channels over every page, then all 128 over a 4x shortlist (512 pages): 24 bytes a
    # token and head (plus the scales) where labels over all 128 read 64, all in the page-lse kernel
    small, full = Labels(channels=32, bits=4), Labels(channels=128, bits=4)
    lf = TwoStage(full, keep_pages=512, first=small)
    assert lf.step_bytes(**shape) == small.step_bytes(**shape) + full.step_bytes(**dict(shape, context=512 * 64))
    assert lf.kernel_bytes(**shape) == lf.step_bytes(**shape)
    assert lf.step_bytes(**shape) == pytest.approx(full.step_bytes(**shape) * (32 + 128 / 8) / 128)
    over = labels.kernel_bytes(**dict(shape, context=512 * 64))                        # the shortlist's alone
    assert TwoStage(labels, keep_pages=512).kernel_bytes(**shape) == over
    short = dict(shape, context=16 * 64)                                              # context under the shortlist
    assert TwoStage(labels, keep_pages=512).step_bytes(**short) == Quest().step_bytes(**short) + \
        labels.step_bytes(**short)


def test_cli_two_stage(tmp_path, capsys):
    """`ulacache generate --two-stage MULT` wraps the configured rule (here labels) in the two-stage rule: its
    results are fingerprinted apart from the single-stage run's and from another multiple's, a bad value is a
    one-line usage error."""
    import json
    from ulacache_jax.app import cli, jsonl_io, resume
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": list(range(1 + i, 150 + i))}) + "\n" for i in range(2)))
    args = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
            "--max-new-tokens", "4", "--no-progress", "--stop-ids", "none", "--compile-cache", "off", "--quiet",
            "--attention", "sparse", "--key-channels", "4", "--label-bits", "4", "--channel-table", "online"]
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "--input", str(inp), "--output", str(out), "--two-stage", "2", *args]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "length"] and all(len(r["token_ids"]) == 4 for r in rows)
    parser = cli.build_parser()
    settings = lambda *extra: resume.run_settings(parser.parse_args(["generate", "--input", "i", "--output", "o",
                                                                  *extra, *args]))
    two, one, four = settings("--two-stage", "2"), settings(), settings("--two-stage", "4")
    assert two["two_stage"] == "2" and "two_stage" not in one
    assert len({jsonl_io.settings_fingerprint(x) for x in (one, two, four)}) == 3
    for bad in ("0", "a", "8:4"):
        assert cli.main(["generate", "--input", str(inp), "--output", str(tmp_path / f"x{bad}.jsonl"),
                         "--two-stage", bad, *args]) == 2
        assert f"--two-stage {bad!r} must be MULT, an int >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_chunked_prefill_and_short_cadence_keep_the_tokens(model):
    """A prompt prefilled in chunks (blocks of 2 pages) and decoded in chunks shorter than a page gives the tokens
    of a whole prefill and page-long chunks (a shortlist of 6 for a budget of 4, reranked by labels)."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (150, 90)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=224, page_size=16, token_budget=64,
                               selection=TwoStage(Labels(channels=4, bits=4, table=TABLE), keep_pages=6))
    outs = []
    for kw in ({}, dict(prefill_chunk_tokens=32, decode_chunk_steps=4)):
        eng = Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=False, **kw)
        # 33 tokens: the page-long run's chunks all take 16 steps (a shorter last chunk compiles its own program)
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=33))
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs.append([r.tokens for r in reqs])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("second", [Quest(), Labels(channels=4, bits=4)], ids=["quest", "labels"])
def test_on_the_gpu_kernels_keep_the_tokens(model, second):
    """Compiled on the GPU (float32): a covering budget gives dense attention's tokens, and at a small budget the
    GPU's page-score and attention kernels choose what the XLA references choose (the same greedy tokens)."""
    import jax
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rule = TwoStage(second, keep_pages=4)
    assert_covering_budget_equals_dense(model, selection=TwoStage(second, keep_pages=8))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (150, 97)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=256, page_size=16, token_budget=32,
                               selection=rule)
    outs = []
    for opts in (DecodeOptions(), DecodeOptions(scores="ref", attention="ref", sieve="ref", topk="ref")):
        eng = Engine(generator=Generator(model, cfg, attention="sparse", options=opts), prefix_cache=False)
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=24))
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs.append([r.tokens for r in reqs])
    assert outs[0] == outs[1]
