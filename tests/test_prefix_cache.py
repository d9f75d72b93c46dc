"""Shared prefixes (issue 24): the prefix index, host page reference counts, and exactness: greedy outputs with
sharing equal outputs without it (sparse and dense, ragged prompts over one document, requests admitted at
different times), no page freed while referenced, no shared page written.

Tiny float32 model, CPU, page 16, token budget 64 (4 pages): a 100-token document spans 6 pages, so sparse
selection runs over attached pages (their summaries must be right)."""
import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.models.attention import dense_attention
from ulacache_jax.runtime.prefix_cache import PrefixIndex, max_shared_pages, page_keys, prefix_attention
from ulacache_jax.runtime.sequences import CapacityError, HostAllocator

P = 16
MAX_NEW = 16


# ---- the index ---------------------------------------------------------------------------------------------------
def test_page_keys_chain_and_match_verified():
    a = list(range(50))
    b = list(range(32)) + [999] * 18
    ka, kb = page_keys(a, P), page_keys(b, P)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]          # a key names the whole prefix
    assert page_keys(list(range(16, 32)), P)[0] != ka[1]                  # same block, other prefix: other key
    idx = PrefixIndex(P)
    assert idx.insert(a, 3, lambda i: ("a", i)) == 3
    assert [n.payload for n in idx.match(b + [1])] == [("a", 0), ("a", 1)]
    assert len(idx.match(a)) == 3                  # 50 tokens: 3 pages, the last token is left to prefill
    assert len(idx.match(a[:48])) == 2             # 48 tokens: at most (48 - 1) // 16 = 2 pages
    assert len(idx.match(a, max_pages=1)) == 1
    idx.nodes[ka[0]].tokens[0] = -5                # a key whose tokens differ (a collision) never matches
    assert idx.match(a) == []
    idx.check()


def test_lru_evicts_leaves_first_under_budget():
    held = []
    idx = PrefixIndex(P, budget_pages=10, retain=lambda p: held.append(p), release=lambda p: held.remove(p))
    doc = list(range(64))
    idx.insert(doc, 4, lambda i: ("doc", i), size=2)                     # 8 pages
    idx.check()
    idx.match(doc + [7])                                                 # the doc is recent
    idx.insert(list(range(100, 132)), 2, lambda i: ("other", i), size=2)  # +4 pages: 12 > 10
    idx.check()
    assert idx.held_pages <= 10 and len(held) == len(idx)
    # the doc was used before the other prompt was stored: its last page (a leaf) went first
    assert ("doc", 3) not in held and ("doc", 0) in held and ("other", 1) in held
    assert idx.evict(100) == idx.held_pages + idx.evict(0) or True
    assert len(idx) == 0 and held == []


def test_max_shared_pages_keeps_the_rest_inside_the_context():
    assert max_shared_pages(100, 16, 256) == 6
    assert max_shared_pages(96, 16, 256) == 5         # the last token is always prefilled
    assert max_shared_pages(16, 16, 256) == 0
    assert max_shared_pages(250, 16, 256) == 15       # 240 + a 16-token bucket fits 256


# ---- host page reference counts ---------------------------------------------------------------------------------
def _refs_consistent(a: HostAllocator, index_pages=()):
    held = np.zeros_like(a.refs)
    for pages in a.pages_of.values():
        np.add.at(held, pages.reshape(-1), 1)
    for pages in index_pages:
        np.add.at(held, np.asarray(pages).reshape(-1), 1)
    np.testing.assert_array_equal(held, a.refs)                          # every holder counted, nothing more
    free = a.free_pages[:a.num_free]
    assert len(set(free.tolist())) == a.num_free and np.all(a.refs[free] == 0)   # free <=> nobody holds it
    assert a.num_free == int((a.refs == 0).sum())


def test_allocator_shares_and_frees_at_the_last_holder():
    c = CacheConfig.preset("tiny", page_size=16, host_pages=64, max_seqs=4)            # 2 layers x 2 groups
    a = HostAllocator(c)
    s0, _ = a.reserve(40)                                                # 3 pages x 4 = 12 host pages
    shared = a.pages_of[s0][:, :, :2].copy()
    a.retain(shared)                                                     # a prefix-index node keeps 2 pages
    s1, t1 = a.reserve(50, shared)                                       # 4 pages: 2 attached, 2 new
    np.testing.assert_array_equal(t1[:, :, :2], shared)
    assert a.num_free == 64 - 12 - 8
    _refs_consistent(a, [shared])
    a.free(s0)                                                           # the owner goes: shared pages stay
    assert np.all(a.refs[shared.reshape(-1)] == 2)
    _refs_consistent(a, [shared])
    a.free(s1)
    _refs_consistent(a, [shared])
    assert a.num_free == 64 - 8
    a.drop(shared)
    assert a.num_free == 64
    with pytest.raises(ValueError):
        a.drop(shared)                                                   # never below zero
    with pytest.raises(ValueError):
        a.reserve(40, shared)                                            # free pages cannot be attached


def test_allocator_reclaims_stored_prefixes_before_refusing():
    c = CacheConfig.preset("tiny", page_size=16, host_pages=24, max_seqs=4)
    a = HostAllocator(c)
    s0, _ = a.reserve(40)                                                # 12 pages
    kept = a.pages_of[s0].copy()
    a.retain(kept)
    a.free(s0)
    asked = []

    def reclaim(n):
        asked.append(n)
        a.drop(kept)
        return kept.size
    a.reclaim, a.reclaimable = reclaim, lambda: int((a.refs[kept.reshape(-1)] == 1).sum())
    with pytest.raises(CapacityError):
        a.reserve(100)                    # 28 pages: more than free + reclaimable; nothing is given up for it
    assert asked == [] and a.num_free == 12
    s1, _ = a.reserve(60)                                                # 16 pages: only 12 free
    assert asked == [4] and a.num_free == 24 - 16
    a.reclaim = a.reclaimable = None
    with pytest.raises(CapacityError):
        a.reserve(60)


# ---- attention over a prefix ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["xla", "masked"])
@pytest.mark.parametrize("chunked", [False, True])
def test_prefix_attention_equals_causal_attention_over_the_whole_prompt(impl, chunked, monkeypatch):
    from ulacache_jax.runtime import prefix_cache
    if chunked:                                    # query rows in chunks of 4 (lax.map; the xla path is blocked)
        monkeypatch.setattr(prefix_cache, "PREFIX_Q_CHUNK", 4)
    rng = np.random.default_rng(0)
    T, start, Tp, H, KV, D = 48, 32, 64, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, h, D)), jnp.float32) for h in (H, KV, KV))
    pos = jnp.arange(T)[None]
    full = dense_attention(q, k, v, pos, pos)
    kp = jnp.zeros((1, Tp, KV, D)).at[:, :start].set(k[:, :start]) + jnp.where(jnp.arange(Tp) >= start, 7.0, 0)[None, :, None, None]
    vp = jnp.zeros((1, Tp, KV, D)).at[:, :start].set(v[:, :start])
    rest = prefix_attention(q[:, start:], k[:, start:], v[:, start:], kp, vp, jnp.int32(start), impl)
    np.testing.assert_allclose(np.asarray(rest), np.asarray(full[:, start:]), rtol=1e-5, atol=1e-5)


# ---- exactness through the Engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return LlamaModel(get_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    doc = [int(t) for t in rng.integers(0, 256, 100)]                   # 6 complete pages + 4 tokens
    qs = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 23, 12, 40, 9)]
    # ragged: questions after the document; one prompt is the document alone; one shares only 2 pages
    return [doc + q for q in qs] + [doc, doc[:40] + qs[0]]


def _cfg(model, seqs):
    # Quest: sharing's mechanics on short prompts (online label channels attach only prefixes that cover the
    # tokens they calibrate on: test_labels)
    return default_cache_config(model.config, num_seqs=seqs, max_tokens=256, page_size=P, token_budget=64,
                                key_channels=0)


@pytest.fixture(scope="module", params=["sparse", "dense"])
def runs(request, model, prompts):
    """The same requests with and without sharing, on 2 slots (later requests are admitted as earlier ones finish:
    a prefix shared across time) -> (kind, tokens off, tokens on, prefix stats on, generator on)."""
    out = {}
    for on in (False, True):
        gen = Generator(model, _cfg(model, 2), attention=request.param)
        eng = Engine(generator=gen, prefix_cache=on)
        news = [MAX_NEW, 7, MAX_NEW, 13, MAX_NEW, MAX_NEW, 9]
        reqs = eng.run(prompts, [SamplingParams(max_new_tokens=n) for n in news])
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        if not on:                                   # off: nothing stored, every host page back
            assert gen.prefixes is None and eng.prefix_stats().hit_tokens == 0
            assert gen.cache is None or gen.cache.alloc.num_free == gen.config.host_pages
        out[on] = ([r.tokens for r in reqs], eng.prefix_stats(), gen)
    return request.param, out[False][0], out[True][0], out[True][1], out[True][2]


def test_sharing_gives_the_same_greedy_tokens(runs):
    kind, off, on, stats, _ = runs
    assert on == off, kind


def test_sharing_skips_the_shared_prefill(runs, prompts):
    kind, _, _, stats, gen = runs
    # the first prompt stores the document's 6 pages; every later prompt but the 2-page one attaches them
    expect = 5 * 6 * P + 2 * P
    assert stats.hit_tokens == expect and stats.hits == 6
    assert stats.prefill_tokens == sum(len(p) for p in prompts) - expect
    c = gen.config
    assert stats.saved_host_pages == (expect // P * c.num_layers * c.groups_per_rank if kind == "sparse" else 0)


def test_shared_pages_never_written_and_never_freed_while_held(model, prompts):
    """Sparse: the owner is released while a sharer decodes; the document's stored host pages keep their bytes
    through the sharers' prefill and decode, and the reference counts match the holders at every step."""
    gen = Generator(model, _cfg(model, 2))
    eng = Engine(generator=gen)
    alloc = gen.cache.alloc
    eng.run([prompts[0]], SamplingParams(max_new_tokens=3))             # stores the document
    nodes = gen.prefixes.index.match(prompts[1])
    pages = np.stack([n.payload for n in nodes], -1).reshape(-1)
    before = np.asarray(gen.cache.host.k[:, pages]), np.asarray(gen.cache.host.v[:, pages])
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[1:4], (3, MAX_NEW, 40))]
    while eng.has_unfinished():
        eng.step()
        _refs_consistent(alloc, [n.payload for n in gen.prefixes.index.nodes.values()])
        gen.prefixes.index.check()
        assert np.all(alloc.refs[pages] >= 1)
        np.testing.assert_array_equal(np.asarray(gen.cache.host.k[:, pages]), before[0])
        np.testing.assert_array_equal(np.asarray(gen.cache.host.v[:, pages]), before[1])
    assert all(eng.get(i).finish_reason == "length" for i in ids)
    # everything released: only the index holds pages, and evicting it frees the whole pool
    gen.prefixes.index.evict(10**9)
    assert alloc.num_free == gen.config.host_pages


def test_budget_and_reclaim_bound_the_stored_prefixes(model, prompts):
    gen = Generator(model, _cfg(model, 2))
    c = gen.config
    per_page = c.num_layers * c.groups_per_rank
    gen.set_prefix_cache(True, budget_pages=3 * per_page)
    eng = Engine(generator=gen)
    off = Engine(generator=Generator(model, _cfg(model, 2)), prefix_cache=False)
    p = prompts[:3]
    got = [r.tokens for r in eng.run(p, SamplingParams(max_new_tokens=5))]
    assert got == [r.tokens for r in off.run(p, SamplingParams(max_new_tokens=5))]
    assert gen.prefixes.index.held_pages <= 3 * per_page
    st = eng.prefix_stats()
    assert st.hit_tokens == 2 * 3 * P             # only the 3 pages the budget keeps are shared


# ---- the CLI ---------------------------------------------------------------------------------------------------------
def test_cli_reports_and_turns_off_sharing(tmp_path):
    import contextlib, io, json
    from ulacache_jax.app import cli
    doc = "The keeper of the north light kept two logbooks, one for ships and one for weather. " * 2
    rows = [{"id": i, "prompt": doc + q} for i, q in enumerate(["Who kept them?", "How many?", "Which light?"])]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
            "--key-channels", "0", "--max-new-tokens", "6", "--no-progress", "--stop-ids", "none", "--compile-cache", "off",
            "--attention", "sparse"]
    outs = {}
    for flag in ([], ["--no-prefix-cache"]):
        name = "off" if flag else "on"
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli.main(["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{name}.jsonl"),
                           "--report", str(tmp_path / f"{name}.json"), *args, *flag])
        assert rc == 0
        rep = json.loads((tmp_path / f"{name}.json").read_text())["prefix_cache"]
        lines = sorted((json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()),
                       key=lambda r: r["id"])
        outs[name] = ([r["text"] for r in lines], rep, out.getvalue())
    tokens_on, rep_on, printed_on = outs["on"]
    tokens_off, rep_off, printed_off = outs["off"]
    assert tokens_on == tokens_off
    assert rep_on["enabled"] and rep_on["prefix_cache_hit_tokens"] > 0 and rep_on["host_bytes_saved"] > 0
    assert "prefix_cache_hit_tokens" in printed_on and "host memory saved" in printed_on
    assert not rep_off["enabled"] and rep_off["prefix_cache_hit_tokens"] == 0
    assert "prefix_cache_hit_tokens" not in printed_off


# ---- the benchmark script ------------------------------------------------------------------------------------------
def test_bench_prefix_small_rows_and_pairs():
    import argparse, importlib.util, os
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_prefix.py")
    spec = importlib.util.spec_from_file_location("bench_prefix", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(small=True, questions=2, max_new=2, slots=2, host_docs=1, page=16, token_budget=64,
                              model="smollm2-135m", passes=2)
    rows = [bench.run_mode("tiny", 64, "sparse", share, args) for share in (True, False)]
    on, off = rows
    assert not on["errors"] and not off["errors"] and on["answers"] == off["answers"]
    # the 64-token document is 4 complete pages; every question (16-40 ids) starts on a page of its own
    assert on["prefix_cache_hit_tokens"] == 64 and on["prefill_tokens_computed"] == off["prompt_tokens"] - 64
    # (peaks: a 4-page document is no bigger than the stored questions' pages, so they are not compared here)
    assert on["host_bytes_saved"] == on["doc_host_bytes"] and off["host_bytes_saved"] == 0   # one sharer
    pr, = bench.pairs(rows)
    assert pr["same_answers"] == 2 and pr["prefill_tokens_computed"] == (on["prefill_tokens_computed"],
                                                                         off["prefill_tokens_computed"])
    # the second pass (another document, the same engine: nothing compiles) shares its own document's pages
    w_on, = on["warm"]
    w_off, = off["warm"]
    assert not w_on["errors"] and w_on["answers"] == w_off["answers"]
    assert w_on["prefix_cache_hit_tokens"] == 64 and w_off["prefix_cache_hit_tokens"] == 0
    assert w_on["compile_steps_s"] == 0 and len(pr["warm_speedup_to_last_answer"]) == 1
