"""Study (issue 48): can the pages a sparse step does NOT read still contribute, coarsely, and close the gap to
dense at a fixed budget? The selection study (selection_ceiling.py) found the labels at the exact-mass ceiling of
page selection: picking better pages cannot buy more. This asks whether adding each unselected page as one
pseudo-token (its attention mass, its mean value) can.

A teacher-forced full forward over each window in float32, exact for positions < prefix; for the scored queries
(positions prefix .. T-1) every layer's attention is replaced by a rule below. Page selection is the exact-mass
oracle (each KV head's pages ranked by the softmax mass its query heads give them, summed; K = budget / page full
pages before the query's own page, whose tokens up to the query are always attended):
- `topk`: the selected pages and the query's own page only (what sparse decode computes).
- `topk_meanq`: `topk` with the pages ranked by the mass of the group's mean query (one row per KV head instead of
  one per query head: a scorer reading each key once for the group would do a quarter of the products at the 8B
  shape's 4 query heads a KV head).
- `topk_vnorm`: `topk` with the pages ranked by their value-weighted mass, sum over rows and tokens of a_t |v_t|
  (a_t the row's exact softmax weight): a page of high mass whose values are near zero (sink-like tokens) adds
  little to the output, so value-aware ranking may spend the budget better; a scorer would need one scalar a
  token (log |v_t|, added to its logits before the page's log-sum-exp).
- `topk_pvnorm`: `topk` with each page's mass times the mean |v_t| of its tokens: the value-aware ranking a
  scorer gets from one scalar a page and KV head (kept at flush like Quest's summaries), its kernel unchanged.
- `topk_out`: `topk` with the pages ranked by the norm of their contribution to the output, sum over rows of
  |sum_t a_t v_t|: the oracle of any ranking that knows the values.
- `res_exact`: + every unselected full page p as one term exp(L_p) * vbar_p in the softmax's numerator and
  exp(L_p) in its denominator, L_p the page's exact log-sum-exp of the logits, vbar_p its mean value: the ceiling
  of any such correction (only the within-page weights are lost).
- `res_mean`: the same with L_p ~ log(page) + q . kbar_p (the page's mean key: one extra key and value a page).
- `res_labels`: L_p from the labels (C of D channels, rotary pairs by key energy, 4-bit codes with a scale per
  page and channel, the logits' per-page log-sum-exp as the selection kernel computes it) plus q_rest . kbar_rest,p
  (the page's mean key over the other D - C channels): the estimate a label-scoring step has almost for free.
Reports ppl (next tokens), top-1 agreement and KL(dense || rule) against the dense forward over the scored
positions prefix .. T-2, as bench_quality's ppl task does.

    PYTHONPATH=. python -m scripts.studies.residual_mass --text austen --window 8192 --prefix 7680 --windows 2 \\
        --page 16 --budgets 256,512 --out DIR
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import jax
import jax.numpy as jnp

from scripts.bench_meta import Results, add_common_args, run_meta

TOPK_RULES = ("topk", "topk_meanq", "topk_vnorm", "topk_pvnorm", "topk_out")    # selected pages only, no residual
RULES = TOPK_RULES + ("res_exact", "res_mean", "res_labels")


def attend(q, k, v, qpos, page: int, budget: int, rule: str, channels: int = 32):
    """q [N, H, D] the scored queries at positions qpos [N]; k, v [T, KV, D] the window's keys and values (post-
    RoPE) -> [N, H, D] float32 by `rule` (module docstring)."""
    N, H, D = q.shape
    T, KV, _ = k.shape
    G = H // KV
    n = T // page
    qg = q.reshape(N, KV, G, D).astype(jnp.float32)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    s = jnp.einsum("NKGD,TKD->NKGT", qg, kf) / jnp.sqrt(jnp.float32(D))              # [N, KV, G, T]
    tpos = jnp.arange(T)
    qp = qpos // page                                                                  # [N] the query's page
    own = ((tpos[None] // page) == qp[:, None]) & (tpos[None] <= qpos[:, None])         # [N, T]
    full = jnp.arange(n)[None] < qp[:, None]                                           # [N, n] candidate pages
    L = jax.nn.logsumexp(s[..., : n * page].reshape(N, KV, G, n, page), axis=-1)       # [N, KV, G, n] exact
    # the selection's rows: each query head's (summed), or for topk_meanq the group's mean query as one row
    Ls = L if rule != "topk_meanq" else jax.nn.logsumexp(
        jnp.einsum("NKD,TKD->NKT", qg.mean(axis=2), kf)[..., : n * page].reshape(N, KV, 1, n, page)
        / jnp.sqrt(jnp.float32(D)), axis=-1)                                           # [N, KV, 1, n]
    Lm = jnp.where(full[:, None, None], Ls, -jnp.inf)
    mass = jnp.exp(Lm - jax.nn.logsumexp(Lm, axis=-1, keepdims=True)).sum(axis=2)     # [N, KV, n]
    vp = vf[: n * page].reshape(n, page, KV, D)                                        # the candidate pages' values
    if rule == "topk_pvnorm":
        mass = mass * jnp.linalg.norm(vp, axis=-1).mean(axis=1).T[None]
    if rule in ("topk_vnorm", "topk_out"):
        # the rows' softmax over the candidate pages' tokens (the same normaliser as `mass`), then per page either
        # sum_t a_t |v_t| or |sum_t a_t v_t|, summed over the rows
        sp = s[..., : n * page].reshape(N, KV, G, n, page)
        a = jnp.exp(sp - jax.nn.logsumexp(Lm, axis=-1)[..., None, None])                # [N, KV, G, n, page]
        a = jnp.where(full[:, None, None, :, None], a, 0.0)
        if rule == "topk_vnorm":
            mass = jnp.einsum("NKGnt,ntK->NKn", a, jnp.linalg.norm(vp, axis=-1))
        else:
            mass = jnp.linalg.norm(jnp.einsum("NKGnt,ntKD->NKGnD", a, vp), axis=-1).sum(axis=2)
    K = budget // page
    top = jax.lax.top_k(jnp.where(full[:, None], mass, -1.0), K)[1]                    # [N, KV, K]
    sel = jnp.zeros((N, KV, n), bool).at[jnp.arange(N)[:, None, None], jnp.arange(KV)[None, :, None], top].set(True)
    sel &= full[:, None]
    tok_sel = jnp.repeat(sel, page, axis=-1)                                           # [N, KV, T]
    tok = tok_sel[:, :, None] | own[:, None, None]                                     # [N, KV, 1, T]
    logits = jnp.where(tok, s, -jnp.inf)                                               # [N, KV, G, T]
    if rule in TOPK_RULES:
        p = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("NKGT,TKD->NKGD", p, vf).reshape(N, H, D)
    vbar = vp.mean(axis=1)                                                             # [n, KV, D]
    if rule == "res_exact":
        Lp = L
    elif rule == "res_mean":
        kbar = kf[: n * page].reshape(n, page, KV, D).mean(axis=1)                     # [n, KV, D]
        Lp = jnp.log(jnp.float32(page)) + jnp.einsum("NKGD,nKD->NKGn", qg, kbar) / jnp.sqrt(jnp.float32(D))
    elif rule == "res_labels":
        Lp = labels_lse(qg, kf, page, channels)
    else:
        raise ValueError(f"rule = {rule!r} must be one of {RULES}")
    unsel = full[:, None, None] & ~sel[:, :, None]                                      # [N, KV, 1, n]
    Lu = jnp.where(unsel, Lp, -jnp.inf)                                                # [N, KV, G, n]
    m = jnp.maximum(jnp.max(logits, axis=-1), jnp.max(Lu, axis=-1))                   # [N, KV, G]
    et = jnp.exp(logits - m[..., None])
    ep = jnp.exp(Lu - m[..., None])
    num = jnp.einsum("NKGT,TKD->NKGD", et, vf) + jnp.einsum("NKGn,nKD->NKGD", ep, vbar)
    den = et.sum(-1) + ep.sum(-1)
    return (num / den[..., None]).reshape(N, H, D)


def labels_lse(qg, kf, page: int, channels: int, bits: int = 4):
    """qg [N, KV, G, D], kf [T, KV, D] -> [N, KV, G, n]: each page's log-sum-exp of the label logits (the
    C channels of the largest key energy as rotary pairs, 4-bit codes with a scale per page and channel) plus the
    remaining channels' term q_rest . kbar_rest (the page's mean key there)."""
    from ulacache_jax.cache.select.labels import pick_pairs, quantize, dequantize
    N, KV, G, D = qg.shape
    T = kf.shape[0]
    n = T // page
    chan = pick_pairs(kf[None], jnp.ones((1, T), bool), channels)[0]                  # [KV, C]
    kc = jnp.take_along_axis(kf, jnp.broadcast_to(chan[None], (T, KV, channels)), axis=-1)   # [T, KV, C]
    codes, scale = quantize(kc[: n * page].reshape(n, page, KV, channels), bits)
    kd = dequantize(codes, scale, bits).reshape(n * page, KV, channels)               # [nT, KV, C]
    qc = jnp.take_along_axis(qg, jnp.broadcast_to(chan[None, :, None], (N, KV, G, channels)), axis=-1)
    lab = jnp.einsum("NKGC,TKC->NKGT", qc, kd) / jnp.sqrt(jnp.float32(D))
    L = jax.nn.logsumexp(lab.reshape(N, KV, G, n, page), axis=-1)                      # [N, KV, G, n]
    rest = jnp.ones((KV, D), bool).at[jnp.arange(KV)[:, None], chan].set(False)       # [KV, D]
    kbar = kf[: n * page].reshape(n, page, KV, D).mean(axis=1)                         # [n, KV, D]
    corr = jnp.einsum("NKGD,nKD->NKGn", jnp.where(rest[None, :, None], qg, 0.0), kbar) / jnp.sqrt(jnp.float32(D))
    return L + corr


def forward(model, ids, prefix: int, rule: str | None, page: int, budget: int, channels: int):
    """The window's logits [T - 1 - prefix, V] at positions prefix .. T-2: dense (rule None) or with the scored
    queries' attention by `rule`."""
    from ulacache_jax.models.attention import blocked_attention
    T = ids.shape[0]
    pos = jnp.arange(T, dtype=jnp.int32)[None]

    def attn_fn(cache, q, k, v, meta, layer_idx):
        pre = blocked_attention(q[:, :prefix], k[:, :prefix], v[:, :prefix], pos[:, :prefix], pos[:, :prefix])
        if rule is None:
            last = blocked_attention(q[:, prefix:], k, v, pos[:, prefix:], pos)
        else:
            last = attend(q[0, prefix:], k[0], v[0], pos[0, prefix:], page, budget, rule, channels)[None]
        return cache, jnp.concatenate([pre, last.astype(pre.dtype)], axis=1)

    _, h = model.run_layers(None, model.embed(ids[None]), pos, pos, attn_fn)
    return model.logits(h[:, prefix:T - 1])[0]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, out_required=True, files="residual_mass.json", model=None,
                    model_default_help="SmolLM2-135M-Instruct (bench_quality's default)", dtype="float32")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model and byte tokenizer (tests)")
    ap.add_argument("--text", default="austen", help="bench_quality's --text")
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=7680, help="positions prefix .. window-2 are scored")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--budgets", default="256,512", help="tokens, comma-separated")
    ap.add_argument("--channels", type=int, default=32, help="res_labels' label channels")
    ap.add_argument("--rules", default=",".join(RULES))
    return ap


def summary(acc: dict) -> list[dict]:
    """The scored positions so far -> one row per rule: ppl (and its ratio to dense's), top-1 agreement, KL."""
    cat = np.concatenate
    dense_ppl = float(np.exp(-cat(acc["dense"]).mean()))
    rows = [dict(rule="dense", ppl=dense_ppl, positions=int(cat(acc["dense"]).size))]
    for key, a in acc.items():
        if key != "dense":
            ppl = float(np.exp(-cat(a["lp"]).mean()))
            rows.append(dict(rule=key, ppl=ppl, ppl_vs_dense=ppl / dense_ppl - 1, top1=float(cat(a["agree"]).mean()),
                             kl=float(cat(a["kl"]).mean()), positions=int(cat(a["lp"]).size)))
    return rows


def main(argv=None):
    args = build_parser().parse_args(argv)
    from scripts.bench_quality import corpus_text, load_model
    model, tok, label = load_model(args)
    text, source = corpus_text(args.text)
    text_ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    span = len(text_ids) - args.window
    offs = [int(i * span / max(1, args.windows - 1)) for i in range(args.windows)]
    wins = [jnp.asarray(text_ids[o:o + args.window], jnp.int32) for o in offs]
    budgets = [int(b) for b in args.budgets.split(",")]
    rules = args.rules.split(",")
    fwd = jax.jit(forward, static_argnums=(2, 3, 4, 5, 6))
    res = Results(os.path.join(args.out, "residual_mass.json"),
                  run_meta(args.commit, **{**{k: v for k, v in vars(args).items() if k != "commit"},
                                           "model": label, "text": source}))
    acc: dict = {}
    for wi, ids in enumerate(wins):
        t0 = time.time()
        ref_lp = jax.nn.log_softmax(fwd(model, ids, args.prefix, None, args.page, 0, args.channels))    # [N, V]
        nxt = ids[args.prefix + 1:]
        acc.setdefault("dense", []).append(np.asarray(jnp.take_along_axis(ref_lp, nxt[:, None], 1)[:, 0]))
        print(f"window {wi}: dense {time.time() - t0:.0f} s", flush=True)
        for b in budgets:
            for r in rules:
                t0 = time.time()
                lg = jax.nn.log_softmax(fwd(model, ids, args.prefix, r, args.page, b, args.channels))
                a = acc.setdefault(f"{r} b{b}", dict(lp=[], agree=[], kl=[]))
                a["lp"].append(np.asarray(jnp.take_along_axis(lg, nxt[:, None], 1)[:, 0]))
                a["agree"].append(np.asarray(jnp.argmax(lg, -1) == jnp.argmax(ref_lp, -1)))
                a["kl"].append(np.asarray(jnp.sum(jnp.exp(ref_lp) * (ref_lp - lg), -1)))
                res.rows = summary(acc)          # every cell so far, rewritten after each: a cut run keeps them
                res.save()
                print(f"window {wi}: {r} b{b} {time.time() - t0:.0f} s", flush=True)
    print(f"{'rule':18s} {'ppl':>8s} {'vs dense':>9s} {'top1':>7s} {'kl':>8s}")
    for r in res.rows:
        print(f"{r['rule']:18s} {r['ppl']:8.3f} {100 * r.get('ppl_vs_dense', 0):+8.2f}% "
              f"{100 * r.get('top1', 1):6.1f}% {r.get('kl', 0):8.4f}")
    return res.rows


if __name__ == "__main__":
    main()
