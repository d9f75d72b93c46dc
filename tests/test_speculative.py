"""Speculative decoding (speculative.py, issue 22): greedy speculative tokens equal plain greedy tokens (sparse and
dense, ragged batches, queued requests, stop ids and max length inside a draft), a rejected draft leaves the cache
as a run that never drafted (lengths, tail pages as later steps read them, key summaries, flushed pages, vTLB host
entries, host pool) and no later step reads a rejected token's K/V, and sampled tokens follow the target
distribution (the acceptance rule on its own, and through a tiny model's verification).

Shapes: the tiny model, 2 slots, page 16, token budget 64 (4 pages: prompts of 70-110 tokens select pages), K = 3.
Oracle drafters (the plain run's own continuation, corrupted on a schedule) give both acceptances and rejections;
`fixed_rows` keeps one verification program per backend (row-count buckets are exercised by the ngram test).
The ngram drafter runs in device chunks (Program.spec_chunk): greedy equal to plain and to the per-step path
(the same drafts proposed and accepted), stops and lengths inside a chunk, one compile, no pool copy."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config, generate
from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.runtime.sampling import SamplingArrays, row_keys, sample
from ulacache_jax.runtime.speculative.rules import SpecConfig, accept, gate_rows, next_flush, ngram_propose, token_probs

K = 3
MAX_NEW = 40
# every draft verified (no batch gate): the tiny random model's drafts are mostly rejected, so the gate
# (gate_rows, tested on its own) would leave these mechanics tests few verifications with drafts
EVERY = SpecConfig("ngram", K, min_drafts_per_slot=0)


@pytest.fixture(scope="module")
def setup():
    mc = get_preset("tiny")
    model = LlamaModel(mc, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=256, page_size=16, token_budget=64, verify_rows=K + 1)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (70, 110, 93)]
    return model, cfg, prompts


@pytest.fixture(scope="module")
def plain(setup):
    model, cfg, prompts = setup
    return {att: generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention=att)
            for att in ("sparse", "dense")}


def oracle(prompts, refs, wrong_every=3):
    """A drafter that proposes the plain run's continuation, with its second draft wrong every `wrong_every`-th
    call (so verification sees full acceptances, partial ones and rejections)."""
    calls = [0]
    by_prompt = {tuple(p): r for p, r in zip(prompts, refs)}

    def drafter(slot, history, k):
        calls[0] += 1
        for p, r in by_prompt.items():
            if tuple(history[:len(p)]) == p:
                done = len(history) - len(p)
                d = list(r[done:done + k])
                if calls[0] % wrong_every == 0 and len(d) > 1:
                    d[1] = (d[1] + 1) % 256
                return d
        raise AssertionError("unknown prompt")
    return drafter


def spec_engine(model, cfg, attention, spec=SpecConfig("ngram", K), **kw):
    eng = Engine(generator=Generator(model, cfg, attention=attention), speculative=spec, **kw)
    eng.spec.fixed_rows = True
    return eng


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_greedy_speculative_equals_plain_ragged_batch(setup, plain, attention):
    model, cfg, prompts = setup
    refs = plain[attention]
    eng = spec_engine(model, cfg, attention)
    eng.spec.drafter = oracle(prompts, refs)
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=MAX_NEW))   # 3 prompts, 2 slots: one queues
    for r, ref in zip(reqs, refs):
        assert r.finish_reason == "length", r.error
        assert r.tokens == ref
    sp = eng.spec
    assert 0.3 < sp.acceptance_rate < 1.0, (sp.accepted, sp.proposed)
    assert sp.steps < sum(len(r) for r in refs)           # fewer verifications than tokens
    assert sorted(eng.gen.backend.manager.alloc.free_slots if attention == "sparse" else eng.gen.backend._free) \
        == list(range(cfg.max_seqs))


def test_stop_id_and_max_length_inside_a_draft(setup, plain):
    model, cfg, prompts = setup
    refs = plain["sparse"]
    eng = spec_engine(model, cfg, "sparse")
    eng.spec.drafter = oracle(prompts, refs, wrong_every=1000)   # full drafts: stops and limits land inside them
    stop = refs[0][9]
    n_stop = refs[0].index(stop) + 1
    params = [SamplingParams(max_new_tokens=MAX_NEW, stop_ids=(stop,)), SamplingParams(max_new_tokens=7),
              SamplingParams(max_new_tokens=2)]
    r0, r1, r2 = eng.run(prompts, params)
    assert r0.finish_reason == "stop" and r0.tokens == refs[0][:n_stop]
    assert r1.finish_reason == "length" and r1.tokens == refs[1][:7]
    assert r2.finish_reason == "length" and r2.tokens == refs[2][:2]


def test_ngram_drafter_greedy_equals_plain(setup):
    """Repetitive prompts (ngram matches, partly right): the real drafter, row-count buckets (1, 2, 4 rows), the
    back-off to plain chunks between flush points."""
    model, cfg, _ = setup
    rng = np.random.default_rng(3)
    unit = [int(t) for t in rng.integers(0, 256, 12)]
    prompts = [unit * 6 + unit[:5], (unit[::-1] * 8)[:90]]
    ref = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention="sparse")
    eng = Engine(generator=Generator(model, cfg, attention="sparse"), speculative=EVERY)
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [r.tokens for r in reqs] == ref
    assert eng.spec.proposed > 0
    # drafts rejected step after step: the slots stop drafting for a while and plain chunks run instead
    assert any(r.decode_steps > 1 for r in eng.timeline)
    assert eng.spec.steps < sum(r.decode_steps for r in eng.timeline)


@pytest.fixture(scope="module")
def repetitive(setup):
    """Prompts the ngram drafter finds matches in (the tiny model's continuations repeat them in part), and three
    of them for two slots (one queues)."""
    model, cfg, _ = setup
    rng = np.random.default_rng(3)
    unit = [int(t) for t in rng.integers(0, 256, 12)]
    prompts = [unit * 6 + unit[:5], (unit[::-1] * 8)[:90], (unit[:7] * 12)[:80]]
    return prompts, {att: generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention=att)
                     for att in ("sparse", "dense")}


@pytest.mark.parametrize("attention", ["sparse", pytest.param("dense", marks=pytest.mark.slow)])
def test_chunked_ngram_equals_plain_and_the_per_step_path(setup, repetitive, attention):
    """The device chunk (Program.spec_chunk, the Engine's default for ngram) against plain greedy and against one
    verification per step (chunk_steps = 0): the same tokens for a ragged batch with a queued request and lengths
    that end mid-chunk, the same drafts proposed and accepted (the device drafter and back-off are the host's),
    several verifications per device call, one compiled chunk program whatever the acceptance pattern."""
    model, cfg, _ = setup
    prompts, refs = repetitive
    params = [SamplingParams(max_new_tokens=n) for n in (MAX_NEW, 13, 29)]
    runs = {}
    for chunk_steps in (cfg.page_size, 0):
        eng = Engine(generator=Generator(model, cfg, attention=attention), speculative=EVERY)
        eng.spec.chunk_steps = chunk_steps
        reqs = eng.run(prompts, params)
        assert [r.tokens for r in reqs] == [ref[:p.max_new_tokens] for ref, p in zip(refs[attention], params)]
        assert all(r.finish_reason == "length" for r in reqs)
        runs[chunk_steps] = eng
    chunked, per_step = runs[cfg.page_size].spec, runs[0].spec
    # the chunk proposes before every verification, the per-step path not inside its plain chunks: the counts
    # may differ, the tokens may not
    assert chunked.proposed > 0 and chunked.accepted > 0 and per_step.accepted > 0
    assert 0 < chunked.chunks < chunked.steps and per_step.chunks == 0
    program = runs[cfg.page_size].gen.program
    assert program.spec_chunk(cfg.page_size, K, 3, 0)._cache_size() == 1
    free = runs[cfg.page_size].gen.backend
    assert sorted(free.manager.alloc.free_slots if attention == "sparse" else free._free) == [0, 1]


def test_chunked_ngram_stops_mid_chunk(setup, repetitive):
    """A stop id, a stop string and a length limit that land inside a chunk (the stop id is the target's own token
    after a run of accepted drafts, the limit inside such a run): each request ends with exactly the tokens of
    plain decoding (the tokens the device produced past them are dropped with the slot)."""
    from ulacache_jax.models import ByteTokenizer
    model, cfg, _ = setup
    prompts, refs = repetitive
    ref = refs["sparse"]
    tok = ByteTokenizer()
    run = next(i for i in range(8, MAX_NEW) if ref[2][i] != ref[2][i - 1] == ref[2][i - 2] == ref[2][i - 3])
    stop_id = ref[2][run]                                     # the token that ends a run the drafts repeat
    assert stop_id not in ref[2][:run]
    stop_str = tok.decode(ref[0][MAX_NEW - 4:MAX_NEW - 2])
    params = [SamplingParams(max_new_tokens=MAX_NEW, stop_ids=(), stop=(stop_str,)),
              SamplingParams(max_new_tokens=13, stop_ids=()),
              SamplingParams(max_new_tokens=MAX_NEW, stop_ids=(stop_id,))]
    want = Engine(generator=Generator(model, cfg, attention="sparse"), tokenizer=tok).run(prompts, params)
    eng = Engine(generator=Generator(model, cfg, attention="sparse"), tokenizer=tok, speculative=EVERY)
    got = eng.run(prompts, params)
    assert [w.finish_reason for w in want] == ["stop", "length", "stop"]
    assert want[2].tokens == ref[2][:run + 1] and want[1].tokens == ref[1][:13]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert got[0].text == want[0].text and got[0].stop_reason == stop_str
    assert eng.spec.chunks > 0 and eng.spec.accepted > 0


def record_chunks(sp) -> list[int]:
    """The verifications of each device chunk SpecDecoder `sp` runs (appended as they run)."""
    per_chunk, run_chunk = [], sp._chunk

    def recorded(*a):
        before = sp.steps
        run_chunk(*a)
        per_chunk.append(sp.steps - before)
    sp._chunk = recorded
    return per_chunk


@pytest.mark.parametrize("attention", ["sparse", pytest.param("dense", marks=pytest.mark.slow)])
def test_chunk_at_batch_4_carries_every_slot_a_page(setup, attention):
    """Four slots, ragged repetitive prompts (their flush points fall at different verifications): greedy equal to
    plain, and a chunk does not end at the first slot's flush point: a slot there waits (sparse: its flush writes
    the host pool after the loop) or goes on (dense: nothing to flush), so each chunk carries every slot about a
    page. A second run over the same Generator compiles nothing new."""
    model, _, _ = setup
    cfg4 = default_cache_config(model.config, num_seqs=4, max_tokens=256, page_size=16, token_budget=64,
                                verify_rows=K + 1)
    rng = np.random.default_rng(3)
    unit = [int(t) for t in rng.integers(0, 256, 12)]
    prompts = [unit * 6 + unit[:5], (unit[::-1] * 8)[:90], (unit[:7] * 12)[:80], (unit[:5] * 20)[:75]]
    n = 48
    ref = generate(model, prompts, max_new_tokens=n, cache_config=cfg4, attention=attention)
    gen = Generator(model, cfg4, attention=attention)

    def run():
        eng = Engine(generator=gen, speculative=EVERY)
        sp, per_chunk = eng.spec, record_chunks(eng.spec)
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=n))
        assert [r.tokens for r in reqs] == ref
        assert len(per_chunk) == sp.chunks
        return sp, per_chunk

    sp, per_chunk = run()
    assert sp.accepted > 0
    # a second Engine over the same Generator compiles nothing new (the history upload included); counted as a
    # difference: Programs are shared by config, so earlier tests in this process may have compiled entries too
    programs = (gen.program.set_row, gen.program.spec_chunk(cfg4.page_size, K, 3, 0))
    before = [f._cache_size() for f in programs]
    run()
    assert [f._cache_size() for f in programs] == before
    assert sp.chunks <= n // cfg4.page_size + 2, per_chunk
    assert sum(per_chunk) >= 6 * sp.chunks, per_chunk


@pytest.mark.parametrize("who", ["nobody", "one slot"])
def test_chunk_without_drafts_runs_plain_steps_to_the_flush_point(setup, repetitive, monkeypatch, who):
    """The host finds drafts (so a device chunk runs) but the chunk's own proposals are empty ("nobody"), or only
    slot 0 proposes, one draft ("one slot": while both slots run, 1 draft < 1 per slot, so the batch gate,
    gate_rows, cuts it): those verifications take the one-row branch (a plain step), the chunk does not end there
    but runs on to the slots' flush points, and the tokens equal plain decoding's (sparse: the backend with flush
    points). A config of its own, so the chunk program is traced with the altered proposals."""
    attention = "sparse"
    from ulacache_jax.runtime.speculative import ngram as ngram_device
    from ulacache_jax.runtime import program as program_module
    model, _, _ = setup
    prompts, refs = repetitive
    # Quest: the draft pattern below was laid out on its greedy tokens
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=288, page_size=16, token_budget=64,
                               verify_rows=K + 1, key_channels=0)
    real, real_gate, gated = ngram_device.propose, program_module.gate_rows, []

    def fewer(*a, **kw):
        drafts, nd = real(*a, **kw)
        return drafts, (jnp.zeros_like(nd) if who == "nobody" else jnp.minimum(nd, 1).at[1:].set(0))

    def spy(nrows, lo):        # the chunk's gate, its rows in and out recorded
        out = real_gate(nrows, lo)
        jax.debug.callback(lambda i, o: gated.append((np.asarray(i), np.asarray(o))), nrows, out)
        return out
    monkeypatch.setattr(ngram_device, "propose", fewer)
    monkeypatch.setattr(program_module, "gate_rows", spy)
    ref = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention=attention)
    eng = Engine(generator=Generator(model, cfg, attention=attention), speculative=SpecConfig("ngram", K))
    sp, per_chunk = eng.spec, record_chunks(eng.spec)
    try:
        reqs = eng.run(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    finally:       # Programs are shared by config: no later test may get the chunk traced with these proposals
        eng.gen.program._spec_chunk_for.cache_clear()
    assert [r.tokens for r in reqs] == ref
    assert sp.chunks > 0 and gated
    assert all(o.tolist() == gate_rows(i, 1.0).tolist() for i, o in gated)
    if who == "nobody":
        assert sp.proposed == 0 and sp.accepted == 0     # every row verified alone
    else:          # slot 0's draft cut where slot 1 ran beside it; verified where slot 0 ran alone
        assert any(i[0] == 2 and i[1] == 1 and o.max() == 1 for i, o in gated), gated
    # a chunk starts where the host found a draft and ends only where every running slot reached its flush
    # point (or ended): far more than the one verification the drafts alone would give it
    assert max(per_chunk) >= cfg.page_size // 2, per_chunk


def test_gate_rows():
    """The batch gate: rows kept where the drafts number at least min per slot with rows (slots without rows
    neither count nor change), else one row a slot; the host (numpy) and the traced rule agree."""
    cases = [([0, 3, 1, 1], 1.0, [0, 1, 1, 1]),               # 2 drafts, 3 running slots: cut
             ([0, 4, 1, 1], 1.0, [0, 4, 1, 1]),               # 3 drafts, 3 running slots: kept
             ([5, 1, 1, 1, 1, 1], 1.0, [1, 1, 1, 1, 1, 1]),   # one slot's 4 drafts among 6 running: cut
             ([5, 1, 1, 1, 1, 1], 0.5, [5, 1, 1, 1, 1, 1]),
             ([0, 0, 0], 1.0, [0, 0, 0]),
             ([2, 0, 1], 0.0, [2, 0, 1])]
    for nrows, lo, want in cases:
        got_np = gate_rows(np.asarray(nrows, np.int32), lo)
        got_jx = jax.jit(gate_rows, static_argnums=1)(jnp.asarray(nrows, jnp.int32), lo)
        assert got_np.tolist() == want and np.asarray(got_jx).tolist() == want, (nrows, lo)
        assert got_np.dtype == np.int32 and got_jx.dtype == jnp.int32


def test_spec_chunk_copies_no_pool(setup):
    """The chunk's loop carries the cache (updated in place) and only reads the host pool (written once, after the
    loop, as decode's chunk does): a big frame pool; a copy of it would show up as temp memory of its size."""
    model, _, _ = setup
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=256, page_size=16, num_buckets=64,
                               slots_per_bucket=256, verify_rows=K + 1)
    gen = Generator(model, cfg, attention="sparse")
    S, b = cfg.max_seqs, gen.backend
    z = jnp.zeros(S, jnp.int32)
    args = (gen.params, b.cache, b.host, jnp.zeros((S, cfg.max_context), jnp.int32), z, jnp.ones(S, bool), z, z,
            (z, z, z), row_keys(jnp.zeros(S, jnp.uint32), jnp.zeros(S, jnp.uint32)), SamplingArrays.fill(S),
            jnp.full((S, 8), -1, jnp.int32))
    mem = gen.program.spec_chunk(cfg.page_size, K, 3).lower(*args).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.5 * b.cache.pool_k.nbytes, (mem.temp_size_in_bytes, b.cache.pool_k.nbytes)


def test_draft_model_greedy_equals_plain(setup, plain):
    """A draft model (another tiny model: few acceptances; the target itself: all accepted), on a dense cache."""
    model, cfg, prompts = setup
    other = LlamaModel(get_preset("tiny"), rngs=nnx.Rngs(7))
    for draft, att, lo, hi in ((other, "dense", 0.0, 0.6), (model, None, 0.95, 1.0)):
        eng = spec_engine(model, cfg, "sparse", SpecConfig("draft", K, draft_model=draft, draft_attention=att))
        reqs = eng.run(prompts[:2], SamplingParams(max_new_tokens=24))
        assert [r.tokens for r in reqs] == [r[:24] for r in plain["sparse"][:2]]
        assert lo <= eng.spec.acceptance_rate <= hi, eng.spec.acceptance_rate
        d = eng.spec.draft.backend
        free = d._free if att == "dense" else sorted(d.manager.alloc.free_slots, reverse=True)
        assert free == [1, 0]                              # the draft's slots released with the target's


# ---- the cache after a rejected draft ----------------------------------------------------------------------------
def _verify(gen, tokens, nrows, bound, step):
    S = gen.config.max_seqs
    keys = row_keys(jnp.zeros(S, jnp.uint32), jnp.full(S, step, jnp.uint32))
    args = jax.device_put((jnp.asarray(tokens, jnp.int32), jnp.asarray(nrows, jnp.int32),
                           jnp.asarray(bound, jnp.int32), keys, SamplingArrays.fill(S), jnp.zeros((), jnp.float32)),
                          gen.replicated)
    b = gen.backend
    b.cache, b.host, out, n_new, length, flush, _ = gen.program.verify(K + 1)(gen.params, b.cache, b.host, *args)
    return np.asarray(out), np.asarray(n_new)


def _committed_view(gen, slot=0):
    """What later steps can read: lengths, flushed, key summaries of pages holding committed tokens, vTLB host
    entries, the host pool, and the tail ring's committed tokens."""
    st, host, c = gen.backend.cache, gen.backend.host, gen.config
    L, f = int(st.seqs.length[slot]), int(st.seqs.flushed[slot])
    from ulacache_jax.cache.state import tail_frame
    npages = -(-L // c.page_size)
    ring = []
    for p in range(f, npages):
        n = min(c.page_size, L - p * c.page_size)
        fr = [tail_frame(c, slot, l, g, p) for l in range(c.num_layers) for g in range(c.groups_per_rank)]
        ring.append(np.asarray(st.pool_k[0, np.array(fr), :n]))
        ring.append(np.asarray(st.pool_v[0, np.array(fr), :n]))
    return dict(length=np.asarray(st.seqs.length), flushed=np.asarray(st.seqs.flushed),
                kmin=np.asarray(st.kmin[0, slot, :, :, :npages]), kmax=np.asarray(st.kmax[0, slot, :, :, :npages]),
                host_page=np.asarray(st.vtlb.host_page), host_k=np.asarray(host.k), host_v=np.asarray(host.v),
                ring=ring)


def test_rejected_draft_leaves_the_cache_of_a_run_that_never_drafted(setup):
    """Two caches decode one prompt: A verifies K drafts every step (wrong ones, or right ones on a schedule), B
    never drafts. Whenever they have committed the same tokens, everything a later step can read is equal; the
    rejected leases in A's ring are then poisoned (NaN) and A still decodes B's tokens with B's cache state."""
    model, cfg, prompts = setup
    c = cfg
    prompt = prompts[1]                                        # 110 tokens: 6 flushed pages of 16, budget 4 pages
    gens = [Generator(model, cfg, attention="sparse"), Generator(model, cfg, attention="sparse")]   # one program
    firsts = []
    for g in gens:
        slot = g.admit(len(prompt) + 80)
        assert slot == 0
        firsts.append(int(jnp.argmax(g.prefill(slot, prompt))))
    tok = [firsts[0], firsts[1]]
    L = len(prompt)
    S = c.max_seqs
    step = 0
    while L < len(prompt) + 60:                                # crosses several flush points
        b = next_flush(len(prompt), L, c.page_size)
        # B: one plain step (one row, no drafts) gives the next token t1
        tb = np.zeros((S, K + 1), np.int32)
        tb[0, 0] = tok[1]
        out_b, n_b = _verify(gens[1], tb, [1, 0], [b, 0], step)
        assert n_b[0] == 1
        t1 = int(out_b[0, 0])
        # A: up to K drafts (cut at the flush point): all wrong on even steps, the right first one on odd steps
        nd = min(K, b - L - 1)
        ta = np.zeros((S, K + 1), np.int32)
        ta[0, 0] = tok[0]
        d = [(t1 + 1) % 256] * K if step % 2 == 0 else [t1] + [(t1 + 1 + j) % 256 for j in range(K - 1)]
        ta[0, 1:1 + nd] = d[:nd]
        out_a, n_a = _verify(gens[0], ta, [1 + nd, 0], [b, 0], step)
        got = [int(t) for t in out_a[0, :n_a[0]]]
        assert got[0] == t1 and (n_a[0] == 1 if step % 2 == 0 or nd == 0 else n_a[0] >= 2)
        # B catches up with plain steps: the same tokens
        Lb = L + 1
        for t_prev, t_next in zip(got[:-1], got[1:]):
            tb[0, 0] = t_prev
            out_b, _ = _verify(gens[1], tb, [1, 0], [next_flush(len(prompt), Lb, c.page_size), 0], step + 1000)
            assert int(out_b[0, 0]) == t_next
            Lb += 1
        L += int(n_a[0])
        assert Lb == L
        tok = [got[-1], got[-1]]
        va, vb = _committed_view(gens[0]), _committed_view(gens[1])
        for k in va:
            if k == "ring":
                assert len(va[k]) == len(vb[k]) and all(np.array_equal(x, y) for x, y in zip(va[k], vb[k])), k
            else:
                assert np.array_equal(va[k], vb[k]), (k, step)
        step += 1
    assert int(gens[0].backend.cache.seqs.flushed[0]) > len(prompt) // c.page_size   # flushes happened

    # poison A's ring past the committed length (the rejected leases): later steps never read it
    st = gens[0].backend.cache
    from ulacache_jax.cache.state import tail_frame
    Lc = int(st.seqs.length[0])
    pk, pv = st.pool_k, st.pool_v
    for pos in range(Lc, Lc + K + 1):
        for l in range(c.num_layers):
            for g in range(c.groups_per_rank):
                fr = tail_frame(c, 0, l, g, pos // c.page_size)
                pk = pk.at[0, fr, pos % c.page_size].set(jnp.nan)
                pv = pv.at[0, fr, pos % c.page_size].set(jnp.nan)
    gens[0].backend.cache = dataclasses.replace(st, pool_k=pk, pool_v=pv)
    for i in range(6):
        b = next_flush(len(prompt), L, c.page_size)
        outs = []
        for g in gens:
            t = np.zeros((S, K + 1), np.int32)
            t[0, 0] = tok[0]
            o, n = _verify(g, t, [1, 0], [b, 0], 5000 + i)
            outs.append(o[0, 0])
        assert outs[0] == outs[1]
        L += 1
        tok = [int(outs[0])] * 2
    assert np.isfinite(np.asarray(gens[0].next_logits(jnp.asarray(tok, jnp.int32)))).all()


# ---- sampling follows the target ---------------------------------------------------------------------------------
def test_token_probs_is_what_sample_draws_from():
    V, N = 6, 8000
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, V)) * 2, jnp.float32)
    for t, p, k in ((1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3), (0.0, 1.0, 0)):
        params = SamplingArrays.fill(1, t, p, k)
        probs = np.asarray(token_probs(logits, params))[0]
        keys = jax.random.split(jax.random.key(1), N)
        draws = jax.vmap(lambda kk: sample(logits, kk[None], params)[0])(keys)
        freq = np.bincount(np.asarray(draws), minlength=V) / N
        assert np.abs(freq - probs).max() < 0.025, (t, p, k, freq, probs)


@pytest.mark.parametrize("with_probs", [False, True])
def test_accept_rule_keeps_the_target_distribution(with_probs):
    """Many draws of one 3-row verification (V = 3): the first token follows row 0's distribution, and the second,
    given the first is the first draft, follows row 1's; with point-mass drafts and with a draft distribution."""
    V, Q, N = 3, 3, 40000
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, Q, V)) * 1.5, jnp.float32)
    params = SamplingArrays.fill(1, 1.0)
    p = np.asarray(token_probs(logits[0], SamplingArrays.fill(Q, 1.0)))          # [Q, V]
    keys = jax.random.split(jax.random.key(3), N)
    if with_probs:
        q = jnp.asarray(rng.dirichlet(np.ones(V), size=Q - 1), jnp.float32)     # [Q - 1, V]
        dk = jax.random.split(jax.random.key(4), N)
        drafts = jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(q), axis=-1))(dk).astype(jnp.int32)
        one = jax.vmap(lambda d, kk: accept(logits, d[None], jnp.asarray([Q]), kk[None], params, q[None]))
        out, n = one(drafts, keys)
    else:
        drafts = jnp.broadcast_to(jnp.asarray([1, 2], jnp.int32), (N, Q - 1))
        one = jax.vmap(lambda d, kk: accept(logits, d[None], jnp.asarray([Q]), kk[None], params))
        out, n = one(drafts, keys)
    out, n, drafts = np.asarray(out)[:, 0], np.asarray(n)[:, 0], np.asarray(drafts)
    f0 = np.bincount(out[:, 0], minlength=V) / N
    assert np.abs(f0 - p[0]).max() < 0.012, (f0, p[0])
    sel = out[:, 0] == drafts[:, 0]
    assert (n[sel] >= 2).all() and (n[~sel] == 1).all()
    f1 = np.bincount(out[sel, 1], minlength=V) / sel.sum()
    assert np.abs(f1 - p[1]).max() < 0.02, (f1, p[1])


def test_greedy_accept_is_longest_matching_prefix():
    V = 5
    logits = jnp.asarray(np.eye(V)[[2, 4, 1, 3]][None] * 5, jnp.float32)        # argmax rows: 2, 4, 1, 3
    params = SamplingArrays.fill(1, 0.0)
    for drafts, nrows, want in (([2, 4, 1], 4, [2, 4, 1, 3]), ([2, 0, 1], 4, [2, 4, -1, -1]),
                                ([0, 4, 1], 4, [2, -1, -1, -1]), ([2, 4, 1], 2, [2, 4, -1, -1]),
                                ([2, 4, 1], 1, [2, -1, -1, -1])):
        out, n = accept(logits, jnp.asarray([drafts], jnp.int32), jnp.asarray([nrows]), jax.random.key(0)[None],
                        params)
        assert np.asarray(out)[0].tolist() == want and int(n[0]) == sum(t >= 0 for t in want), (drafts, nrows)


def test_sampled_verification_follows_the_model(setup):
    """Through the tiny model's verification (dense, 2 slots, top-k 3 at temperature 2): the first verified token
    follows the model's next-token distribution whatever the drafts (point masses on the likeliest and on an
    unlikely token)."""
    model, cfg, prompts = setup
    gen = Generator(model, cfg, attention="dense")
    S = cfg.max_seqs
    prompt = prompts[0]
    for s in range(S):
        assert gen.admit(len(prompt) + 8) == s
        gen.prefill(s, prompt)
    tok = jnp.full(S, 5, jnp.int32)
    params = SamplingArrays.fill(S, 2.0, 1.0, 3)
    p = np.asarray(token_probs(gen.next_logits(tok), params))[0]
    top = np.argsort(-p)[:3]
    L0 = np.asarray(gen.backend.length)
    counts = np.zeros(p.shape[0])
    tokens = np.zeros((S, K + 1), np.int32)
    tokens[:, 0] = 5
    tokens[0, 1:] = top[0]
    tokens[1, 1:] = top[2]
    b = gen.backend
    rounds = 300
    for i in range(rounds):
        keys = row_keys(jnp.asarray([11, 12], jnp.uint32), jnp.full(S, i, jnp.uint32))
        args = jax.device_put((jnp.asarray(tokens), jnp.asarray([K + 1] * S, jnp.int32),
                               jnp.asarray([10**6] * S, jnp.int32), keys, params, jnp.zeros(())), gen.replicated)
        b.cache, b.host, out, n, _, _, _ = gen.program.verify(K + 1)(gen.params, b.cache, b.host, *args)
        for t in np.asarray(out)[:, 0]:
            counts[t] += 1
        b.length = jax.device_put(L0, b._rep)                  # roll back: the same step again
    freq = counts / counts.sum()
    assert set(np.nonzero(counts)[0]) <= set(top.tolist())
    assert np.abs(freq - p).max() < 0.06, (freq[top], p[top])


# ---- small parts ---------------------------------------------------------------------------------------------------
def test_ngram_propose_and_flush_points():
    h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(h, 2, 3) == [7, 8]                    # the latest earlier match of [1, 2, 3]
    assert ngram_propose(h + [5], 3, 3) == []
    assert ngram_propose([4, 5, 4], 3, 3) == [5, 4]            # falls back to a 1-gram
    assert ngram_propose(h, 0, 3) == []
    rng = np.random.default_rng(5)
    from ulacache_jax.runtime.speculative.rules import NgramIndex
    for _ in range(30):
        seq = [int(t) for t in rng.integers(0, 4, 60)]
        idx = NgramIndex(3)
        for T in range(1, 60, 7):                               # incremental == the scan, as the history grows
            assert idx.propose(seq[:T], 3) == ngram_propose(seq[:T], 3, 3)
        idx = NgramIndex(3)
        for T in range(20, 60, 5):                              # given as prompt + generated tokens
            assert idx.propose(seq[:20], 2, seq[20:T]) == ngram_propose(seq[:T], 2, 3)
    assert next_flush(100, 100, 16) == 116 and next_flush(100, 115, 16) == 116 and next_flush(100, 116, 16) == 132


def test_ngram_index_bulk_and_token_by_token_agree_with_the_scan():
    # a prompt is indexed with numpy windows (>= NgramIndex._BULK new tokens), decode tokens one by one: both write
    # the same keys, so proposals across the switch (and for ids past 32 bits, negative ids) equal the scan's
    from ulacache_jax.runtime.speculative.rules import NgramIndex
    rng = np.random.default_rng(11)
    for trial in range(60):
        nmax, n = int(rng.integers(1, 5)), int(rng.integers(1, 300))
        seq = [int(t) for t in rng.integers(0, int(rng.integers(2, 6)), n)]
        if trial % 3 == 0:
            seq = [t * 2**40 - 7 for t in seq]
        idx, T = NgramIndex(nmax), 0
        while T < n:
            T = min(n, T + int(rng.choice([1, 3, NgramIndex._BULK - 1, NgramIndex._BULK, 90])))
            k = int(rng.integers(0, 5))
            assert idx.propose(seq[:T], k) == ngram_propose(seq[:T], k, nmax), (trial, T)


def test_spec_config_errors():
    with pytest.raises(ValueError, match="method"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num_tokens"):
        SpecConfig("ngram", 0)
    with pytest.raises(ValueError, match="draft_model"):
        SpecConfig("draft", 4)
    with pytest.raises(ValueError, match="ngram"):
        SpecConfig("ngram", 4, draft_model="x")
    for bad in (-0.5, 5, "1", True):
        with pytest.raises(ValueError, match="min_drafts_per_slot"):
            SpecConfig("ngram", 4, min_drafts_per_slot=bad)


def test_greedy_speculative_equals_plain_when_selected_pages_overflow(setup):
    """A PB-LRU of 2 frames (far less than one step's 16 selected pages): misses overflow every step, and every
    row's distinct overflow pages are staged at once, in overflow frames sized for K + 1 rows (verify_rows)."""
    model, cfg, prompts = setup
    small = default_cache_config(model.config, num_seqs=2, max_tokens=256, page_size=16, token_budget=64,
                                 num_buckets=1, slots_per_bucket=2, verify_rows=K + 1)
    ref = generate(model, prompts[:2], max_new_tokens=24, cache_config=small, attention="sparse")
    eng = spec_engine(model, small, "sparse")
    eng.spec.drafter = oracle(prompts[:2], ref)
    reqs = eng.run(prompts[:2], SamplingParams(max_new_tokens=24))
    assert [r.tokens for r in reqs] == ref
    assert eng.stats_totals()["overflow"] > 0


def test_verify_rows_sized_for_the_drafts(setup):
    """An Engine that builds its cache sizes the overflow frames for K + 1 rows; a prebuilt sparse generator whose
    cache has fewer is refused with the value and the limit (a verification would have nowhere to stage them)."""
    model, cfg, _ = setup
    one_row = dataclasses.replace(cfg, verify_rows=1)
    eng = Engine(model, one_row, attention="sparse", speculative=SpecConfig("ngram", K))
    assert eng.config.verify_rows == K + 1
    assert eng.config.overflow_frames == (K + 1) * one_row.overflow_frames
    with pytest.raises(ValueError, match=rf"verify_rows >= {K + 1} \(it is 1\)"):
        Engine(generator=Generator(model, one_row, attention="sparse"), speculative=SpecConfig("ngram", K))
    Engine(generator=Generator(model, one_row, attention="dense"), speculative=SpecConfig("ngram", K))  # no frames


def test_cli_flags():
    from ulacache_jax.app import cli
    p = cli.build_parser()
    base = ["generate", "--input", "in.jsonl", "--output", "out.jsonl"]
    assert cli._spec_config(p.parse_args(base)) is None
    spec = cli._spec_config(p.parse_args(base + ["--speculative", "ngram", "--num-speculative-tokens", "6"]))
    assert spec == SpecConfig("ngram", 6)
    spec = cli._spec_config(p.parse_args(base + ["--speculative", "draft", "--draft-model", "smollm2-135m"]))
    assert spec.method == "draft" and spec.draft_model == "smollm2-135m" and spec.num_tokens == 4
    for bad in (["--speculative", "draft"], ["--draft-model", "m"], ["--speculative", "ngram", "--draft-model", "m"],
                ["--speculative", "ngram", "--num-speculative-tokens", "64"]):
        with pytest.raises(cli.UsageError):
            cli._spec_config(p.parse_args(base + bad))


def test_bench_speculative_small(tmp_path):
    """scripts/bench_speculative.py --small: plain and speculative rows, greedy outputs equal (float32)."""
    import json
    import os
    import sys
    from scripts import bench_speculative
    bench_speculative.main(["--small", "--out", str(tmp_path / "bench")])   # --out is a folder, made if missing
    out = tmp_path / "bench" / "speculative.json"
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "ngram"]
    assert rows[1]["match"] and rows[1]["match_tokens"] == 1.0 and rows[1]["decode_tok_s"] > 0
    # the plot beside the JSON (one bar per speculative row), and again from the JSON alone (--png)
    png = tmp_path / "bench" / "speculative.png"
    assert png.stat().st_size > 0
    png.unlink()
    bench_speculative.main(["--png", str(out)])
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):                          # a file name for --out: refused before any work
        bench_speculative.main(["--small", "--out", str(tmp_path / "spec.json")])
