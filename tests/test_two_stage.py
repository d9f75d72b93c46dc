"""The two-stage rule (ulacache_jax/cache/select/two_stage.py): page-group summaries written by ingest, flush and
prefix attach equal the min / max of the groups' keys; the shortlist and the gathered second stage agree with
scoring every page where the shortlist holds every page; a covering budget gives dense attention's tokens; a small
budget runs through the Engine with shared prefixes and speculative decoding, unchanged by them; its bytes."""
import dataclasses

import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.cache.select.key_copy import KeyCopy
from ulacache_jax.cache.select.labels import Labels
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.two_stage import TwoStage, shortlist, spread
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

PAGE, D = 8, 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _config(rule, **kw):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=3, max_pages_per_seq=32, page_size=PAGE,
                       num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=32, dtype="float32",
                       sink_pages=1, recent_pages=1, selection=rule, **kw)


@pytest.mark.parametrize("second", [Quest(), Labels(channels=4, bits=4)], ids=["quest", "labels"])
def test_group_summaries_hold_the_groups_keys(second):
    """After ingestion (lengths that end mid-group and mid-page) and decode steps that flush pages, every group
    whose pages are all flushed holds the min / max of their keys; the group being filled holds those of its
    flushed pages at least (its ingested partial page too)."""
    G = 3
    c = _config(TwoStage(second, keep_pages=8, group_pages=G))
    rng = np.random.default_rng(0)
    lengths = [37, 61, 8]
    _, state, _, ks = ingest_and_decode(c, lengths, 21, rng)
    gmin, gmax = np.asarray(state.sel.gmin[0]), np.asarray(state.sel.gmax[0])          # [S, L, KV, NG, 1, D]
    assert gmin.shape == (3, 2, 2, -(-32 // G), 1, D)
    for s, k in enumerate(ks):                                                         # k [L, T, KV, D]
        flushed = int(state.seqs.flushed[s])
        assert flushed == k.shape[1] // PAGE
        for grp in range(-(-flushed // G)):
            pages = range(grp * G, min(grp * G + G, flushed))
            kk = np.concatenate([k[:, p * PAGE:(p + 1) * PAGE] for p in pages], axis=1)   # [L, n, KV, D]
            if grp * G + G <= flushed:
                np.testing.assert_array_equal(gmin[s, :, :, grp, 0], kk.min(1))
                np.testing.assert_array_equal(gmax[s, :, :, grp, 0], kk.max(1))
            else:
                assert (gmin[s, :, :, grp, 0] <= kk.min(1)).all() and (gmax[s, :, :, grp, 0] >= kk.max(1)).all()


def test_shortlist_and_spread():
    """The groups of highest bound among those whose first page is flushed, expanded to their flushed pages."""
    first = jnp.asarray([[[5.0, 1.0, 9.0, 7.0]]])                                      # [1, 1, 4] group bounds
    pages, ok = shortlist(first, jnp.asarray([7]), group_pages=2, keep_groups=2)
    # group 3 (pages 6, 7) is a candidate (page 6 flushed) but page 7 is not; groups 2 and 3 win
    assert sorted(zip(np.asarray(pages[0, 0]).tolist(), np.asarray(ok[0, 0]).tolist())) == \
        [(4, True), (5, True), (6, True), (7, False)]
    full = spread(jnp.arange(4.0)[None, None], pages, ok, 8)
    got = np.asarray(full[0, 0])
    assert np.isneginf(got[[0, 1, 2, 3, 7]]).all()
    assert sorted(got[[4, 5, 6]].tolist()) == sorted(np.asarray(jnp.arange(4.0))[np.asarray(ok[0, 0])].tolist())
    pages, ok = shortlist(first, jnp.asarray([2]), group_pages=2, keep_groups=2)       # only group 0 flushed
    assert np.asarray(pages[0, 0])[np.asarray(ok[0, 0])].tolist() == [0, 1]


@pytest.mark.parametrize("second", [Quest(), KeyCopy(channels=4), Labels(channels=4, bits=8)],
                         ids=["quest", "key_copy", "labels"])
def test_whole_shortlist_scores_as_the_second_stage(second):
    """A shortlist of every page (keep_pages = P): the gathered second stage ranks the flushed pages as the second
    rule scoring every page does (Quest: equal bounds; the key copy / labels: mass normalised over the same
    pages, so equal too)."""
    from ulacache_jax.cache.select.registry import resolve
    c = _config(TwoStage(second, keep_pages=32, group_pages=4))
    rng = np.random.default_rng(1)
    _, state, _, _ = ingest_and_decode(c, [50, 77, 20], 3, rng)
    q = jnp.asarray(rng.standard_normal((3, 1, 4, D)), jnp.float32)
    flushed = state.seqs.flushed
    two = np.asarray(resolve(c).score(state, 1, q, flushed, DecodeOptions(scores="ref")))
    alone = dataclasses.replace(c, selection=second)
    inner = dataclasses.replace(state, sel=state.sel.second) if not isinstance(second, Quest) else state
    one = np.asarray(resolve(alone).score(inner, 1, q, flushed, DecodeOptions(scores="ref")))
    for s in range(3):
        f = int(flushed[s])
        np.testing.assert_allclose(two[s, :, :f], one[s, :, :f], rtol=1e-5, atol=1e-6)
        assert np.isneginf(two[s, :, f:]).all()


@pytest.mark.parametrize("rule", [TwoStage(Quest(), keep_pages=8, group_pages=4),
                                  TwoStage(Labels(channels=4, bits=4), keep_pages=8, group_pages=2)],
                         ids=["quest", "labels"])
def test_covering_budget_equals_dense(model, rule):
    assert_covering_budget_equals_dense(model, selection=rule)


def test_small_budget_with_shared_prefixes_and_speculative(model):
    """Budget 4 pages of 16, a shortlist of 8 in groups of 2 reranked by Quest's page bound: the Engine's tokens are
    the same with shared prefixes (attach writes the groups) and with greedy speculative decoding; the shortlist
    changes what a small shortlist selects against the covering one."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    rule = TwoStage(Quest(), keep_pages=4, group_pages=2)
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
    for kw, msg in ((dict(keep_pages=2), "keep_pages = 2 must be >= "), (dict(keep_pages=8, group_pages=0),
                                                                         "group_pages = 0 must be an int >= 1"),
                    (dict(keep_pages=True), "keep_pages = True")):
        with pytest.raises(ValueError, match=msg):
            _config(TwoStage(Quest(), **kw))
    with pytest.raises(ValueError, match="another TwoStage"):
        _config(TwoStage(TwoStage(Quest(), keep_pages=8), keep_pages=8))
    # the 8B shape at 256K, budget 8K (128 pages of 64): Quest reads 0.54 GB a step; groups of 16 pages shortlisting
    # 4x the budget for 16-channel 4-bit labels read under a quarter of it
    shape = dict(context=262144, num_layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=64)
    quest = Quest().step_bytes(**shape)
    two = TwoStage(Labels(channels=16, bits=4), keep_pages=512, group_pages=16).step_bytes(**shape)
    assert abs(quest - 0.537e9) < 0.01e9
    assert two <= quest / 4, (two, quest)
    groups = 262144 // 64 // 16 * 2 * 32 * 8 * 128 * 2
    assert two == groups + Labels(channels=16, bits=4).step_bytes(**dict(shape, context=512 * 64))


def test_cli_two_stage(tmp_path, capsys):
    """`ulacache generate --two-stage GROUP:MULT` wraps the configured rule (here labels) in the two-stage rule:
    its results are fingerprinted apart from the single-stage run's, a bad value is a one-line usage error."""
    import json
    from ulacache_jax.app import cli, jsonl_io
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": list(range(1 + i, 150 + i))}) + "\n" for i in range(2)))
    args = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
            "--max-new-tokens", "4", "--no-progress", "--stop-ids", "none", "--compile-cache", "off", "--quiet",
            "--attention", "sparse", "--key-channels", "4", "--label-bits", "4", "--channel-table", "online"]
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "--input", str(inp), "--output", str(out), "--two-stage", "2:2", *args]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "length"] and all(len(r["token_ids"]) == 4 for r in rows)
    parser = cli.build_parser()
    two = cli.run_settings(parser.parse_args(["generate", "--input", "i", "--output", "o", "--two-stage", "2:2", *args]))
    one = cli.run_settings(parser.parse_args(["generate", "--input", "i", "--output", "o", *args]))
    assert two["two_stage"] == "2:2" and jsonl_io.settings_fingerprint(two) != jsonl_io.settings_fingerprint(one)
    for bad in ("8", "0:4", "a:b", "8:4:2"):
        assert cli.main(["generate", "--input", str(inp), "--output", str(tmp_path / f"x{bad}.jsonl"),
                         "--two-stage", bad, *args]) == 2
        assert f"--two-stage {bad!r} must be GROUP:MULT" in capsys.readouterr().err


def test_chunked_prefill_and_short_cadence_keep_the_tokens(model):
    """The group summaries of a prompt prefilled in chunks (blocks of 2 pages: groups of 3 start mid-block) and decoded in chunks
    shorter than a page give the tokens of a whole prefill and page-long chunks."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (150, 90)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=224, page_size=16, token_budget=64,
                               selection=TwoStage(Quest(), keep_pages=6, group_pages=3))
    outs = []
    for kw in ({}, dict(prefill_chunk_tokens=32, decode_chunk_steps=4)):
        eng = Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=False, **kw)
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=24))
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
    rule = TwoStage(second, keep_pages=4, group_pages=2)
    assert_covering_budget_equals_dense(model, selection=TwoStage(second, keep_pages=8, group_pages=2))
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
