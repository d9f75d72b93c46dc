"""Do the layers whose attention is broad need to stay dense? Greedy answers under an oracle page selection with
some layers left dense, on a trained model's long-context needle prompts.

    python -m scripts.studies.dense_layers --prompts out/mv8k.json --model qwen2.5-coder-0.5b \
        --page-size 16 32 64 --budget 256 --dense-sets none 0,1,-1 --out docs/studies
    python -m scripts.studies.dense_layers --prompts .prompts/lc32k_mv.json --model qwen2.5-coder-0.5b \
        --dtype bfloat16 --page-size 16 --budget 1024 2048 --dense-sets none --out docs/studies   # on a GPU
    python -m scripts.studies.dense_layers --tiny --out /tmp/d      # tests: random weights, byte prompts

Page selection at 1/32 loses RULER multi-value answers that dense gets right (docs/BENCHMARKS.md, long-context
quality), and the selection-recall study found that no page rule keeps much of layers 0-1 and the last layer's
attention (the oracle itself keeps 75-80% there, 83-98% between): their attention is broad. Systems such as Quest
leave such layers dense. This study asks whether that would bring the answers back before the cache is taught it.
Each prompt (a prompt file of scripts/bench_longctx.py, chat-templated) is prefilled once, densely; then every
configuration decodes greedily from a copy of that cache with its own attention: in a *sparse* layer each KV head
attends the `budget // page_size` flushed pages of largest true attention mass (summed over its query heads: the
oracle, the ceiling of any page rule at the budget; the first `sink` and last `recent` flushed pages always) plus
the unflushed tail page; a *dense* layer attends every key. Page sizes, budgets and dense-layer sets are each an
axis of the configurations, all decoded from the one prefill; a configuration's step is compiled once for every
prompt whose cache rounds up to the same length (`CACHE_UNIT`). Rows: per configuration, the harness's accuracy
(scripts/ruler_tasks.score), the share of answers identical to dense's, and the attended share of K/V bytes a step
(sparse layers at the budget, dense layers whole), which is what the dense layers cost in reads.
Anchors (`--anchors N`, another axis): each sparse layer's KV heads also keep, inside the budget, N pages chosen once
at prefill by the attention of the prompt's last `--anchor-window` queries (the question): can a selection that
remembers what the question pointed at keep answers the per-step oracle, greedy step by step, loses?
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

from scripts import bench_meta


# the cache length is rounded up to a multiple of this (and of every page size), so prompts of nearly one length
# share their configurations' compiled steps; the keys past a prompt are masked, so the rounding changes nothing
CACHE_UNIT = 1024


def parse_set(text: str, num_layers: int) -> tuple[int, ...]:
    """'none' -> (); '0,1,-1' -> (0, 1, L - 1); every index within [-L, L)."""
    if text in ("none", ""):
        return ()
    out = []
    for part in text.split(","):
        i = int(part)
        if not -num_layers <= i < num_layers:
            raise SystemExit(f"--dense-sets {text!r}: layer {i} outside [-{num_layers}, {num_layers})")
        out.append(i % num_layers)
    return tuple(sorted(set(out)))


def _step_mass(s, pos, *, page: int, sink: int, recent: int):
    """What both keep rules start from: s [KV, g, T] logits (masked past pos) -> (p [KV, T] each key's softmax mass
    summed over the KV head's g query heads, flushed [] pages wholly before pos's, pid [T // page] page ids, forced
    [T // page] bool the first `sink` and last `recent` flushed pages)."""
    import jax
    import jax.numpy as jnp
    p = jax.nn.softmax(s, axis=-1).sum(axis=1)                                     # [KV, T]
    flushed = pos // page
    pid = jnp.arange(s.shape[-1] // page)
    forced = (pid < sink) | ((pid >= flushed - recent) & (pid < flushed))
    return p, flushed, pid, forced


def oracle_keep(s, pos, *, page: int, keep: int, sink: int, recent: int, anchor=None):
    """Keys a sparse layer attends, one decode step: s [KV, g, T] float32 logits (keys past pos masked to -inf),
    pos [] int32 the current token's position -> bool [KV, T]. Each KV head keeps the `keep` flushed pages
    (pages wholly before pos's page) of largest true mass (softmax over the visible keys, summed over its g query
    heads), the first `sink` and last `recent` flushed pages always, and the tail page (pos's own). anchor (None or
    bool [KV, npg]): pages also kept always, inside the `keep` (prompt_anchors)."""
    import jax
    import jax.numpy as jnp
    KV, g, T = s.shape
    npg = T // page
    p, flushed, pid, forced = _step_mass(s, pos, page=page, sink=sink, recent=recent)
    mass = p.reshape(KV, npg, page).sum(-1)                                       # [KV, npg]
    if anchor is not None:
        forced = forced | anchor
    score = jnp.where(pid < flushed, jnp.where(forced, jnp.inf, mass), -jnp.inf)  # [KV, npg]
    _, top = jax.lax.top_k(score, min(keep, npg))                                 # [KV, keep]
    chosen = jnp.zeros((KV, npg), bool).at[jnp.arange(KV)[:, None], top].set(True)
    chosen = (chosen & (pid < flushed)) | (pid >= flushed)                        # the tail is always read
    return jnp.repeat(chosen, page, axis=1)                                       # [KV, T]


def prompt_anchors(k, qw, n, *, page: int, count: int, sink: int):
    """The pages each layer's KV heads pin for the whole decode, chosen once from the prompt: k [L, 1, T, KV, D]
    float32 keys, qw [L, W, H, D] float32 queries of the prompt's last W positions (its question), n [] int32 the
    prompt's length -> bool [L, KV, T // page]: per layer and KV head the `count` pages wholly inside the prompt
    (past the `sink` pages, which are kept anyway) of largest attention mass from those queries (softmax per query
    over the keys it sees, summed over the W queries and the KV head's query heads). Why: the oracle is greedy per
    step, and a multi-value answer is lost where the next needle draws little attention at the step that decides
    whether to go on (BENCHMARKS, which step loses it); the question's own attention at prefill finds every needle."""
    import jax
    import jax.numpy as jnp
    L, _, T, KV, D = k.shape
    W, H = qw.shape[1], qw.shape[2]
    npg = T // page
    qpos = jnp.maximum(n - W, 0) + jnp.arange(W)            # [W] (make_prefill's rows; past n for short prompts)
    seen = jnp.arange(T)[None, :] <= qpos[:, None]                                # [W, T]
    q = qw.reshape(L, W, KV, H // KV, D)
    s = jnp.einsum("lwkgd,ltkd->lkgwt", q, k[:, 0]) / np.sqrt(D)                  # [L, KV, g, W, T]
    p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
    p = jnp.where((qpos < n)[:, None], p, 0.0).sum(axis=(2, 3))                   # [L, KV, T]
    mass = p.reshape(L, KV, npg, page).sum(-1)                                    # [L, KV, npg]
    pid = jnp.arange(npg)
    mass = jnp.where((pid >= sink) & (pid < n // page), mass, -jnp.inf)
    _, top = jax.lax.top_k(mass, count)                                           # [L, KV, count]
    pick = jnp.zeros((L, KV, npg), bool)
    pick = pick.at[jnp.arange(L)[:, None, None], jnp.arange(KV)[None, :, None], top].set(True)
    return pick & (pid < n // page)


def label_logits(qg, K, pos, *, channels: int, bits: int, calib: int = 1024, group: int = 16):
    """The labels' estimate of the logits a step (the library's rule, at any selection granularity): qg [KV, g, D]
    float32 queries, K [T, KV, D] float32 keys (positions past pos unread) -> [KV, g, T] float32. Per KV head the
    `channels` of largest key energy over the first `calib` keys seen, as whole rotary pairs (the library's online
    pick, `labels.pick_pairs`), quantised by the library's own `labels.quantize` (symmetric, one scale per `group`
    tokens, the library's page, and channel; bits 0: kept exact) over the keys seen (later positions count as 0,
    so a partly written group's scale is its written tokens')."""
    import jax.numpy as jnp
    from ulacache_jax.cache.select.labels import dequantize, pick_pairs, quantize
    T, KVh, D = K.shape
    seen = jnp.arange(T) <= pos
    chans = pick_pairs(K, jnp.arange(T) < jnp.minimum(calib, pos + 1), channels)      # [KV, C]
    Kc = jnp.take_along_axis(jnp.where(seen[:, None, None], K, 0.0), chans[None], axis=-1)   # [T, KV, C]
    if bits:
        codes, scale = quantize(Kc.reshape(T // group, group, KVh, channels), bits)
        Kc = dequantize(codes, scale, bits).reshape(T, KVh, channels)
    qc = jnp.take_along_axis(qg, chans[:, None, :], axis=-1)                           # [KV, g, C]
    return jnp.einsum("kgc,tkc->kgt", qc, Kc) / np.sqrt(D)


def text_study_inputs(a):
    """The model and text of a perplexity-window study (oracle_ppl, token_pages) from its options (a.tiny, a.model,
    a.dtype, a.text) -> (model, tokenizer, text ids int32 [N], the text's source record). --tiny: the random tiny
    preset over byte text built here (tests)."""
    import jax.numpy as jnp
    from flax import nnx
    from scripts import bench_longctx as lc, bench_quality
    if a.tiny:
        from ulacache_jax import models
        model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
        tok = models.ByteTokenizer()
        text = " ".join(f"line {i}: the value of item {i % 37} is {(i * 7919) % 1000}." for i in range(400))
        source = {"source": "tiny"}
    else:
        model, tok = lc.load_model(a.model, a.dtype)
        text, source = bench_quality.corpus_text(a.text)
    return model, tok, np.asarray(tok.encode(text, add_special_tokens=False), np.int32), source


def token_keep(s, pos, *, page: int, budget: int, sink: int, recent: int, shortlist: int = 0, fetch: int = 0):
    """Keys a sparse layer attends when it selects single tokens: s [KV, g, T] float32 logits (or an estimate; keys
    past pos masked to -inf), pos [] int32 -> bool [KV, T]. Pages of `page` tokens (the cache's unit) still frame
    the budget: each KV head keeps the first `sink` and last `recent` flushed pages and the tail page whole, and
    fills the rest of `budget` tokens with the flushed tokens of largest mass (softmax over the visible keys, summed
    over its g query heads). shortlist M > 0: those tokens come from the M * budget // page flushed pages of largest
    mass only (a page shortlist the pool would hold, then tokens within it); 0: from every flushed token. fetch
    F > 0 (with a shortlist, F < M): only the F * budget // page pages holding the most chosen mass are read (the
    pages a step fetches), and the budget is chosen again among their tokens (the library's token_fetch, 09a197d,
    deleted when a plain 2x shortlist tied it at 8K)."""
    import jax
    import jax.numpy as jnp
    KV, g, T = s.shape
    npg = T // page
    p, flushed, pid, forced = _step_mass(s, pos, page=page, sink=sink, recent=recent)   # forced [npg]
    cand = jnp.broadcast_to(pid < flushed, (KV, npg))
    if shortlist:
        mass = jnp.where(pid < flushed, jnp.where(forced, jnp.inf, p.reshape(KV, npg, page).sum(-1)), -jnp.inf)
        _, top = jax.lax.top_k(mass, min(shortlist * budget // page, npg))         # [KV, M * budget / page]
        cand = cand & jnp.zeros((KV, npg), bool).at[jnp.arange(KV)[:, None], top].set(True)
    tok_forced = jnp.repeat(forced, page)

    def choose(cand):                                                               # [KV, npg] -> [KV, T], score
        score = jnp.where(jnp.repeat(cand, page, axis=1), jnp.where(tok_forced, jnp.inf, p), -jnp.inf)
        _, top = jax.lax.top_k(score, min(budget, T))                              # [KV, budget]
        return jnp.zeros((KV, T), bool).at[jnp.arange(KV)[:, None], top].set(True), score

    chosen, score = choose(cand)
    if shortlist and fetch and fetch < shortlist:
        held = jnp.where(chosen, jnp.where(jnp.repeat(forced, page), jnp.inf, p), 0.0).reshape(KV, npg, page).sum(-1)
        held = jnp.where(cand & chosen.reshape(KV, npg, page).any(-1), held, -jnp.inf)
        v, top = jax.lax.top_k(held, min(fetch * budget // page, npg))              # [KV, F * budget / page]
        read = jnp.zeros((KV, npg), bool).at[jnp.arange(KV)[:, None], top].set(v > -jnp.inf)
        chosen, score = choose(cand & read)
    tid_page = jnp.arange(T) // page
    return (chosen & (score > -jnp.inf)) | (tid_page >= flushed)[None]              # the tail is always read


def make_decoder(model, total: int, *, page: int, keep: int, sink: int, recent: int, dense_layers: tuple,
                 label_channels: int = 0, label_bits: int = 4, tokens: int = -1, fetch: int = 0):
    """-> step(params, cache, token [1, 1], pos [], anchor [L, KV, total // page] bool) -> (cache, logits [V])
    under this configuration; cache = (k, v) [L, 1, total, KV, D] float32; anchor: pages every sparse layer keeps
    (prompt_anchors; all False for none). `total` must be a multiple of `page` (and of 16 with label_channels).
    label_channels C > 0: a sparse layer ranks pages by label_logits (C channels at label_bits) instead of the true
    logits; it still attends its pages with the true ones. tokens >= 0: a sparse layer selects `keep * page` single
    tokens instead of `keep` pages (token_keep, shortlist = tokens, fetch = fetch; anchors unused)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    graphdef, _ = nnx.split(model)
    D = model.config.head_dim

    def attn(cache, q, k, v, pos, layer, anchor):
        ck = cache[0].at[layer, :, pos].set(k[:, 0].astype(jnp.float32))
        cv = cache[1].at[layer, :, pos].set(v[:, 0].astype(jnp.float32))
        K, V = ck[layer, 0], cv[layer, 0]                                         # [T, KV, D]
        KVh = K.shape[1]
        qg = q[0, 0].astype(jnp.float32).reshape(KVh, -1, D)                      # [KV, g, D]
        s = jnp.einsum("kgd,tkd->kgt", qg, K) / np.sqrt(D)                        # [KV, g, T]
        seen = jnp.arange(total) <= pos
        s = jnp.where(seen[None, None], s, -jnp.inf)
        if layer not in dense_layers:
            r = s if not label_channels else jnp.where(
                seen[None, None], label_logits(qg, K, pos, channels=label_channels, bits=label_bits), -jnp.inf)
            if tokens >= 0:
                kept = token_keep(r, pos, page=page, budget=keep * page, sink=sink, recent=recent, shortlist=tokens,
                                  fetch=fetch)
            else:
                kept = oracle_keep(r, pos, page=page, keep=keep, sink=sink, recent=recent, anchor=anchor[layer])
            s = jnp.where(kept[:, None], s, -jnp.inf)
        o = jnp.einsum("kgt,tkd->kgd", jax.nn.softmax(s, axis=-1), V)            # [KV, g, D]
        return (ck, cv), o.reshape(1, 1, -1, D).astype(q.dtype)

    @jax.jit
    def step(params, cache, tok, pos, anchor):
        m = nnx.merge(graphdef, params)
        cache, logits = m.forward_with_cache(
            cache, tok, jnp.full((1, 1), pos, jnp.int32), pos,
            lambda c, q, k, v, p, layer: attn(c, q, k, v, p, layer, anchor))
        return cache, logits[0, -1]
    return step


def make_prefill(model, window: int):
    """-> prefill(params, ids, total): the dense prefill of ids right-padded to `total` tokens -> (cache (k, v)
    [L, 1, total, KV, D] float32, logits of the last prompt position [V], the queries of the prompt's last `window`
    positions [L, window, H, D] float32: prompt_anchors'). Causal attention: the padding is unseen by the prompt,
    and each decode step writes its position's K/V before attending with later positions masked, so the padding's
    keys are never read; one compile serves every prompt of one padded length."""
    import jax
    import jax.numpy as jnp
    from scripts.studies.selection_recall import dense_forward_fn
    c = model.config

    def store(cache, q, k, v, layer):
        ck, cv, qw, start = cache
        last = jax.lax.dynamic_slice_in_dim(q[0].astype(jnp.float32), start, window, axis=0)   # [W, H, D]
        return (ck.at[layer].set(k.astype(jnp.float32)), cv.at[layer].set(v.astype(jnp.float32)),
                qw.at[layer].set(last), start)

    fwd = dense_forward_fn(model, store)

    def prefill(params, ids: list[int], total: int):
        z = jnp.zeros((c.num_layers, 1, total, c.num_kv_heads, c.head_dim), jnp.float32)
        qz = jnp.zeros((c.num_layers, window, c.num_heads, c.head_dim), jnp.float32)
        padded = np.zeros((1, total), np.int32)
        padded[0, :len(ids)] = ids
        start = jnp.int32(max(0, len(ids) - window))
        (ck, cv, qw, _), h = fwd(params, jnp.asarray(padded), (z, z, qz, start))
        return (ck, cv), model.logits(h[:, len(ids) - 1:len(ids)])[0, -1], qw
    return prefill


def decode(step, params, cache, first_logits, start: int, max_new: int, stop_ids, anchor) -> list[int]:
    import jax.numpy as jnp
    out, logits = [], first_logits
    for j in range(max_new):
        tok = int(jnp.argmax(logits))
        if tok in stop_ids:
            break
        out.append(tok)
        if j + 1 == max_new:
            break
        cache, logits = step(params, cache, jnp.asarray([[tok]], jnp.int32), jnp.int32(start + j), anchor)
    return out


def plot(runs, path: str) -> str:
    """Accuracy against the K/V read share a step, one point per configuration, one series per run."""
    plt = bench_meta.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in runs:
        xs = [s["read_share"] for s in r["summary"]]
        ys = [s["accuracy"] for s in r["summary"]]
        budgets = r.get("budgets", [r.get("budget")])          # runs before budgets were an axis name one
        ax.plot(xs, ys, "o", label=f"{r['run'] or r['model']} (budget {', '.join(map(str, budgets))})")
        for s, x, y in zip(r["summary"], xs, ys):
            ax.annotate(s["config"].replace("oracle, ", "").replace("dense layers ", "dense ")
                        .replace("budget ", "b"), (x, y), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("K/V read a step / dense's")
    ax.set_ylabel("accuracy (ruler_tasks.score)")
    ax.set_title("Oracle page selection with some layers dense")
    ax.legend(fontsize=7)
    return bench_meta.save_figure(fig, path)


def summarize(rows: list) -> list:
    """One line per configuration over `rows` (in first-seen order): accuracy, answers fully right, and how many of
    dense's fully right answers the configuration also gets fully right (kept_of_dense, the issue-48 'kept')."""
    names = list(dict.fromkeys(r["config"] for r in rows))
    dense_right = {r["prompt"] for r in rows if r["config"] == "dense" and r["accuracy"] == 1.0}
    summary = []
    for name in names:
        rs = [r for r in rows if r["config"] == name]
        right = {r["prompt"] for r in rs if r["accuracy"] == 1.0}
        summary.append({"config": name, "page_size": rs[0]["page_size"], "budget": rs[0]["budget"],
                        "dense_layers": rs[0]["dense_layers"], "anchors": rs[0].get("anchors", 0),
                        "prompts": len(rs),
                        "accuracy": float(np.mean([r["accuracy"] for r in rs])),
                        "fully_right": len(right),
                        "kept_of_dense": len(right & dense_right),
                        "same_as_dense": float(np.mean([r["same_as_dense"] for r in rs])),
                        "read_share": float(np.mean([r["read_share"] for r in rs]))})
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", help="a prompt file of scripts/bench_longctx.py --make-prompts")
    p.add_argument("--page-size", type=int, nargs="+", default=[16],
                   help="page sizes, each decoded from the same prefill")
    p.add_argument("--budget", type=int, nargs="+", default=[256],
                   help="tokens a sparse layer selects (flushed pages); each budget decoded from the same prefill")
    p.add_argument("--sink", type=int, default=1)
    p.add_argument("--recent", type=int, default=2)
    p.add_argument("--dense-sets", nargs="+", default=["none", "0,1", "0,1,-1"],
                   help="layers left dense per configuration: 'none' or comma-separated indices (negative from the "
                        "end)")
    p.add_argument("--anchors", type=int, nargs="+", default=[0],
                   help="pages per layer and KV head every sparse layer keeps all the decode, chosen once from the "
                        "attention of the prompt's last --anchor-window queries (prompt_anchors), inside the budget; "
                        "each count an axis of the configurations (0: none)")
    p.add_argument("--anchor-window", type=int, default=64, help="the prompt's last queries that choose the anchors")
    p.add_argument("--max-prompts", type=int, default=0, help="the first N prompts (0: all)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds after which no further prompt starts (0: none); the JSON holds the prompts done")
    p.add_argument("--tiny", action="store_true", help="random tiny model, two made-up prompts (tests)")
    p.add_argument("--run", default="", help="a label for this run in the JSON")
    return bench_meta.add_common_args(p, out_required=True, files="dense_layers.json (each call appends a run), dense_layers.png",
                                      model="qwen2.5-coder-0.5b", dtype="float32")


def tiny_prompts():
    text = "the value of k is 4821. " * 3 + "filler " * 20 + "what is k?"
    return [{"id": f"tiny/{i}", "task": "niah_single", "context": 256, "depth": 0.5, "seed": i, "text": text,
             "answers": ["4821"], "prompt_tokens": 0, "max_new_tokens": 6} for i in range(2)]


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from scripts import bench_longctx as lc
    from scripts import ruler_tasks
    for pg in a.page_size:
        for b in a.budget:
            if pg <= 0 or b <= 0 or b % pg:
                raise SystemExit(f"--budget {b} must be a positive multiple of --page-size {pg}")
            free = b // pg - a.sink - a.recent
            for count in a.anchors:
                if count < 0 or count > max(free, 0):
                    raise SystemExit(f"--anchors {count} must be in [0, {max(free, 0)}]: the pages --budget {b} "
                                     f"at page {pg} selects beside --sink {a.sink} and --recent {a.recent}")
    if a.anchor_window < 1:
        raise SystemExit(f"--anchor-window {a.anchor_window} must be >= 1")
    if a.max_prompts < 0 or a.deadline < 0:
        raise SystemExit(f"--max-prompts {a.max_prompts} and --deadline {a.deadline} must be >= 0")
    if a.tiny:
        import jax.numpy as jnp
        from flax import nnx
        from ulacache_jax import models
        model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
        tok = models.ByteTokenizer()
        prompts, stop = tiny_prompts(), ()
        ids_of = tok.encode
    else:
        if not a.prompts:
            raise SystemExit("--prompts FILE is required (or --tiny)")
        prompts, _ = lc.read_prompt_file(a.prompts)
        model, tok = lc.load_model(a.model, a.dtype)
        stop = lc.stop_ids_of(model, tok)
        ids_of = functools.partial(lc.chat_ids, tok)
    if a.max_prompts:
        prompts = prompts[:a.max_prompts]
    L = model.config.num_layers
    sets = [parse_set(s, L) for s in a.dense_sets]
    from flax import nnx
    _, params = nnx.split(model)
    rows, answers = [], {}
    t0 = time.time()
    unit = int(np.lcm.reduce([CACHE_UNIT, *a.page_size]))      # the cache length serves every page size
    configs = [("dense", unit, None, tuple(range(L)), 0)] + [("sparse", pg, b, s, c) for b in a.budget
                                                             for pg in a.page_size for s in sets for c in a.anchors]
    steps = {}                                       # (cache length, config) -> its compiled step
    prefill = make_prefill(model, a.anchor_window)
    import jax
    import jax.numpy as jnp
    anchors_of = jax.jit(prompt_anchors, static_argnames=("page", "count", "sink"))
    done = 0
    for n, p in enumerate(prompts):
        if a.deadline and time.time() - t0 > a.deadline:
            print(f"deadline {a.deadline:.0f} s: {n} of {len(prompts)} prompts done", flush=True)
            break
        done = n + 1
        ids = ids_of(p["text"])
        max_new = int(p["max_new_tokens"])
        total = -(-(len(ids) + max_new) // unit) * unit
        cache, first, qw = prefill(params, ids, total)
        anchors = {}                                 # (page, count) -> this prompt's anchors, shared by budgets
        for kind, pg, budget, dl, count in configs:
            key = (total, pg, budget, dl)
            if key not in steps:
                steps[key] = make_decoder(model, total, page=pg, keep=(budget or total) // pg, sink=a.sink,
                                          recent=a.recent, dense_layers=dl)
            if (pg, count) not in anchors:
                anchors[pg, count] = anchors_of(cache[0], qw, jnp.int32(len(ids)), page=pg, count=count,
                                                sink=a.sink) if count else \
                    jnp.zeros((L, model.config.num_kv_heads, total // pg), bool)
            anchor = anchors[pg, count]
            toks = decode(steps[key], params, cache, first, len(ids), max_new, stop, anchor)
            text = tok.decode(toks)
            name = "dense" if kind == "dense" else \
                f"oracle, budget {budget}, page {pg}, dense layers " + (",".join(map(str, dl)) or "none") + \
                (f", anchors {count}" if count else "")
            acc = float(ruler_tasks.score(lc.as_prompt(p), text))
            answers.setdefault(name, []).append(text)
            share = 1.0 if kind == "dense" else (len(dl) + (L - len(dl)) * min(1.0, budget / len(ids))) / L
            rows.append({"prompt": p["id"], "config": name, "page_size": pg if kind != "dense" else None,
                         "budget": budget, "dense_layers": list(dl), "anchors": count, "accuracy": acc,
                         "same_as_dense": text == answers["dense"][-1], "text": text, "read_share": share})
            print(f"[{time.time() - t0:6.0f}s] prompt {n + 1}/{len(prompts)} {name}: {acc:.2f} {text[:60]!r}",
                  flush=True)
    summary = summarize(rows)
    print("| configuration | accuracy | fully right | of dense's kept | = dense | K/V read share |\n"
          "|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['config']} | {s['accuracy']:.3f} | {s['fully_right']} | {s['kept_of_dense']} | "
              f"{s['same_as_dense']:.2f} | {s['read_share']:.3f} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "dense_layers.json")
    data = json.load(open(path)) if os.path.exists(path) else {"runs": []}
    data["runs"].append({"meta": bench_meta.run_meta(a.commit),
                         "run": a.run, "model": a.model if not a.tiny else "tiny", "page_sizes": a.page_size,
                         "budgets": a.budget, "sink": a.sink, "recent": a.recent, "anchors": a.anchors,
                         "anchor_window": a.anchor_window,
                         "prompts_file": os.path.basename(a.prompts or "tiny"), "prompts": done,
                         "prompts_in_file": len(prompts), "summary": summary, "rows": rows})
    bench_meta.write_json(path, data)
    plot(data["runs"], os.path.join(a.out, "dense_layers.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
