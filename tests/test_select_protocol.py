"""The page-selection protocol (ulacache_jax/cache/select/rule.py): a rule defined in this file alone, with no
library file edited, runs through the cache and `generate`.

The toy rule `Sketch` keeps a 2-channel int8 sketch of every key (channels 0 and 1, a fixed scale), per token, in
`CacheState.sel`: written by its append (decode steps), flush (completed pages), ingest (prefill blocks), attach
(a shared prefix's pages) and commit (speculative rows) hooks, read by its score (each page's largest sketched
logit, summed over the group's query heads). Checked: the state after ingest + decode steps holds the sketch of
every key written, an attached prefix's sketch equals the ingesting slot's, a covering budget gives dense
attention's tokens through `generate` (prefix cache on: the rule shares prefixes), a small budget runs (with shared
prefixes and speculative decoding, which must give the plain run's tokens), and the registry / config plumbing."""
import dataclasses
from typing import ClassVar

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.select import registry
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.cache.select.two_stage import TwoStage
from ulacache_jax.cache.select.rule import SelectionRule
from cache_steps import ingest_and_decode, tiny_model

PAGE, D = 8, 16


@dataclasses.dataclass(frozen=True)
class Sketch(SelectionRule):
    """channels of every key as int8 codes at a fixed `scale`: state [R, S, L, G, P * page, g, 2] int8, per token."""
    channels: tuple = (0, 1)
    scale: float = 1 / 32
    name: ClassVar[str] = "sketch"

    def encode(self, k):
        """k [..., D] -> [..., 2] int8."""
        x = k[..., jnp.asarray(self.channels)].astype(jnp.float32) / self.scale
        return jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8)

    def init(self, config, ranks):
        c = config
        return jnp.zeros((ranks, c.max_seqs, c.num_layers, c.groups_per_rank, c.max_context, c.kv_heads_per_group,
                          len(self.channels)), jnp.int8)

    def append(self, state, layer, k, pos, live):                    # one rank; k [S, G, g, D]
        S = k.shape[0]
        tok = jnp.where(live, pos, state.config.max_context)                              # out of range: dropped
        sel = state.sel.at[0, jnp.arange(S), layer, :, tok].set(self.encode(k), mode="drop")
        return dataclasses.replace(state, sel=sel)

    def _write_tail(self, state, kp, tok):                           # one rank; kp [S, L, G, T, page, g, D]
        S, L, G = kp.shape[:3]
        s = jnp.arange(S)[:, None, None, None, None]
        l = jnp.arange(L)[None, :, None, None, None]
        g = jnp.arange(G)[None, None, :, None, None]
        return dataclasses.replace(state, sel=state.sel.at[0, s, l, g, tok].set(self.encode(kp), mode="drop"))

    def flush(self, state, kp, page):                                # page [S, 1, 1, T], max_pages: dropped
        P = state.config.page_size
        return self._write_tail(state, kp, page[..., None] * P + jnp.arange(P))

    def commit(self, state, tail_k, length):                         # committed tail tokens only
        c = state.config
        T = tail_k.shape[3]
        tp = state.seqs.flushed[:, None] + jnp.arange(T)[None, :]                          # [S, T]
        tok = tp[:, :, None] * c.page_size + jnp.arange(c.page_size)                        # [S, T, page]
        ok = state.seqs.active[:, None, None] & (tok < length[:, None, None])
        return self._write_tail(state, tail_k, jnp.where(ok, tok, c.max_context)[:, None, None])

    def ingest(self, state, slot, layer0, page0, kp, live, first):   # all ranks; kp [R, Lb, G, n, page, g, D]
        R, Lb, G, n, page, g, _ = kp.shape
        codes = self.encode(kp).reshape(R, 1, Lb, G, n * page, g, -1)
        z = jnp.zeros((), jnp.int32)
        at = (z, jnp.asarray(slot, jnp.int32), jnp.asarray(layer0, jnp.int32), z,
              jnp.asarray(page0 * page, jnp.int32), z, z)
        return dataclasses.replace(state, sel=jax.lax.dynamic_update_slice(state.sel, codes, at))

    def attach(self, state, slot, layer, kp, live):                  # all ranks; kp [R, G, n, page, g, D]
        R, G, n, page, g, _ = kp.shape
        z = jnp.zeros((), jnp.int32)
        at = (z, jnp.asarray(slot, jnp.int32), jnp.asarray(layer, jnp.int32), z, z, z, z)
        old = jax.lax.dynamic_slice(state.sel, at, (R, 1, 1, G, n * page, g, len(self.channels)))
        new = self.encode(kp).reshape(old.shape)
        keep = jnp.repeat(live, page)[None, None, None, None, :, None, None]
        return dataclasses.replace(state, sel=jax.lax.dynamic_update_slice(state.sel, jnp.where(keep, new, old), at))

    def release(self, state, slot):
        return dataclasses.replace(state, sel=state.sel.at[:, slot].set(0))

    def score(self, state, layer, q, flushed, options):              # q [S, 1, Hr, D] -> [S, G, P]
        c = state.config
        sk = state.sel[0, :, layer].astype(jnp.float32) * self.scale                        # [S, G, Tm, g, 2]
        S, G, Tm, g, _ = sk.shape
        h = q.shape[2] // (G * g)
        qc = q[:, 0].astype(jnp.float32).reshape(S, G, g, h, -1)[..., jnp.asarray(self.channels)]
        logit = jnp.einsum("sjghc,sjtgc->sjght", qc, sk)                                    # [S, G, g, h, Tm]
        best = logit.reshape(S, G, g, h, Tm // c.page_size, c.page_size).max(axis=-1).sum(axis=(2, 3))
        ok = jnp.arange(best.shape[-1])[None, None, :] < flushed[:, None, None]
        return jnp.where(ok, best, -jnp.inf)

    def step_bytes(self, *, context, num_layers, kv_heads, head_dim, itemsize, page_size):
        return context * num_layers * kv_heads * len(self.channels)


def encode_np(k, rule=Sketch()):
    return np.clip(np.round(k[..., list(rule.channels)] / rule.scale), -127, 127).astype(np.int8)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_registry_and_config():
    """A rule is registered in a new mapping (the default one stays as it is), named by the config, and part of
    its static (hashable) identity; a non-rule or a rule beside key_channels is refused."""
    rules = registry.register_rule("sketch", Sketch)
    assert "sketch" in rules and "sketch" not in registry.DEFAULT_RULES
    with pytest.raises(TypeError):
        registry.DEFAULT_RULES["x"] = Sketch
    with pytest.raises(ValueError, match="already a rule"):
        registry.register_rule("quest", Sketch)
    c = CacheConfig.preset("tiny", selection=rules["sketch"].from_config(CacheConfig.preset("tiny")))
    assert c.rule == "sketch" and c.selection_rule == Sketch()
    assert registry.kept_rules(c) == (Quest(1), Sketch())
    assert hash(c) == hash(CacheConfig.preset("tiny", selection=Sketch()))
    assert c.footprint()["selection"] == 4 * 2 * 2 * 256 * 1 * 2                  # [S, L, G, context, g, 2] int8
    assert "selection" not in CacheConfig.preset("tiny").footprint()
    assert c != CacheConfig.preset("tiny", selection=Sketch(scale=0.5))
    assert CacheConfig.preset("tiny").rule == "quest" and registry.kept_rules(CacheConfig.preset("tiny")) == (Quest(1),)
    with pytest.raises(ValueError, match="must be a SelectionRule"):
        CacheConfig.preset("tiny", selection="sketch")
    with pytest.raises(ValueError, match="leave key_channels at 0"):
        CacheConfig.preset("tiny", selection=Sketch(), key_channels=4)
    with pytest.raises(ValueError, match="keep_pages"):
        CacheConfig.preset("tiny", selection=TwoStage(Sketch(), keep_pages=2))
    from ulacache_jax.runtime.cost_model import CostModel
    from ulacache_jax.models import get_preset
    shape = dict(batch=1, context=4096, token_budget=256, page_size=16, itemsize=4)
    terms = CostModel().step_terms("sparse", get_preset("tiny"), rule=Sketch(), **shape)
    quest = CostModel().step_terms("sparse", get_preset("tiny"), **shape)
    # the scores read 2 int8 channels a token instead of Quest's min and max of every page (float32, D = 16)
    assert terms["hbm"] - quest["hbm"] == 4096 * 2 * 2 * 2 - 4096 // 16 * 2 * 2 * 2 * 16 * 4


def test_state_holds_the_sketch_of_every_key():
    """After prefill ingestion and decode steps (appends, flushes), the rule's state holds the sketch of every key
    of every sequence, flushed or in the tail; a released slot's sketch is cleared."""
    c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=3, max_pages_per_seq=32, page_size=PAGE,
                    num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=32, dtype="float32",
                    sink_pages=1, recent_pages=1, selection=Sketch())
    rng = np.random.default_rng(0)
    lengths = [37, 61, 8]
    _, state, host, ks = ingest_and_decode(c, lengths, 13, rng)
    assert state.sel.shape == (1, 3, 2, 2, 32 * PAGE, 1, 2) and state.sel.dtype == jnp.int8
    for s, k in enumerate(ks):                                               # k [L, T, KV, D]
        T = k.shape[1]
        assert int(state.seqs.flushed[s]) == T // PAGE
        got = np.asarray(state.sel[0, s, :, :, :T, 0])                      # [L, G, T, 2]
        np.testing.assert_array_equal(got, encode_np(k).transpose(0, 2, 1, 3))
        assert not np.asarray(state.sel[0, s, :, :, T:]).any()
    from ulacache_jax.runtime.sequences import release_device
    st = release_device(state, 1)
    assert not np.asarray(st.sel[:, 1]).any()
    np.testing.assert_array_equal(np.asarray(st.sel[:, 0]), np.asarray(state.sel[:, 0]))


def test_attached_prefix_sketch_equals_the_ingested_one(model):
    """A prompt that attaches a stored prefix (prefix cache on: the rule allows it) holds the same sketch of the
    prefix's pages as the slot that ingested them."""
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    rng = np.random.default_rng(3)
    doc = [int(t) for t in rng.integers(0, 256, 70)]                # 4 complete pages of 16
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16, token_budget=64,
                               selection=Sketch())
    gen = Generator(model, cfg, attention="sparse")
    gen.set_prefix_cache(True)
    a, b = doc + [1, 2, 3], doc + [9, 8, 7, 6, 5]
    sa = gen.admit(len(a) + 8, a)
    gen.prefill(sa, a)
    sb = gen.admit(len(b) + 8, b)
    gen.prefill(sb, b)
    assert gen.prefix_stats().hit_tokens == 4 * 16
    st = gen.cache.state
    n = 4 * 16
    np.testing.assert_array_equal(np.asarray(st.sel[:, sb, :, :, :n]), np.asarray(st.sel[:, sa, :, :, :n]))
    assert np.asarray(st.sel[:, sb, :, :, :n]).any()


def test_generate_covering_budget_equals_dense_with_prefix_cache(model):
    """generate() through the toy rule, a budget covering every prompt: dense attention's tokens. Two prompts share
    their first pages, so with the prefix cache on (generate's default: the rule shares prefixes) the second may
    attach them."""
    from ulacache_jax import generate
    from ulacache_jax.runtime.generation import default_cache_config
    rng = np.random.default_rng(0)
    doc = [int(t) for t in rng.integers(0, 256, 40)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (30, 3)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16, selection=Sketch())
    assert cfg.select_pages * cfg.page_size >= 128 and cfg.rule == "sketch"
    sparse = generate(model, prompts, max_new_tokens=8, cache_config=cfg, attention="sparse")
    assert sparse == generate(model, prompts, max_new_tokens=8, attention="dense")


def _small_budget_runs(model, names):
    """Budget 4 pages of 16 (prompts of 100+ tokens select pages) with the toy rule: (prompts, cache config, the
    Engine's tokens for each of `names`: "plain", "shared" (prefix cache; the attach writes the sketch) and "spec"
    (greedy n-gram speculation; its commit rewrites the tail's sketch from committed tokens))."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    rng = np.random.default_rng(2)
    doc = [int(t) for t in rng.integers(0, 256, 100)]
    prompts = [doc + [int(t) for t in rng.integers(0, 256, n)] for n in (5, 23)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=64,
                               verify_rows=4, selection=Sketch())
    params = SamplingParams(max_new_tokens=16)
    kws = {"plain": dict(prefix_cache=False), "shared": dict(prefix_cache=True),
           "spec": dict(prefix_cache=False, speculative=SpecConfig("ngram", 3))}
    outs = {}
    for name in names:
        eng = Engine(generator=Generator(model, cfg, attention="sparse"), **kws[name])
        reqs = eng.run(prompts, params)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        outs[name] = [r.tokens for r in reqs]
        if name == "shared":
            assert eng.prefix_stats().hits >= 1
    return prompts, cfg, outs


def test_small_budget_runs_with_speculative(model):
    """The toy rule runs through the Engine at a budget that selects pages; greedy speculative decoding gives the
    plain run's tokens; the rule selects other pages than Quest does (so the run used it)."""
    from ulacache_jax import generate
    prompts, cfg, outs = _small_budget_runs(model, ("plain", "spec"))
    assert outs["spec"] == outs["plain"]
    quest = generate(model, prompts, max_new_tokens=16, cache_config=dataclasses.replace(cfg, selection=None),
                     attention="sparse")
    assert quest != outs["plain"]           # the sketch selected other pages than Quest's bound


@pytest.mark.slow
def test_small_budget_runs_with_shared_prefixes_and_two_stage(model):
    """The same runs with shared prefixes, through `generate`, and as the second stage under a shortlist of every
    page: all give the plain Engine run's tokens."""
    from ulacache_jax import generate
    prompts, cfg, outs = _small_budget_runs(model, ("plain", "shared"))
    assert outs["shared"] == outs["plain"]
    small = generate(model, prompts, max_new_tokens=16, cache_config=cfg, attention="sparse")
    assert small == outs["plain"]
    every = TwoStage(Sketch(), keep_pages=cfg.max_pages_per_seq)
    two = generate(model, prompts, max_new_tokens=16, attention="sparse",
                   cache_config=dataclasses.replace(cfg, selection=every))
    assert two == outs["plain"]             # a shortlist of every page: the second stage alone
