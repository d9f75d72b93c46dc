"""Which page-selection rule keeps a passkey? A probe of issue 19 (docs/BENCHMARKS.md, "What limits sparse passkey").

SmolLM2 (float32), passkey prompts as scripts/bench_quality.py builds them. For each prompt: a dense prefill stores
every layer's K/V, dense greedy decoding (one jitted step over the stored K/V) gives the answer. Then, for each rule
and budget, every answer step up to the key's last digit is re-run with its query attending only the pages the rule
selects in every layer (sink page, 2 recent pages and the unflushed tail forced, as the library), the history's K/V
from the dense run; a prompt counts when every step's token equals dense's. Rules: quest_sum (the library: the Quest
bound summed over the group's query heads), quest_maxnorm / quest_sumnorm (each head's bounds softmax-normalised over
pages, then max / sum over heads), oracle (the true attention weight per page, summed over the group's heads),
twostage (Quest picks 4x the budget's pages, the oracle keeps the budget among them); a "_d2" suffix keeps layers
0-1 dense.
    python scripts/probes/passkey_selection_rules.py CONTEXT DEPTHS KEYS BUDGETS [RULES]
    e.g. 4096 10,25,50 3 512,1024 quest_sum,quest_maxnorm,oracle
"""
import functools
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_quality as bq  # noqa: E402
from ulacache_jax.models import from_pretrained, load_tokenizer  # noqa: E402
from ulacache_jax.models.attention import dense_attention  # noqa: E402


def setup():
    model = from_pretrained("smollm2-135m", dtype=jnp.float32)
    tok = load_tokenizer("smollm2-135m")
    text, _ = bq.stdlib_text()
    return model, tok, tok.encode(text, add_special_tokens=False)


def prompts(tok, text_ids, ctx, depths, keys, seed, max_new=12):
    g = bq.Grid(contexts=(ctx,), depths=tuple(depths), keys=keys, budgets=(1024,), pages=(16,), ppl_window=0,
                ppl_prefix=0, ppl_windows=0, trace_budget=0, trace_page=0, trace_steps=0, batch=4, max_new=max_new)
    return bq.passkey_prompts(tok, text_ids, g, seed)

ctx = int(sys.argv[1]); depths = tuple(int(x) for x in sys.argv[2].split(",")); keys = int(sys.argv[3])
budgets = tuple(int(x) for x in sys.argv[4].split(",")); page = 16
RULES = sys.argv[5].split(",") if len(sys.argv) > 5 else ["quest_sum", "quest_maxnorm", "oracle"]
model, tok, text_ids = setup()
P = prompts(tok, text_ids, ctx=ctx, depths=depths, keys=keys, seed=1)
L, H, KV, D = model.config.num_layers, model.config.num_heads, model.config.num_kv_heads, model.config.head_dim
r = H // KV
eos = set(bq.eos_of(model, tok))
graphdef, params = nnx.split(model)
T = ctx + 16                              # fixed history length (padded): one compile per (rule, budget)

def select_score(rule, qh, Kp, valid):
    """qh [KV, r, D]; Kp [NP, page, KV, D]; valid [NP] -> page scores [KV, NP] of a rule (higher = keep)."""
    if rule == "oracle":
        s = jnp.einsum("ghd,ptgd->ghpt", qh, Kp) / np.sqrt(D)
        s = jnp.where(valid[None, None, :, None], s, -jnp.inf)
        m = jax.nn.softmax(s.reshape(KV, r, -1), -1).reshape(KV, r, Kp.shape[0], page)
        return m.sum(axis=(1, 3))
    kmax = jnp.where(valid[:, None, None], Kp.max(1), 0.0)      # [NP, KV, D]
    kmin = jnp.where(valid[:, None, None], Kp.min(1), 0.0)
    u = jnp.einsum("ghd,pgd->ghp", jnp.maximum(qh, 0), kmax) + jnp.einsum("ghd,pgd->ghp", jnp.minimum(qh, 0), kmin)
    if rule == "quest_sum":
        return u.sum(1)
    z = jax.nn.softmax(jnp.where(valid[None, None], u / np.sqrt(D), -jnp.inf), -1)
    return z.max(1) if rule == "quest_maxnorm" else z.sum(1)


def select_mask(rule, q, K, n_hist, budget):
    """q [H, D]; K [T, KV, D] (valid < n_hist + 1) -> mask [KV, T]."""
    n = n_hist + 1
    flushed = n_hist // page
    NP = T // page
    kpages = budget // page
    Kp = K[:NP * page].reshape(NP, page, KV, D)
    pidx = jnp.arange(NP)
    valid = pidx < flushed
    qh = q.reshape(KV, r, D)
    if rule == "twostage":
        # Quest picks 4x the budget's pages, the exact attention weight over those pages' keys keeps the budget
        quest = jnp.where(valid[None], select_score("quest_sum", qh, Kp, valid), -jnp.inf)
        cand = jax.lax.top_k(quest, min(NP, 4 * kpages))[1]
        in_cand = jnp.zeros((KV, NP), bool).at[jnp.arange(KV)[:, None], cand].set(True)
        score = jnp.where(in_cand, select_score("oracle", qh, Kp, valid), -jnp.inf)
    else:
        score = select_score(rule, qh, Kp, valid)
    forced = (pidx == 0) | ((pidx >= flushed - 2) & (pidx < flushed))
    score = jnp.where(forced[None], jnp.inf, jnp.where(valid[None], score, -jnp.inf))
    _, top = jax.lax.top_k(score, kpages)                            # [KV, kpages]
    selp = jnp.zeros((KV, NP), bool).at[jnp.arange(KV)[:, None], top].set(True) & valid[None]
    tokp = jnp.arange(T) // page
    mask = jnp.take_along_axis(selp, jnp.minimum(tokp, NP - 1)[None].repeat(KV, 0), 1) & (tokp < flushed)[None]
    mask = mask | ((jnp.arange(T) >= flushed * page) & (jnp.arange(T) < n))[None]
    dense_all = flushed <= kpages
    return jnp.where(dense_all, (jnp.arange(T) < n)[None].repeat(KV, 0), mask)

@functools.partial(jax.jit, static_argnames=("rule", "budget"))
def step(params, tok_in, Ks, Vs, n_hist, rule, budget):
    """Ks, Vs [L, T, KV, D] history (dense run); the token at position n_hist -> logits [V] (its own K/V in place)."""
    m = nnx.merge(graphdef, params)
    x = m.embed(tok_in[None, None])
    pos = n_hist[None, None]
    kvs = []
    for l, layer in enumerate(m.layers):
        q, k, v = layer.qkv(x, pos)
        K = Ks[l].at[n_hist].set(k[0, 0]); V = Vs[l].at[n_hist].set(v[0, 0])
        if rule == "dense" or (rule.endswith("_d2") and l < 2):
            mask = (jnp.arange(T) <= n_hist)[None].repeat(KV, 0)
        else:
            mask = select_mask(rule.removesuffix("_d2"), q[0, 0], K, n_hist, budget)
        Kh = jnp.repeat(K, r, axis=1); Vh = jnp.repeat(V, r, axis=1)
        s = jnp.einsum("hd,nhd->hn", q[0, 0], Kh) / np.sqrt(D)
        s = jnp.where(jnp.repeat(mask, r, axis=0), s, -jnp.inf)
        a = jnp.einsum("hn,nhd->hd", jax.nn.softmax(s, -1), Vh)
        x = layer.finish(x, a[None, None])
        kvs.append((k[0, 0], v[0, 0]))
    return m.logits(x)[0, 0], jnp.stack([a for a, _ in kvs]), jnp.stack([b for _, b in kvs])

@jax.jit
def prefill(params, ids):
    m = nnx.merge(graphdef, params)
    x = m.embed(ids[None]); pos = jnp.arange(ids.shape[0])[None]
    Ks, Vs = [], []
    for layer in m.layers:
        q, k, v = layer.qkv(x, pos)
        x = layer.finish(x, dense_attention(q, k, v, pos, pos))
        Ks.append(k[0]); Vs.append(v[0])
    return m.logits(x)[0], jnp.stack(Ks), jnp.stack(Vs)

res = {f"{ru} b{b}": 0 for ru in RULES for b in budgets}; ndense = 0; t0 = time.time()
for pi, p in enumerate(P):
    ids = p["ids"]; n = len(ids)
    # dense answer: greedy, by full prefills of prompt + answer so far (K/V of the answer tokens exact)
    lg, Ks, Vs = prefill(params, jnp.asarray(ids + [0] * (T - n)))
    ans = [int(jnp.argmax(lg[n - 1]))]
    while len(ans) < 12 and ans[-1] not in eos and str(p["key"]) not in tok.decode(ans):
        pos = n + len(ans) - 1
        lg1, k1, v1 = step(params, jnp.asarray(ans[-1]), Ks, Vs, jnp.asarray(pos), "dense", 0)
        Ks = Ks.at[:, pos].set(k1); Vs = Vs.at[:, pos].set(v1)
        ans.append(int(jnp.argmax(lg1)))
    text = tok.decode(ans); key = str(p["key"])
    if key not in text:
        print(f"prompt {pi} depth {p['depth']}: dense misses ({text!r})", flush=True); continue
    ndense += 1
    last = len(ans)
    got = {}
    for ru in RULES:
        for b in budgets:
            ok = True
            for s in range(1, last):      # ans[0] from the dense prefill; step s feeds ans[s-1] at position n+s-1
                lg, _, _ = step(params, jnp.asarray(ans[s - 1]), Ks, Vs, jnp.asarray(n + s - 1), ru, b)
                if int(jnp.argmax(lg)) != ans[s]:
                    ok = False; break
            res[f"{ru} b{b}"] += ok; got[f"{ru} b{b}"] = int(ok)
    print(f"prompt {pi} depth {p['depth']} n {n} ans {text!r}: {got} ({time.time() - t0:.0f} s)", flush=True)
print("dense found", ndense, "of", len(P)); print(json.dumps(res))
