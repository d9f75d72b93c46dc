"""A small cache filled by prefill ingestion and decode steps, its raw keys kept beside it: the references of the
selection tests (test_summary_split.py, test_key_copy.py) check what the cache holds against those keys."""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.cache.decode_layer import attend_layer, flush_tail
from ulacache_jax.runtime.sequences import CacheManager


def ingest_and_decode(c, lengths, steps, rng, *, qpk: int = 2, key_scale=None):
    """c: a CacheConfig of 2 layers and 2 KV heads with max_seqs = len(lengths). Ingest random K/V of each length,
    then `steps` decode steps of every layer (random queries with qpk heads per KV head, random new K; the committed
    length advanced and completed pages flushed after each step, as the decode program does). key_scale [D]:
    per-channel scale of the ingested keys (unequal channel energies). -> (manager, state, host, raw K per sequence
    [L, T, KV, D])."""
    D = c.head_dim
    m = CacheManager(c)
    ks = []
    for n in lengths:
        slot = m.admit(n + steps + 8)
        k = rng.standard_normal((2, n, 2, D)).astype(np.float32)
        if key_scale is not None:
            k = k * key_scale
        m.ingest(slot, jnp.asarray(k), jnp.asarray(rng.standard_normal(k.shape).astype(np.float32)), n)
        ks.append(k)
    S = len(lengths)
    step = jax.jit(lambda st, h, l, q, kn, pos: attend_layer(st, h, l, q, kn, kn, pos, jnp.ones(S, bool)),
                   static_argnums=2)
    flush = jitted_flush(m, donate=False)
    state, host = m.state, m.host
    for i in range(steps):
        pos = jnp.asarray([n + i for n in lengths], jnp.int32)
        q = jnp.asarray(rng.standard_normal((S, 1, 2 * qpk, D)), jnp.float32)
        kn = rng.standard_normal((2, S, 2, D)).astype(np.float32)                        # [L, S, KV, D]
        for l in range(2):
            state, _, _ = step(state, host, l, q, jnp.asarray(kn[l]), pos)
        for s in range(S):
            ks[s] = np.concatenate([ks[s], kn[:, s:s + 1]], axis=1)
        state = dataclasses.replace(state, seqs=dataclasses.replace(state.seqs, length=pos + 1))
        state, host = flush(state, host)
    return m, state, host, ks


def tiny_model():
    """The tiny preset's random model in float32 (token-exact comparisons)."""
    from flax import nnx
    from ulacache_jax.models import LlamaModel, get_preset
    return LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))


def assert_covering_budget_equals_dense(model, **overrides):
    """generate() with a sparse cache whose budget covers every prompt (overrides: CacheConfig fields, e.g. a
    selection option) gives dense attention's tokens: every page is attended, whatever the selection rule."""
    from ulacache_jax.runtime.generation import default_cache_config, generate
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (70, 5)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16, **overrides)
    assert all(getattr(cfg, k) == v for k, v in overrides.items())
    sparse = generate(model, prompts, max_new_tokens=8, cache_config=cfg, attention="sparse")
    assert sparse == generate(model, prompts, max_new_tokens=8, attention="dense")


def jitted_flush(m, *, donate: bool = True):
    """flush_tail jitted as the decode program runs it, for CacheManager m's cache: the host pool comes back in its
    own sharding (pinned_host on a GPU; without it XLA refuses the pallas_call output aliased to the host pool);
    donate: the state and host pool are donated, so the flush writes them in place."""
    return jax.jit(flush_tail, donate_argnums=(0, 1) if donate else (), out_shardings=(None, m.host_shardings()))


def hlo_shape(x) -> str:
    """An array's shape as optimized HLO text writes it, e.g. u8[1,3,2,2,32,8,1,2]."""
    names = {"uint8": "u8", "int8": "s8", "int32": "s32", "float32": "f32", "bfloat16": "bf16",
             "float8_e4m3fn": "f8e4m3fn"}
    return f"{names[jnp.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


def copied(hlo_text: str, arrays) -> list[str]:
    """The arrays (by shape) a compiled program copies whole: a `copy` op or XLA's wrapped copy fusion of that
    shape. A buffer updated in place (donated, scattered into where it lies) appears in neither."""
    import re
    out = []
    for x in arrays:
        shape = hlo_shape(x)
        assert shape in hlo_text, shape        # the array is in the program at all
        if re.search(re.escape(shape) + r"\S* (copy\(|fusion\(.*calls=%wrapped_copy)", hlo_text):
            out.append(shape)
    return out

