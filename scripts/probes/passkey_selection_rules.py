"""Which page-selection rule keeps a passkey? A probe of issue 19 (docs/BENCHMARKS.md, "What limits sparse passkey").

SmolLM2 (float32), passkey prompts as scripts/bench_quality.py builds them. For each prompt: a dense prefill stores
every layer's K/V, dense greedy decoding (one jitted step over the stored K/V) gives the answer. Then, for each rule
and budget, every answer step up to the key's last digit is re-run with its query attending only the pages the rule
selects in every layer (sink page, 2 recent pages and the unflushed tail forced, as the library), the history's K/V
from the dense run; a prompt counts when every step's token equals dense's. All (rule, budget) pairs run as the
lanes of one batched step (one compile). Two continuous measures beside it: attention recall (the dense weight of
each lane's own query that its selection keeps, mean over heads, layers and steps) and needle recall (of the dense
weight on the needle's tokens at the key's digit steps, summed over heads and layers, the share the selection
keeps; it weighs the heads that retrieve). Rules: quest_sum (the library: the Quest
bound summed over the group's query heads), quest_maxnorm / quest_sumnorm (each head's bounds softmax-normalised over
pages, then max / sum over heads), oracle (the true attention weight per page, summed over the group's heads),
twostage (Quest picks 4x the budget's pages, the oracle keeps the budget among them); a "_d2" suffix keeps layers
0-1 dense.
Cheaper page representatives (summary vectors per page and kv head, Quest keeps 2: per-channel min and max), with
s_t = q.k_t / sqrt(D) the logit of a page token t for one query head:
  centroid              sum over the group's heads of q.mean(k) (1 vector: the mean key);
  centroid_max          max over the group's heads of q.mean(k) (1 vector);
  softmax_est           each head's page mass estimated as exp(q.mean(k)/sqrt(D)) * page (Jensen's lower bound of
                        sum_t exp(s_t)), normalised over the pages, summed over the heads as the oracle sums
                        (1 vector; summed log-estimates would rank as centroid, so the mass is aggregated instead);
  quest_centroid        z-score of quest_sum plus z-score of centroid, each standardised over the valid pages of
                        that kv head for this query (scale-free sum of an upper bound and a mean; 3 vectors);
  quest_p8              quest_sum on 8-token half pages, a page scores the max of its halves (4 vectors);
  centroid_plus_spread  sum over the group's heads of the second-order (cumulant) estimate of a page's log mean
                        exp logit: mean_t s_t + var_t(s_t) / 2, with var_t(s_t) ~ sum_d q_d^2 var_t(k_d) / D
                        (diagonal covariance), i.e. q.mean(k)/sqrt(D) + 0.5 ||q * std(k)||^2 / D (2 vectors: mean
                        and per-channel variance of the keys);
  spread_mass           the same estimate exponentiated, normalised over pages and summed over heads as softmax_est
                        (2 vectors).
The spread rules weigh pages whose keys vary along the query's strong channels, where one token (the needle's) may
stand out of a page whose mean is unremarkable; the mean alone averages it away.
A compressed copy of every key (a tier that would stay resident in HBM, as ShadowKV / InfiniGen keep), scored per
token and aggregated as the oracle aggregates (each head's softmax over the history's approximate logits, summed
over the page's tokens and the group's heads):
  lowrank<R>            keys projected on the top R eigenvectors of the history keys' second moment (per layer and
                        kv head, from the flushed pages: the basis a prefill would compute once), the query on the
                        same basis (R/D of K per token; page 16: R = 8 stores as many bytes as Quest's 2 vectors);
  topchan<R>            the R channels of largest key energy (sum of k_d^2 over the history) of each layer and kv
                        head, the query's same channels (the same bytes as lowrank<R>, no projection of the keys).
    python scripts/probes/passkey_selection_rules.py CONTEXT DEPTHS KEYS BUDGETS [RULES]
    e.g. 4096 10,25,50 3 512,1024 quest_sum,quest_maxnorm,oracle
"""
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

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
T = ctx + 16                              # fixed history length (padded): one compile for all (rule, budget) lanes
BASE = sorted({ru.removesuffix("_d2") for ru in RULES})

def select_score(rule, qh, Kp, valid):
    """qh [KV, r, D]; Kp [NP, page, KV, D]; valid [NP] -> page scores [KV, NP] of a rule (higher = keep)."""
    if rule == "oracle":
        s = jnp.einsum("ghd,ptgd->ghpt", qh, Kp) / np.sqrt(D)
        s = jnp.where(valid[None, None, :, None], s, -jnp.inf)
        m = jax.nn.softmax(s.reshape(KV, r, -1), -1).reshape(KV, r, Kp.shape[0], page)
        return m.sum(axis=(1, 3))
    if rule.startswith(("lowrank", "topchan")):
        R = int(rule.removeprefix("lowrank").removeprefix("topchan"))
        kv = jnp.where(valid[:, None, None, None], Kp, 0.0).reshape(-1, KV, D)          # [NP * page, KV, D]
        if rule.startswith("lowrank"):
            _, vecs = jnp.linalg.eigh(jnp.einsum("tgd,tge->gde", kv, kv))               # ascending eigenvalues
            U = vecs[..., -R:]                                                           # [KV, D, R]
        else:
            top = jnp.argsort(-(kv ** 2).sum(0), -1)[:, :R]                              # [KV, R]
            U = jax.nn.one_hot(top, D, axis=1)                                           # [KV, D, R]
        s = jnp.einsum("ghr,ptgr->ghpt", jnp.einsum("ghd,gdr->ghr", qh, U),
                       jnp.einsum("ptgd,gdr->ptgr", Kp, U)) / np.sqrt(D)
        s = jnp.where(valid[None, None, :, None], s, -jnp.inf)
        m = jax.nn.softmax(s.reshape(KV, r, -1), -1).reshape(KV, r, Kp.shape[0], page)
        return m.sum(axis=(1, 3))
    vmask = valid[None, None]                                      # [1, 1, NP]

    def quest(kp):                                                 # kp [NP, n, KV, D] -> bound [KV, r, NP]
        kmax = jnp.where(valid[:, None, None], kp.max(1), 0.0)     # [NP, KV, D]
        kmin = jnp.where(valid[:, None, None], kp.min(1), 0.0)
        return (jnp.einsum("ghd,pgd->ghp", jnp.maximum(qh, 0), kmax)
                + jnp.einsum("ghd,pgd->ghp", jnp.minimum(qh, 0), kmin))

    def zscore(x):                                                 # x [KV, NP] standardised over the valid pages
        nv = jnp.maximum(valid.sum(), 1)
        mu = jnp.where(valid[None], x, 0.0).sum(-1, keepdims=True) / nv
        sd = jnp.sqrt(jnp.where(valid[None], (x - mu) ** 2, 0.0).sum(-1, keepdims=True) / nv)
        return (x - mu) / jnp.maximum(sd, 1e-6)

    def mass(logit):                                               # logit [KV, r, NP] -> per-head softmax, summed
        return jax.nn.softmax(jnp.where(vmask, logit, -jnp.inf), -1).sum(1)

    kmean = Kp.mean(1)                                             # [NP, KV, D]
    cen = jnp.einsum("ghd,pgd->ghp", qh, kmean)                    # [KV, r, NP]
    if rule == "centroid":
        return cen.sum(1)
    if rule == "centroid_max":
        return cen.max(1)
    if rule == "softmax_est":
        return mass(cen / np.sqrt(D))
    if rule in ("centroid_plus_spread", "spread_mass"):
        spread = jnp.einsum("ghd,pgd->ghp", qh ** 2, Kp.var(1)) / D
        est = cen / np.sqrt(D) + 0.5 * spread
        return est.sum(1) if rule == "centroid_plus_spread" else mass(est)
    if rule == "quest_p8":
        NP = Kp.shape[0]
        kh = Kp.reshape(NP, 2, page // 2, KV, D)
        hmax = kh.max(2); hmin = kh.min(2)                         # [NP, 2, KV, D]
        u8 = (jnp.einsum("ghd,pigd->ghpi", jnp.maximum(qh, 0), hmax)
              + jnp.einsum("ghd,pigd->ghpi", jnp.minimum(qh, 0), hmin))   # [KV, r, NP, 2]
        return u8.sum(1).max(-1)
    u = quest(Kp)
    if rule == "quest_sum":
        return u.sum(1)
    if rule == "quest_centroid":
        return zscore(u.sum(1)) + zscore(cen.sum(1))
    if rule not in ("quest_maxnorm", "quest_sumnorm"):
        raise ValueError(f"unknown rule {rule!r}")
    z = jax.nn.softmax(jnp.where(vmask, u / np.sqrt(D), -jnp.inf), -1)
    return z.max(1) if rule == "quest_maxnorm" else z.sum(1)


def select_mask(q, K, n_hist, rid, kpages):
    """q [H, D]; K [T, KV, D] (history valid below n_hist); rid: index into BASE; kpages: the budget in pages
    -> mask [KV, T] over the history (positions < n_hist). All rules are scored, the lane's is taken (vmapped)."""
    flushed = n_hist // page
    NP = T // page
    Kp = K[:NP * page].reshape(NP, page, KV, D)
    pidx = jnp.arange(NP)
    valid = pidx < flushed
    qh = q.reshape(KV, r, D)
    rank = lambda x: jnp.argsort(jnp.argsort(-x, -1), -1)           # [KV, NP] 0 = best
    scores = []
    for ru in BASE:
        if ru == "twostage":
            # Quest picks 4x the budget's pages, the exact attention weight over those pages' keys keeps the budget
            quest = jnp.where(valid[None], select_score("quest_sum", qh, Kp, valid), -jnp.inf)
            scores.append(jnp.where(rank(quest) < 4 * kpages, select_score("oracle", qh, Kp, valid), -jnp.inf))
        else:
            scores.append(select_score(ru, qh, Kp, valid))
    score = jnp.stack(scores)[rid]                                   # [KV, NP]
    forced = (pidx == 0) | ((pidx >= flushed - 2) & (pidx < flushed))
    score = jnp.where(forced[None], jnp.inf, jnp.where(valid[None], score, -jnp.inf))
    selp = (rank(score) < kpages) & valid[None]                      # [KV, NP]
    tokp = jnp.arange(T) // page
    mask = jnp.take_along_axis(selp, jnp.minimum(tokp, NP - 1)[None].repeat(KV, 0), 1) & (tokp < flushed)[None]
    hist = jnp.arange(T) < n_hist
    mask = (mask | (jnp.arange(T) >= flushed * page)[None]) & hist[None]
    return jnp.where(flushed <= kpages, hist[None].repeat(KV, 0), mask)

@jax.jit
def step(params, tok_in, Ks, Vs, n_hist):
    """Dense: Ks, Vs [L, T, KV, D] history; the token at position n_hist -> logits [V], its k, v [L, KV, D]."""
    m = nnx.merge(graphdef, params)
    x = m.embed(tok_in[None, None])
    pos = n_hist[None, None]
    kvs = []
    for l, layer in enumerate(m.layers):
        q, k, v = layer.qkv(x, pos)
        K = Ks[l].at[n_hist].set(k[0, 0]); V = Vs[l].at[n_hist].set(v[0, 0])
        Kh = jnp.repeat(K, r, axis=1); Vh = jnp.repeat(V, r, axis=1)
        s = jnp.einsum("hd,nhd->hn", q[0, 0], Kh) / np.sqrt(D)
        s = jnp.where((jnp.arange(T) <= n_hist)[None], s, -jnp.inf)
        a = jnp.einsum("hn,nhd->hd", jax.nn.softmax(s, -1), Vh)
        x = layer.finish(x, a[None, None])
        kvs.append((k[0, 0], v[0, 0]))
    return m.logits(x)[0, 0], jnp.stack([a for a, _ in kvs]), jnp.stack([b for _, b in kvs])

@jax.jit
def lanes_step(params, tok_in, Ks, Vs, n_hist, rids, kpages, d2, needle):
    """One (rule, budget) pair a batch lane: rids, kpages, d2 [B] (d2: layers 0-1 dense); the token at position
    n_hist -> logits [B, V], recall [B]: the dense attention weight (of the lane's own query, over the history and
    itself) that falls on the selected positions, averaged over heads and layers; kept, total [B]: the dense weight
    on the needle's positions (needle [T] bool) kept by the selection and in all, summed over heads and layers. The
    history Ks, Vs [L, T, KV, D]
    is the dense run's; each lane's own k/v join apart."""
    m = nnx.merge(graphdef, params)
    B = rids.shape[0]
    x = m.embed(jnp.full((B, 1), tok_in))
    pos = jnp.full((B, 1), n_hist)
    hist = jnp.arange(T) < n_hist
    recall = jnp.zeros(B); kept = jnp.zeros(B); total = jnp.zeros(B)
    for l, layer in enumerate(m.layers):
        q, k, v = layer.qkv(x, pos)                                   # q [B, 1, H, D], k/v [B, 1, KV, D]
        mask = jax.vmap(select_mask, (0, None, None, 0, 0))(q[:, 0], Ks[l], n_hist, rids, kpages)  # [B, KV, T]
        if l < 2:
            mask = jnp.where(d2[:, None, None], hist[None, None], mask)
        Kh = jnp.repeat(Ks[l], r, axis=1); Vh = jnp.repeat(Vs[l], r, axis=1)      # [T, H, D]
        s = jnp.einsum("bhd,nhd->bhn", q[:, 0], Kh) / np.sqrt(D)
        s_self = jnp.einsum("bhd,bhd->bh", q[:, 0], jnp.repeat(k[:, 0], r, axis=1)) / np.sqrt(D)
        wd = jax.nn.softmax(jnp.concatenate([jnp.where(hist[None, None], s, -jnp.inf), s_self[..., None]], -1), -1)
        mh = jnp.repeat(mask, r, axis=1)                                            # [B, H, T]
        recall += (jnp.where(mh, wd[..., :T], 0.0).sum(-1) + wd[..., T]).mean(-1) / L
        kept += jnp.where(mh & needle, wd[..., :T], 0.0).sum((-1, -2))
        total += jnp.where(needle[None, None], wd[..., :T], 0.0).sum((-1, -2))
        s = jnp.where(mh, s, -jnp.inf)
        w = jax.nn.softmax(jnp.concatenate([s, s_self[..., None]], -1), -1)
        a = jnp.einsum("bhn,nhd->bhd", w[..., :T], Vh) + w[..., T:] * jnp.repeat(v[:, 0], r, axis=1)
        x = layer.finish(x, a[:, None])
    return m.logits(x)[:, 0], recall, kept, total

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

def needle_span(ids, key):
    """-> slice of the needle's tokens in ids: from the token that starts "The pass key is KEY" to the one ending
    "KEY is the pass key" (binary searches over decoded prefixes / suffixes)."""
    end = _bisect(lambda i: f"{key} is the pass key" in tok.decode(ids[:i]), 1, len(ids))
    start = _bisect(lambda j: f"The pass key is {key}" not in tok.decode(ids[j:end]), 0, end) - 1
    return slice(start, end)


def _bisect(ok, lo, hi):
    """Smallest i in [lo, hi] with ok(i), ok monotone (False then True)."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo

LANES = [(ru, b) for ru in RULES for b in budgets]
RIDS = jnp.asarray([BASE.index(ru.removesuffix("_d2")) for ru, _ in LANES])
KPAGES = jnp.asarray([b // page for _, b in LANES]); D2 = jnp.asarray([ru.endswith("_d2") for ru, _ in LANES])
res = {f"{ru} b{b}": 0 for ru, b in LANES}; ndense = 0; t0 = time.time(); rec_all, rec_key, rec_needle = [], [], []
for pi, p in enumerate(P):
    ids = p["ids"]; n = len(ids)
    # dense answer: greedy, by full prefills of prompt + answer so far (K/V of the answer tokens exact)
    lg, Ks, Vs = prefill(params, jnp.asarray(ids + [0] * (T - n)))
    ans = [int(jnp.argmax(lg[n - 1]))]
    while len(ans) < 12 and ans[-1] not in eos and str(p["key"]) not in tok.decode(ans):
        pos = n + len(ans) - 1
        lg1, k1, v1 = step(params, jnp.asarray(ans[-1]), Ks, Vs, jnp.asarray(pos))
        Ks = Ks.at[:, pos].set(k1); Vs = Vs.at[:, pos].set(v1)
        ans.append(int(jnp.argmax(lg1)))
    text = tok.decode(ans); key = str(p["key"])
    if key not in text:
        print(f"prompt {pi} depth {p['depth']}: dense misses ({text!r})", flush=True); continue
    ndense += 1
    last = len(ans)
    alive = np.ones(len(LANES), bool)
    needle = np.zeros(T, bool); needle[needle_span(ids, key)] = True
    nkept = np.zeros(len(LANES)); ntotal = np.zeros(len(LANES))
    for s in range(1, last):          # ans[0] from the dense prefill; step s feeds ans[s-1] at position n+s-1
        lg, rc, kp, tt = lanes_step(params, jnp.asarray(ans[s - 1]), Ks, Vs, jnp.asarray(n + s - 1), RIDS, KPAGES,
                                    D2, jnp.asarray(needle))
        alive &= np.asarray(jnp.argmax(lg, -1)) == ans[s]
        rec_all.append(np.asarray(rc))
        if tok.decode([ans[s]]).strip().isdigit():                 # a step whose token is part of the key
            rec_key.append(np.asarray(rc)); nkept += np.asarray(kp); ntotal += np.asarray(tt)
    rec_needle.append(nkept / ntotal)
    got = {f"{ru} b{b}": int(ok) for (ru, b), ok in zip(LANES, alive)}
    for k_, v_ in got.items():
        res[k_] += v_
    print(f"prompt {pi} depth {p['depth']} n {n} ans {text!r}: {got} ({time.time() - t0:.0f} s)", flush=True)
    print("  needle recall", json.dumps({f"{ru} b{b}": round(float(x), 3) for (ru, b), x in zip(LANES, rec_needle[-1])}),
          flush=True)
print("dense found", ndense, "of", len(P)); print(json.dumps(res))
print("attention recall (dense weight on the selected positions, mean over heads, layers, steps; all steps / key "
      "steps):")
for i, (ru, b) in enumerate(LANES):
    print(f"  {ru} b{b}: {np.mean([x[i] for x in rec_all]):.3f} / {np.mean([x[i] for x in rec_key]):.3f}")
print("needle recall (the dense weight on the needle's tokens that the selection keeps, summed over heads, layers and "
      "key steps, a ratio per prompt; mean, min over prompts):")
for i, (ru, b) in enumerate(LANES):
    print(f"  {ru} b{b}: {np.mean([x[i] for x in rec_needle]):.3f}, {np.min([x[i] for x in rec_needle]):.3f}")
