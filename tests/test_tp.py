"""Head-sharded tensor parallelism (ulacache_jax/runtime/tp.py) on CPU with forced host devices.

The main pytest process has already started jax with one CPU device, so the multi-device checks run this file
as a script in subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax starts, and
read back their JSON reports (two parts side by side: TP = 2, and the rest). Checks: TP = 2, 4, 8 give the same
greedy tokens as TP = 1 and as the single-device `generation.generate`, with prefill and decode logits within fp32
tolerance; each rank's PB-LRU holds only pages of its own groups (and its vTLB slice agrees with it); the shards of
every per-rank array live on their own device; the compiled step has exactly two psums (all-reduces) per layer and
no other collective; more ranks than KV heads replicate heads and still match TP = 1.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from device_env import forced_devices

NUM_DEVICES = 8
# the TP sizes of the shared checks: 1 (the reference), 2 (two KV heads a rank; the dense, key-copy and compiled
# checks run here) and 8 (one head a rank). TP = 4 would repeat 2's case at a quarter of the suite's TP time.
CHECK_TPS = [1, 2, 8]
# the shared checks in two subprocesses that run at once (mode, TPs): TP = 2 (the dense, key-copy and compiled
# checks) takes about as long as the references, TP = 1 and 8, the cache manager and init_model together; one
# process would leave the second core (and the second pytest-xdist worker, waiting on the shared result) idle.
CHECK_PARTS = [("checks", [1, 8]), ("checks-more", [2])]
# the first token from the prefill, then 16 decode steps: two whole chunks of page_size (8) steps, so each config
# compiles one decode program (a shorter last chunk compiles its own: 20 tokens took ~15 s more per part)
MAX_NEW = 17


# ---- the subprocess side ---------------------------------------------------------------------------------------
def _setup():
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.models import LlamaModel, ModelConfig

    # 8 KV heads of 16 dims (TP = 8 gives one head per rank), GQA 2; 2 layers.
    mc = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=16, num_kv_heads=8, head_dim=16, attention_bias=True,
                     attention_out_bias=True)
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    # random biases (zeros at init): q/k/v split by heads, o added once after the psum
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        for name in ("q_bias", "k_bias", "v_bias", "o_bias"):
            b = getattr(a, name)
            b[...] = 0.1 * np.random.default_rng(i).standard_normal(b.shape).astype(np.float32)
    # page 8, budget 32 tokens (4 pages: 1 sink + 2 recent + 1 by score) over 41-63 token prompts: selection is
    # active; 8 x 4 frames per rank hold part of a step's selection at TP = 1 (192 pages), all of it at TP = 8.
    cfg = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=16, max_seqs=4, max_pages_per_seq=16, page_size=8,
                      num_buckets=8, slots_per_bucket=4, host_pages=2 * 8 * 16 * 4, token_budget=32,
                      dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (50, 41, 63)]
    return model, cfg, prompts


def _drive(gen, prompts, cfg):
    """admit + prefill + one decode chunk + next-token logits, without releasing (so the cache can be read)."""
    import jax
    import jax.numpy as jnp
    from ulacache_jax.runtime.sampling import SamplingArrays

    S = cfg.max_seqs
    slots = [gen.admit(len(p) + MAX_NEW) for p in prompts]
    pre = [np.asarray(gen.prefill(s, p)) for s, p in zip(slots, prompts)]
    tok = np.zeros(S, np.int32)
    done = np.ones(S, bool)
    for s, lg in zip(slots, pre):
        tok[s], done[s] = int(np.argmax(lg)), False
    rem = np.where(done, 0, MAX_NEW).astype(np.int32)
    keys = jax.random.split(jax.random.key(0), S)      # one PRNG key per slot (greedy: unused)
    args = (jnp.asarray(tok), jnp.asarray(done), jnp.asarray(rem), keys, SamplingArrays.fill(S),
            jnp.asarray([-1], jnp.int32))
    out, _, _ = gen.decode_chunk(*args)
    out = np.asarray(out)
    last = np.where(done, 0, out[:, -1]).astype(np.int32)
    nxt = np.asarray(gen.next_logits(last))
    return slots, np.stack(pre), out, nxt, args


def _greedy_full_forward(model, prompt, n):
    import jax
    import jax.numpy as jnp

    ids, fwd = list(prompt), jax.jit(model.__call__)
    for _ in range(n):
        T = 1 << (len(ids) - 1).bit_length()           # padded to a power of two: causal, padding cannot leak
        ids.append(int(jnp.argmax(fwd(jnp.asarray([ids + [0] * (T - len(ids))]))[0, len(ids) - 1])))
    return ids[len(prompt):]


def _collectives(text: str) -> dict[str, int]:
    import re
    names = ("all_reduce", "all_gather", "all_to_all", "collective_permute", "reduce_scatter")
    return {n: len(re.findall(rf"\b(stablehlo|mhlo)\.{n}\b|\b{n.replace('_', '-')}(-start)?\(", text)) for n in names}


def _ownership(gen) -> dict:
    """Per rank: held PB-LRU pages, whether every held LID's group is the rank's own, vTLB <-> tag agreement."""
    from ulacache_jax.cache import lid as lid_mod

    st, c = gen.cache.state, gen.config
    G = c.groups_per_rank
    tag_hi, tag_lo, stamp = (np.asarray(a) for a in (st.pb.tag_hi, st.pb.tag_lo, st.pb.stamp))
    frame = np.asarray(st.vtlb.frame)
    report = []
    for r in range(c.tp):
        held = stamp[r] >= 0
        seq, layer, grp, tok = (np.asarray(a) for a in lid_mod.unpack(tag_hi[r][held], tag_lo[r][held]))
        own = bool(np.all((grp >= r * G) & (grp < (r + 1) * G)))
        # vTLB slice [S, L, G, P] -> frames; each resident entry's frame holds exactly that LID (local group + r*G)
        ok = True
        for s, l, g, p in zip(*np.nonzero(frame[r] >= 0)):
            f = frame[r, s, l, g, p]
            b, sl = divmod(int(f), c.slots_per_bucket)
            h = (int(s) << 12) | (int(l) << 4) | (r * G + int(g))
            ok &= stamp[r, b, sl] >= 0 and tag_hi[r, b, sl] == h and tag_lo[r, b, sl] == p * c.page_size
        ok &= int((frame[r] >= 0).sum()) == int(held.sum())
        report.append({"held": int(held.sum()), "own_groups_only": own, "vtlb_matches_tags": bool(ok),
                       "groups_seen": sorted(set(map(int, grp)))})
    placed = []
    for name in ("pool_k", "kmin"):
        arr = getattr(st, name)
        devs = list(gen.mesh.devices.flat)
        placed.append(all(sh.data.shape[0] == 1 and sh.device == devs[sh.index[0].start or 0]
                          for sh in arr.addressable_shards))
    placed.append(all(sh.data.shape[0] == 1 for sh in gen.cache.host.k.addressable_shards))
    return {"ranks": report, "shards_on_own_device": all(placed)}


def run_checks(tps: list[int], reference: bool = True) -> dict:
    """The TP checks at each TP in tps; with `reference`, also the single-device references they are held to
    (`generate` sparse and dense, a Generator's prefill logits)."""
    import jax
    from ulacache_jax.runtime.generation import Generator, generate

    model, cfg, prompts = _setup()
    res: dict = {"devices": len(jax.devices()), "tp": {}}
    t0 = time.perf_counter()
    if reference:
        res["reference"] = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg, attention="sparse")
        res["dense_reference"] = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=cfg,
                                          attention="dense")
        base = Generator(model, cfg)
        res["reference_prefill"] = [np.asarray(base.prefill(base.admit(len(p) + MAX_NEW), p)).tolist()
                                    for p in prompts]
        res["reference_s"] = time.perf_counter() - t0
    for tp in tps:
        t0 = time.perf_counter()
        c = dataclasses.replace(cfg, tp=tp)
        tokens = generate(model, prompts, max_new_tokens=MAX_NEW, tp=tp, cache_config=cfg, attention="sparse")
        # the dense baseline runs on the same program, its KV heads sharded the same way (TP = 2 only: compiles)
        dense = generate(model, prompts, max_new_tokens=MAX_NEW, tp=tp, cache_config=cfg,
                         attention="dense") if tp == 2 else None
        # the key copy (CacheConfig.key_channels) per rank: its channels and copy are per KV head (TP = 2 only)
        key_copy = None
        if tp == 2:
            kc_cfg = dataclasses.replace(cfg, key_channels=4)
            res["key_copy_reference"] = generate(model, prompts, max_new_tokens=MAX_NEW, cache_config=kc_cfg,
                                                 attention="sparse")
            key_copy = generate(model, prompts, max_new_tokens=MAX_NEW, tp=tp, cache_config=kc_cfg,
                                attention="sparse")
        gen = Generator(model, c)
        slots, pre, out, nxt, args = _drive(gen, prompts, c)
        m = gen.cache
        lowered = {"decode": gen.program.decode.lower(gen.params, m.state, m.host, *args),
                   # one prefill layer: every layer runs this one program
                   "prefill_layer": gen.program.prefill_layer.lower(gen.layer_params[0], gen.backend.layer_view(0),
                                                                    np.zeros((1, 64, model.config.hidden_size),
                                                                             np.float32), 0, 1, 50)}
        # the compiled program is checked at TP = 2 only (a second compile costs seconds on CPU)
        coll = {k: {"lowered": _collectives(v.as_text()),
                    "compiled": _collectives(v.compile().as_text()) if tp == 2 else None}
                for k, v in lowered.items()}
        res["tp"][tp] = {"tokens": tokens, "dense_tokens": dense, "key_copy_tokens": key_copy,
                         "prefill": pre.tolist(), "chunk": out.tolist(), "next": nxt.tolist(),
                         "slots": slots, "owner": _ownership(gen), "collectives": coll,
                         "hits_per_rank": gen.rank_stats.hits.tolist(), "misses_per_rank": gen.rank_stats.misses.tolist(),
                         "seconds": time.perf_counter() - t0}
    return res


class _OneDevice:
    """All R ranks of a cache on one device, the device functions jitted directly (no mesh): the reference the
    mesh's per-rank CacheManager must equal."""

    def __init__(self, cfg):
        import jax
        from ulacache_jax.cache import state as cache_state
        from ulacache_jax.runtime import sequences

        self.state, self.host = cache_state.init(cfg)
        self.alloc = sequences.HostAllocator(cfg)
        self._admit = jax.jit(sequences.admit_device, donate_argnums=0)
        self._release = jax.jit(sequences.release_device, donate_argnums=0)
        self._ingest = jax.jit(sequences.ingest_chunk, donate_argnums=(0, 1))

    def admit(self, n):
        slot, table = self.alloc.reserve(n)
        self.state = self._admit(self.state, slot, table)
        return slot

    def release(self, slot):
        self.alloc.free(slot)
        self.state = self._release(self.state, slot)

    def ingest(self, slot, k, v, length, chunk):
        def part(x, start):   # [L, chunk, KV, D], zero-padded past the prompt
            x = np.asarray(x[:, start:start + chunk])
            return np.pad(x, ((0, 0), (0, chunk - x.shape[1]), (0, 0), (0, 0)))
        for start in range(0, length, chunk):
            self.state, self.host = self._ingest(self.state, self.host, slot, part(k, start), part(v, start), start,
                                                 length)


def run_cache_manager(tp: int) -> dict:
    """CacheManager over a mesh of tp devices (per-rank shard_map) against all R ranks on one device: admission,
    chunked ingestion and release leave identical arrays; `shard_cache` of a single-device cache equals
    `init_sharded`."""
    import jax
    import jax.numpy as jnp
    from ulacache_jax.cache import state as cache_state
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.runtime.sequences import CacheManager

    _, cfg, _ = _setup()
    cfg = dataclasses.replace(cfg, tp=tp)
    mesh = tp_mod.make_mesh(tp)
    a, b = CacheManager(cfg, mesh=mesh), _OneDevice(cfg)
    # pinned_host arrays are read through a device copy: np.asarray caches a numpy view on the jax.Array itself,
    # and on a GPU a cached view of a pinned_host array is an external reference that makes the next donating
    # ingest fail (seen on the H200; a jnp.copy of it does not compile: XLA wants its output in host memory too)
    read = lambda x: np.asarray(jax.device_put(x, x.sharding.with_memory_kind("device"))
                                if x.sharding.memory_kind == "pinned_host" else x)
    same = lambda: all(np.array_equal(read(x), read(y))
                       for x, y in zip(jax.tree.leaves((a.state, a.host)), jax.tree.leaves((b.state, b.host))))
    res = {"init": same()}
    s0, h0 = cache_state.init(cfg)
    s1, h1 = tp_mod.shard_cache(s0, h0, mesh)
    res["shard_cache"] = all(np.array_equal(read(x), read(y)) and x.sharding == y.sharding
                             for x, y in zip(jax.tree.leaves((s1, h1)), jax.tree.leaves((a.state, a.host))))
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((cfg.num_layers, 45, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
            for _ in range(2))
    for m in (a, b):
        m.admit(60)
        slot = m.admit(50)
        m.ingest(slot, k, v, 45, chunk=16)
    res["ingest"] = same()
    res["sharded"] = all(x.sharding.spec == tp_mod.P(tp_mod.TP_AXIS) for x in jax.tree.leaves((a.state.pool_k, a.host)))
    for m in (a, b):
        m.release(slot)
    res["release"] = same()
    return res


def run_init_model(tp: int) -> dict:
    """tp.init_model: random weights made in their TP sharding equal an unsharded init of the same seed, and each
    device holds only its shards of the split params."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.models import LlamaModel

    model, _, _ = _setup()
    mc = model.config
    sharded = tp_mod.init_model(mc, tp_mod.make_mesh(tp), dtype=jnp.float32, seed=3)
    ref = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(3))
    pairs = list(zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(ref))))
    q = sharded.layers[0].self_attn.q_proj[...]
    return {"equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
            "q_shards": sorted({sh.data.shape[0] for sh in q.addressable_shards}), "q_heads": q.shape[0]}


def run_replicated(tps: list[int]) -> dict:
    """More ranks than KV heads: 2 KV heads at each TP in tps (at TP = 8 each head on 4 ranks), context within budget."""
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.runtime.generation import generate
    from ulacache_jax.models import LlamaModel, ModelConfig

    mc = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=8, num_kv_heads=2, head_dim=16)
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(1))
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_seqs=2, max_pages_per_seq=16, page_size=8,
                      num_buckets=4, slots_per_bucket=16, host_pages=2 * 8 * 16 * 2, token_budget=128,
                      dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (45, 60)]
    # the budget covers the context, so sparse attention is exact: greedy full-forward decoding is the reference
    # MAX_NEW tokens: one decode program per TP (see MAX_NEW)
    res = {"reference": [_greedy_full_forward(model, p, MAX_NEW) for p in prompts], "tp": {}}
    for tp in tps:
        rep = tp_mod.prepare_model(model, tp)
        res["tp"][tp] = {"tokens": generate(model, prompts, max_new_tokens=MAX_NEW, tp=tp, cache_config=cfg,
                                              attention="sparse"),
                         "kv_heads": rep.config.num_kv_heads}
    return res


# ---- the pytest side -------------------------------------------------------------------------------------------
def _run_subprocesses(parts: list[tuple[str, list[int]]]) -> list[dict]:
    """Run each (mode, TPs) of parts in a fresh process with NUM_DEVICES CPU devices, all at once -> their reports."""
    env = forced_devices(NUM_DEVICES)
    procs = [subprocess.Popen([sys.executable, __file__, mode, ",".join(map(str, tps))], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for mode, tps in parts]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:            # a timeout (or an interrupt) leaves no process behind
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _run_subprocess(mode: str, tps: list[int], share: str | None = None) -> dict:
    """Run the checks in a fresh process with NUM_DEVICES CPU devices. Under pytest-xdist a module fixture runs once
    per worker, so `share` (a path unique to this test run) lets the workers run it once and share the result."""
    if share:
        import fcntl
        with open(share + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(share):
                with open(share) as f:
                    return json.load(f)
            res = _run_subprocess(mode, tps)
            with open(share, "w") as f:
                json.dump(res, f)
            return res
    if mode == "checks":       # the shared checks: CHECK_PARTS side by side, one report
        first, *rest = _run_subprocesses(CHECK_PARTS)
        for part in rest:
            assert part["devices"] == first["devices"], (part["devices"], first["devices"])
            first["tp"].update(part["tp"])
            first.update({k: v for k, v in part.items() if k not in first})
        assert sorted(map(int, first["tp"])) == sorted(tps), (list(first["tp"]), tps)
        return first
    return _run_subprocesses([(mode, tps)])[0]


@pytest.fixture(scope="module")
def checks(request, tmp_path_factory):
    share = None
    if hasattr(request.config, "workerinput"):      # pytest-xdist worker: share one run among the workers
        uid = request.config.workerinput["testrunuid"]
        share = str(tmp_path_factory.getbasetemp().parent / f"tp_checks_{uid}.json")
    return _run_subprocess("checks", CHECK_TPS, share)


def test_subprocess_has_forced_devices(checks):
    assert checks["devices"] == NUM_DEVICES


def test_sharded_cache_manager_equals_single_device(checks):
    assert checks["cache_manager"] == {"init": True, "shard_cache": True, "ingest": True, "sharded": True,
                                       "release": True}


def test_tp1_equals_single_device_generate(checks):
    one = checks["tp"]["1"]
    assert one["tokens"] == checks["reference"]
    np.testing.assert_allclose(one["prefill"], checks["reference_prefill"], rtol=1e-5, atol=1e-5)


# the assertions of one report (forced CPU devices here, real GPUs in test_tp_on_real_gpus)
def _assert_same_as_tp1(checks, tp):
    one, r = checks["tp"]["1"], checks["tp"][str(tp)]
    assert r["tokens"] == one["tokens"] == checks["reference"], tp
    assert r["dense_tokens"] in (None, checks["dense_reference"]), tp
    assert r["slots"] == one["slots"]
    np.testing.assert_allclose(r["prefill"], one["prefill"], rtol=1e-4, atol=1e-4)
    assert r["chunk"] == one["chunk"], tp
    np.testing.assert_allclose(r["next"], one["next"], rtol=1e-4, atol=1e-4)


def _assert_own_groups(checks, tp):
    own = checks["tp"][str(tp)]["owner"]
    assert own["shards_on_own_device"]
    G = 8 // tp
    for r, rank in enumerate(own["ranks"]):
        assert rank["held"] > 0                       # every rank cached pages of its own
        assert rank["own_groups_only"], (r, rank["groups_seen"])
        assert set(rank["groups_seen"]) == set(range(r * G, (r + 1) * G))
        assert rank["vtlb_matches_tags"]


def _assert_two_psums_per_layer(checks, tp, layers=2):
    for fn, c in checks["tp"][str(tp)]["collectives"].items():
        n = 1 if fn == "prefill_layer" else layers      # the prefill program is one layer, run per layer
        assert c["lowered"]["all_reduce"] == 2 * n, (fn, c)
        assert all(v == 0 for k, v in c["lowered"].items() if k != "all_reduce"), (fn, c)
        if c["compiled"] is not None:     # XLA may merge all-reduces, never add a collective
            assert all(v == 0 for k, v in c["compiled"].items() if k != "all_reduce"), (fn, c)
            assert 0 < c["compiled"]["all_reduce"] <= 2 * n, (fn, c)


@pytest.mark.parametrize("tp", CHECK_TPS[1:])
def test_tp_same_tokens_and_logits_as_tp1(checks, tp):
    _assert_same_as_tp1(checks, tp)


def test_key_copy_at_tp2_equals_tp1(checks):
    """The key copy's selection (key_channels = 4) over two ranks gives TP = 1's tokens."""
    assert checks["tp"]["2"]["key_copy_tokens"] == checks["key_copy_reference"]


@pytest.mark.parametrize("tp", CHECK_TPS)
def test_rank_holds_only_its_groups(checks, tp):
    _assert_own_groups(checks, tp)


@pytest.mark.parametrize("tp", CHECK_TPS[1:])
def test_every_rank_hits_and_misses(checks, tp):
    r = checks["tp"][str(tp)]
    assert all(m > 0 for m in r["misses_per_rank"]) and all(h > 0 for h in r["hits_per_rank"])


@pytest.mark.parametrize("tp", CHECK_TPS[1:])
def test_only_two_psums_per_layer_and_no_cache_collective(checks, tp):
    _assert_two_psums_per_layer(checks, tp)


def test_init_model_in_its_sharding(checks):
    r = checks["init_model"]
    assert r["equal"] and r["q_shards"] == [r["q_heads"] // 2]


def test_70b_shape_per_device_bytes_at_tp8():
    """The Llama-3.1-70B shape, abstractly (nothing allocated): what init_model / TP = 8 puts on each device."""
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.models import LlamaModel, get_preset

    mc = get_preset("llama-3.1-70b")
    params = nnx.split(nnx.eval_shape(lambda: LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))[1]
    total, per = tp_mod.shard_bytes(params, 1), tp_mod.shard_bytes(params, 8)
    assert 139e9 < total < 143e9
    # one eighth of the split weights plus the replicated embeddings, LM head and norms: fits an H200 with room
    # for the cache
    assert total / 8 < per < 24e9


@pytest.mark.slow
def test_more_ranks_than_kv_heads_replicates_heads():
    res = _run_subprocess("replicated", [8])      # 2 KV heads, each on 4 ranks
    assert list(res["tp"]) == ["8"]
    for tp, r in res["tp"].items():
        assert r["kv_heads"] == int(tp)
        assert r["tokens"] == res["reference"], tp


@pytest.mark.gpu
def test_tp_on_real_gpus():
    """The TP checks on this machine's GPUs instead of forced CPU devices: compiled kernels, the pinned_host pool
    under shard_map, NCCL all-reduces. TP = 1 and 2 (4, 8 where that many GPUs exist); f32 matmuls at `highest`
    precision so the 1e-4 logit tolerances mean what they mean on CPU (XLA may use TF32 otherwise)."""
    import jax
    n = jax.device_count("gpu") if jax.default_backend() == "gpu" else 0
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, found {n}")
    tps = [t for t in (1, 2, 4, 8) if t <= n]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_DEFAULT_MATMUL_PRECISION="highest")
    env.setdefault("NCCL_NVLS_ENABLE", "0")          # NVLink multicast stays off on shared hosts (device/KINDS.md)
    p = subprocess.run([sys.executable, __file__, "gpu", ",".join(map(str, tps))], env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["devices"] == n and res["platform"] == "gpu"
    assert res["cache_manager"] == {"init": True, "shard_cache": True, "ingest": True, "sharded": True,
                                    "release": True}
    assert res["tp"]["1"]["tokens"] == res["reference"]
    for tp in tps[1:]:
        _assert_same_as_tp1(res, tp)
        _assert_own_groups(res, tp)
        _assert_two_psums_per_layer(res, tp)


# ---- single-process unit checks (no mesh needed) -----------------------------------------------------------------
def test_num_groups_not_divisible_is_a_clear_error():
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.cache.config import CacheConfig

    cfg = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=16, kv_heads_per_group=4, page_size=8,
                      token_budget=32)
    with pytest.raises(ValueError, match=r"num_groups % tp == 0.*num_groups = 2.*tp = 4.*lower kv_heads_per_group"):
        tp_mod.check_tp(cfg, 4)
    with pytest.raises(ValueError, match="num_groups"):
        CacheConfig(num_layers=2, num_kv_heads=8, head_dim=16, kv_heads_per_group=4, page_size=8, token_budget=32,
                    tp=4)


def test_each_rank_gets_its_heads_rows_of_a_label_channel_table():
    """A channel table at TP = 2 (4 KV heads, 2 a rank): each rank's one-rank config holds its own heads' rows, and
    the state `init_sharded` builds a rank from starts every slot on them (online channels need no table)."""
    import numpy as np
    from ulacache_jax.cache import state as cache_state
    from ulacache_jax.cache.config import CacheConfig
    from ulacache_jax.runtime import tp as tp_mod

    table = [[[2 * h, 2 * h + 1, 2 * h + 8, 2 * h + 9] for h in range(4)] for _ in range(2)]     # [L][KV][C]
    cfg = CacheConfig(num_layers=2, num_kv_heads=4, head_dim=16, page_size=8, token_budget=32, max_seqs=2,
                      max_pages_per_seq=8, host_pages=64, key_channels=4, label_bits=4, channel_table=table, tp=2)
    for rank in (0, 1):
        one = tp_mod.local_config(cfg, rank)
        assert one.tp == 1 and one.num_kv_heads == 2
        assert np.asarray(one.channel_table).tolist() == [layer[2 * rank:2 * rank + 2] for layer in table]
        state, _ = cache_state.init(one, check=False)
        chan = np.asarray(state.sel.chan)                                   # [1, S, L, G, g, C]
        want = np.asarray(table)[:, 2 * rank:2 * rank + 2].reshape(2, chan.shape[3], chan.shape[4], 4)
        assert (chan == want[None, None]).all()


def test_prepare_model_checks_and_replicates():
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.models import LlamaModel, ModelConfig

    mc = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=8, num_kv_heads=2, head_dim=8, attention_bias=True)
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert tp_mod.prepare_model(model, 2) is model
    rep = tp_mod.prepare_model(model, 8)
    assert rep.config.num_kv_heads == 8 and rep.layers[0].self_attn.k_proj.shape == (8, 8, 32)
    ids = jnp.arange(12)[None] % 64
    np.testing.assert_allclose(np.asarray(rep(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    assert model.config.num_kv_heads == 2                     # the original is untouched
    with pytest.raises(ValueError, match="must divide num_kv_heads = 4 or be a multiple"):
        tp_mod.prepare_model(LlamaModel(mc.replace(num_heads=12, num_kv_heads=4, intermediate_size=96),
                                        rngs=nnx.Rngs(0)), 3)
    with pytest.raises(ValueError, match="must divide the model's num_heads"):
        tp_mod.prepare_model(model, 16)


def test_param_specs_split_heads_and_mlp_width():
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.models import LlamaModel, get_preset

    params = nnx.split(LlamaModel(get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0)))[1]
    specs = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(tp_mod.param_specs(params))}
    want = {"q_proj": P("tp"), "k_proj": P("tp"), "v_proj": P("tp"), "o_proj": P(None, "tp"),
            "gate_up_proj": P(None, "tp"), "down_proj": P(None, "tp")}
    for path, spec in specs.items():
        name = next((n for n in want if f"'{n}'" in path), None)
        assert spec == (want[name] if name else P()), path


if __name__ == "__main__":
    mode, tps = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    if mode in ("checks", "gpu"):
        out = run_checks(tps)
        out["cache_manager"] = run_cache_manager(4 if mode == "checks" else max(tps))
        out["init_model"] = run_init_model(2)
        import jax
        out["platform"] = jax.default_backend()
    elif mode == "checks-more":    # the TPs of CHECK_PARTS' second part: held to the first part's references
        out = run_checks(tps, reference=False)
    else:
        out = run_replicated(tps)
    print(json.dumps(out))
