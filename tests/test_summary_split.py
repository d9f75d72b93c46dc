"""Sub-page key summaries (CacheConfig.summary_split, the "quest_p8" rule of issue 19): every writer fills the
summaries per sub-page of page_size // split tokens (ingest, decode appends, speculative commits, shared-prefix
attach), a page scores the max of its sub-pages' Quest bounds, and selection / transfer stay per page.

Checked against references written from the raw keys: summaries equal the per-sub-page min / max of the tokens a
cache holds after ingest + decode steps; selections equal an independent jnp scorer (half pages, max) followed by the
same top-k; commit_summaries equals token-by-token appends; generate / Engine run end to end (tiny model, sparse):
covering budget equals dense, shared prefixes and speculative decoding give the tokens of a plain run. The kernel's
own checks (random and adversarial inputs, interpret mode; compiled on the H200) are in test_page_scores.py."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.select import quest as selection
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.decode_layer import DecodeOptions, append_leases, append_token, commit_summaries, plan_layer
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

QPK = 2          # query heads per KV head
PAGE, SPLIT = 8, 2
SUB = PAGE // SPLIT


# ---- config ------------------------------------------------------------------------------------------------------
def test_config_checks_and_sizes():
    c = CacheConfig.preset("tiny", summary_split=2)
    assert (c.summary_size, c.summary_pages) == (4, 64)
    base = CacheConfig.preset("tiny")
    assert base.summary_split == 1 and base.summary_pages == base.max_pages_per_seq
    assert c.footprint()["summaries"] == 2 * base.footprint()["summaries"]
    for bad in (0, 3, 6, 16, True, 2.0):
        with pytest.raises(ValueError, match=r"summary_split = .* must be a power of two >= 1 dividing page_size = 8"):
            CacheConfig.preset("tiny", summary_split=bad)
    assert CacheConfig.preset("tiny", summary_split=8).summary_size == 1      # one token per summary is allowed


# ---- a cache built by ingest + decode steps, against the raw keys ---------------------------------------------------
def build(lengths, steps, *, token_budget=32, seed=0):
    """Ingest random K/V for each length, then `steps` decode steps of every layer (random new K, the committed
    length advanced and completed pages flushed after each step, as the decode program does) -> (config, manager,
    state, host, raw K per sequence [L, T, KV, D], rng)."""
    c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_seqs=len(lengths), max_pages_per_seq=32,
                    page_size=PAGE, num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=token_budget,
                    dtype="float32", sink_pages=1, recent_pages=1, summary_split=SPLIT)
    rng = np.random.default_rng(seed)
    m, state, host, ks = ingest_and_decode(c, lengths, steps, rng, qpk=QPK)
    return c, m, state, host, ks, rng


def raw_summaries(k, n_sub):
    """k [T, D] one (layer, kv head)'s keys -> (min, max) [n_sub, D] per sub-page of SUB tokens; NaN where a sub-page
    holds no token."""
    T, D = k.shape
    mn = np.full((n_sub, D), np.nan, np.float32)
    mx = np.full((n_sub, D), np.nan, np.float32)
    for j in range(-(-T // SUB)):
        mn[j], mx[j] = k[j * SUB:(j + 1) * SUB].min(0), k[j * SUB:(j + 1) * SUB].max(0)
    return mn, mx


def half_page_select(q, ks, flushed, c):
    """Independent reference: q [S, 1, H, D]; raw keys -> selected page sets per (sequence, group) at layer 0.
    Each half page's Quest bound sum_h sum_d max(q * min, q * max) from the raw keys, a page's score the max of its
    halves, then the library's top-k (select_pages)."""
    S, P = len(ks), c.max_pages_per_seq
    scores = np.full((S, 2, P), -np.inf, np.float32)
    for s, k in enumerate(ks):
        for gi in range(2):
            mn, mx = raw_summaries(k[0, :, gi], P * SPLIT)
            qh = np.asarray(q[s, 0, gi * QPK:(gi + 1) * QPK])                         # [QPK, D]
            with np.errstate(invalid="ignore"):
                b = np.maximum(qh[:, None] * mn[None], qh[:, None] * mx[None]).sum((0, 2))  # [P * SPLIT]
            scores[s, gi] = np.nan_to_num(b.reshape(P, SPLIT).max(1), nan=-np.inf)
    sel = np.asarray(selection.select_pages(jnp.asarray(scores), flushed, select_pages=c.select_pages,
                                            sink_pages=c.sink_pages, recent_pages=c.recent_pages))
    return [[sorted(int(p) for p in sel[s, gi] if p >= 0) for gi in range(2)] for s in range(S)]


@pytest.fixture(scope="module")
def built():
    return build([37, 61, 8], steps=13)


def test_summaries_are_sub_page_min_max_after_ingest_and_decode(built):
    c, m, state, host, ks, rng = built
    assert state.kmin.shape == (1, 3, 2, 2, 32 * SPLIT, 1, 16)
    for s, k in enumerate(ks):
        T = k.shape[1]
        for l in range(2):
            for gi in range(2):
                mn, mx = raw_summaries(k[l, :, gi], c.summary_pages)
                nj = -(-T // SUB)                                   # sub-pages holding a token (the last: partial)
                np.testing.assert_array_equal(np.asarray(state.kmin[0, s, l, gi, :nj, 0]), mn[:nj])
                np.testing.assert_array_equal(np.asarray(state.kmax[0, s, l, gi, :nj, 0]), mx[:nj])
    assert [int(x) for x in state.seqs.flushed] == [k.shape[1] // PAGE for k in ks]


@pytest.mark.parametrize("scores", ["ref", "pallas"])
def test_selection_equals_half_page_reference(built, scores):
    c, m, state, host, ks, rng = built
    S = len(ks)
    pos = jnp.asarray([k.shape[1] for k in ks], jnp.int32)
    opts = DecodeOptions(scores=scores)
    plan_fn = jax.jit(lambda st, h, q: plan_layer(st, h, 0, q, None, None, pos, jnp.ones(S, bool), options=opts,
                                                  append=False))
    K = c.select_pages
    for _ in range(4):
        q = jnp.asarray(rng.standard_normal((S, 1, 2 * QPK, 16)) * 2, jnp.float32)
        _, plan, _ = plan_fn(state, host, q)
        start = np.asarray(plan.start)[:, :, :K]
        got = [[sorted(int(x) // PAGE for x in start[s, gi] if x >= 0) for gi in range(2)] for s in range(S)]
        assert got == half_page_select(q, ks, state.seqs.flushed, c)
        # the library's scores are the reference's too (same numbers up to summation order)
        lib = selection.ref_page_scores(q, state.kmin[0, :, 0], state.kmax[0, :, 0], split=SPLIT)
        for s in range(S):
            fl = int(state.seqs.flushed[s])
            for gi in range(2):
                mn, mx = raw_summaries(ks[s][0, :, gi], c.summary_pages)
                qh = np.asarray(q[s, 0, gi * QPK:(gi + 1) * QPK])
                want = np.maximum(qh[:, None] * mn[None], qh[:, None] * mx[None]).sum((0, 2))[:fl * SPLIT]
                np.testing.assert_allclose(np.asarray(lib[s, gi, :fl]), want.reshape(fl, SPLIT).max(1),
                                           rtol=1e-5, atol=1e-4)


def test_half_page_bounds_rank_pages_differently_from_whole_page_bounds():
    """The rule's point, on a constructed case: a page whose halves point different ways has a loose whole-page bound
    (it wins under split 1); half-page bounds rank a page with one consistent key above it."""
    D = 4
    q = np.zeros((1, 1, 1, D), np.float32)
    q[..., 0] = 1.0
    q[..., 1] = -1.0
    # page 0: half 0 key (3, 0), half 1 key (0, -3) -> halves 3, 3; whole page (min (0,-3), max (3,0)) 6
    # page 1: half 0 key (4, 0), half 1 key (4, 0) -> halves 4, 4; whole page 4
    kmin = np.zeros((1, 1, 4, 1, D), np.float32)
    kmax = np.zeros((1, 1, 4, 1, D), np.float32)
    kmin[0, 0, 0, 0, :2] = kmax[0, 0, 0, 0, :2] = (3, 0)
    kmin[0, 0, 1, 0, :2] = kmax[0, 0, 1, 0, :2] = (0, -3)
    kmin[0, 0, 2, 0, :2] = kmax[0, 0, 2, 0, :2] = (4, 0)
    kmin[0, 0, 3, 0, :2] = kmax[0, 0, 3, 0, :2] = (4, 0)
    split2 = np.asarray(selection.ref_page_scores(jnp.asarray(q), jnp.asarray(kmin), jnp.asarray(kmax), split=2))
    np.testing.assert_array_equal(split2[0, 0], [3, 4])
    whole = np.asarray(selection.ref_page_scores(jnp.asarray(q), jnp.asarray(kmin.reshape(1, 1, 2, 2, 1, D).min(3)),
                                                 jnp.asarray(kmax.reshape(1, 1, 2, 2, 1, D).max(3))))
    np.testing.assert_array_equal(whole[0, 0], [6, 4])


def test_ingested_partial_page_sentinel_never_wins_its_page():
    """Ingest ending in a page's first half (34 tokens: page 4 holds tokens 32, 33) leaves the unfilled sub-page 9
    at ingestion's (finfo.max, -finfo.max) sentinel; the page's score is its filled half's bound; the next decode
    token (position 36, sub-page 9's first) replaces the sentinel."""
    c, m, state, host, ks, rng = build([34], steps=0)
    big = np.finfo(np.float32).max
    assert (np.asarray(state.kmin[0, 0, :, :, 9]) == big).all()
    assert (np.asarray(state.kmax[0, 0, :, :, 9]) == -big).all()
    q = jnp.asarray(rng.standard_normal((1, 1, 2 * QPK, 16)), jnp.float32)
    sc = np.asarray(selection.ref_page_scores(q, state.kmin[0, :, 0], state.kmax[0, :, 0], split=SPLIT))
    subs = np.asarray(selection.ref_page_scores(q, state.kmin[0, :, 0], state.kmax[0, :, 0], split=1))
    np.testing.assert_array_equal(sc[0, :, 4], subs[0, :, 8])
    kn = jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)
    for p in (34, 35, 36):
        state = append_token(state, 0, kn, kn, jnp.asarray([p], jnp.int32), jnp.ones(1, bool))
    np.testing.assert_array_equal(np.asarray(state.kmin[0, 0, 0, :, 9, 0]), np.asarray(kn[0]))


@pytest.mark.slow
def test_commit_summaries_equal_token_by_token_appends():
    """Speculative commit (tail summaries recomputed from committed ring tokens) equals append_token's updates, per
    sub-page, across a page boundary and a partial sub-page; untouched sub-pages stay as they were."""
    c, m, state, host, ks, rng = build([29, 8], steps=0)
    S, n = 2, 9                                                  # 29 -> 38: crosses the page boundary at 32
    pos0 = jnp.asarray([29, 8], jnp.int32)
    kn = jnp.asarray(rng.standard_normal((n, 2, S, 2, 16)), jnp.float32)   # [step, L, S, KV, D]
    live = jnp.asarray([True, False])
    a = state
    for i in range(n):
        for l in range(2):
            a = append_token(a, l, kn[i, l], kn[i, l], pos0 + i, live)
    b = state
    for l in range(2):
        b = append_leases(b, l, kn[:, l].transpose(1, 0, 2, 3), kn[:, l].transpose(1, 0, 2, 3), pos0,
                          jnp.where(live, n, 0))
    b = commit_summaries(b, jnp.where(live, pos0 + n, pos0))
    np.testing.assert_array_equal(np.asarray(a.kmin), np.asarray(b.kmin))
    np.testing.assert_array_equal(np.asarray(a.kmax), np.asarray(b.kmax))
    assert not np.array_equal(np.asarray(a.kmin), np.asarray(state.kmin))


# ---- end to end: generate / Engine, tiny model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_generate_covering_budget_equals_dense(model):
    assert_covering_budget_equals_dense(model, summary_split=2)


@pytest.mark.slow
def test_engine_small_budget_shared_prefix_and_speculative(model):
    """Budget 4 pages of 16 (prompts of 100+ tokens select pages): split 2 runs; shared prefixes on (the attach
    writes the stored pages' sub-page summaries) give the tokens of a run without them; greedy speculative decoding
    (commit_summaries per sub-page) gives the plain run's tokens."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               summary_split=2, verify_rows=4, key_channels=0)      # Quest's sub-page bound
    params = SamplingParams(max_new_tokens=16)
    outs = {}
    for name, kw in (("plain", dict(prefix_cache=False)), ("shared", dict(prefix_cache=True)),
                     ("spec", dict(prefix_cache=False, speculative=SpecConfig("ngram", 3)))):
        eng = Engine(generator=Generator(model, cfg, attention="sparse"), **kw)
        reqs = eng.run(prompts, params)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs[name] = [r.tokens for r in reqs]
        if name == "shared":
            assert eng.prefix_stats().hits >= 1
    assert outs["shared"] == outs["plain"]
    assert outs["spec"] == outs["plain"]


def test_attached_prefix_summaries_equal_ingested_ones(model):
    """A prompt that attaches a stored prefix holds the same sub-page summaries as the slot that ingested it."""
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rng = np.random.default_rng(3)
    doc = [int(t) for t in rng.integers(0, 256, 70)]                # 4 complete pages of 16
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16, token_budget=64,
                               summary_split=2, key_channels=0)                     # Quest's sub-page bound
    gen = Generator(model, cfg, attention="sparse")
    gen.set_prefix_cache(True)
    a = doc + [1, 2, 3]
    b = doc + [9, 8, 7, 6, 5]
    sa = gen.admit(len(a) + 8, a)
    gen.prefill(sa, a)
    sb = gen.admit(len(b) + 8, b)
    gen.prefill(sb, b)
    assert gen.prefix_stats().hit_tokens == 4 * 16
    st = gen.cache.state
    n = 4 * SPLIT
    np.testing.assert_array_equal(np.asarray(st.kmin[:, sb, :, :, :n]), np.asarray(st.kmin[:, sa, :, :, :n]))
    np.testing.assert_array_equal(np.asarray(st.kmax[:, sb, :, :, :n]), np.asarray(st.kmax[:, sa, :, :, :n]))
    assert np.isfinite(np.asarray(st.kmin[:, sb, :, :, :n])).all()


@pytest.mark.slow
def test_bench_quality_summary_split_rows(tmp_path):
    """scripts/bench_quality.py --summary-split 2 (tiny mode): its sparse cells run with split 2, every row records
    summary_split, and split-2 rows combine beside split-1 rows of the same cell (row_id tells them apart)."""
    import importlib.util
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_quality", os.path.join(root, "scripts", "bench_quality.py"))
    bq = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bq
    spec.loader.exec_module(bq)
    rows, meta = bq.main(["--tiny", "--out", str(tmp_path), "--tasks", "passkey", "--contexts", "384", "--depths",
                          "50", "--budgets", "32", "--pages", "16", "--summary-split", "2", "--name", "s2"])
    assert rows and all(r["summary_split"] == 2 for r in rows)
    assert {r["attention"] for r in rows} == {"dense", "sparse"}
    assert "sparse b32 p16 s2" in meta["passkey"]["seconds"]
    one = [dict(r, summary_split=1) for r in rows]
    ids = {bq.row_id(r) for r in rows + one}
    assert len(ids) == len(rows) + sum(r["attention"] == "sparse" for r in rows)   # dense rows are one cell
    md = bq.markdown(rows + one, meta)
    assert "budget 32, page 16, summary split 2" in md and "| budget 32, page 16 |" in md
    with pytest.raises(SystemExit):
        bq.main(["--tiny", "--out", str(tmp_path), "--tasks", "passkey", "--summary-split", "3"])
