"""fp8 pages against model-dtype pages on a trained model (issue 50 item 3, CPU-sized): teacher-forced perplexity,
top-1 agreement and KL to exact dense attention over real text, and greedy answers to long needle prompts, for
every (page format, budget) cell in one run on the same inputs.

    python -m scripts.studies.kv_dtype_quality --model smollm2-135m --dtype bfloat16 --out /tmp/kvq \\
        --ppl-window 1024 --ppl-windows 4 --context 2048 --num-prompts 6 --budgets 256

Cells: kv_dtype "auto" (the model's dtype: bf16 pages with --dtype bfloat16), "float8_e4m3fn" (the library's fp8
pages: a scale per page and KV head) and, in --kv-dtypes, "fp8_per_token" (issue 50's alternative, not built:
`PerTokenFp8` below stores what e4m3 codes with a float32 scale per token and KV head decode to, in the model's
dtype, so its quality is per-token fp8's without a page format for it), each at a budget
covering the whole window (every page attended: dense attention over the stored pages, by construction) and at
each --budgets value (sparse, Quest). The dense reference of the scores is the scorer's exact dense forward
(unquantised K/V: scripts/scoring.py), so "top1" and "kl" of the covering fp8 cell are what fp8 storage alone
costs. Text: the essays haystack (scripts/haystacks.py), windows spread over it. Answers: ruler_tasks niah_single
prompts (bench_longctx.make_prompts), greedy through `generate`; same_as_auto is the fraction of prompts whose
answer text equals the same budget's model-dtype answer. Writes NAME.json to --out and prints a markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

import numpy as np


def log(*a):
    print(*a, flush=True)


@functools.lru_cache(maxsize=1)
def per_token_fp8_codec():
    """A page codec (cache/codec.py) whose stored values are e4m3 codes with one float32 scale per token and KV
    head, decoded back into the model's dtype at encode time: per-token fp8's quality, stored unscaled (so the tail
    append encodes each token as it comes, as a per-token page format would). One instance, its class made here
    (JAX imported only when asked), so every cell's config compares equal."""
    import dataclasses
    import jax.numpy as jnp
    from ulacache_jax.cache import codec

    @dataclasses.dataclass(frozen=True)
    class PerTokenFp8(codec.ModelCodec):
        name = "fp8_per_token"

        def encode(self, k, v, model_dtype):
            fp8 = codec.Fp8Codec()

            def rt(x):                       # a "page" of one token: the scale is that token's, per KV head
                xt = x.astype(jnp.float32)[..., None, :, :]                         # [..., page, 1, g, D]
                c, sc = fp8.quantise(xt)                                            # sc [..., page, 1, g, 1]
                return (c.astype(jnp.float32) * sc)[..., 0, :, :].astype(self.storage_dtype(model_dtype))
            return codec.Pages(rt(k), rt(v))

    return PerTokenFp8()


def cache_fields(kv: str) -> dict:
    """The CacheConfig fields of a --kv-dtypes entry."""
    if kv == "fp8_per_token":
        return dict(page_codec=per_token_fp8_codec())
    return dict(kv_dtype=kv)


def build_parser() -> argparse.ArgumentParser:
    from scripts import bench_meta
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # --out None: print the table only (a study, not a benchmark kept in docs/benchmarks)
    bench_meta.add_common_args(ap, out_default=None, out_default_help="none: print only", model="smollm2-135m",
                               dtype="bfloat16")
    ap.add_argument("--kv-dtypes", default="auto,float8_e4m3fn")
    ap.add_argument("--budgets", default="256", help="comma list of sparse token budgets (plus a covering one)")
    ap.add_argument("--no-covering", action="store_true", help="skip the covering-budget cells (the sparse ones only)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--ppl-window", type=int, default=1024)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-prefix", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048, help="needle prompts' context (0: no answers part)")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--haystack", default="essays")
    ap.add_argument("--name", default="kv_dtype_quality")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)

    import jax.numpy as jnp
    from ulacache_jax import generate
    from ulacache_jax.models import from_pretrained, load_tokenizer
    from ulacache_jax.runtime.generation import default_cache_config
    from scripts import haystacks, ruler_tasks
    from scripts.bench_longctx import chat_ids, make_prompts, stop_ids_of
    from scripts.scoring import TeacherForcedScorer

    model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype))
    tok = load_tokenizer(args.model)
    kv_dtypes = args.kv_dtypes.split(",")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    from scripts import bench_meta
    rows = []
    meta = bench_meta.run_meta(args.commit, model=args.model, dtype=args.dtype, page_size=args.page_size,
                               haystack=args.haystack)
    out_path = os.path.join(args.out, f"{args.name}.json") if args.out else None

    def save():          # row by row, atomically (a run cut short keeps its rows)
        if out_path:
            os.makedirs(args.out, exist_ok=True)
            bench_meta.write_json(out_path, dict(meta=meta, rows=rows))

    # ---- teacher-forced scores over real text
    T, W, prefix = args.ppl_window, args.ppl_windows, args.ppl_prefix
    if T:
        docs = haystacks.load(args.haystack)
        # only the text the windows need (about 4 characters a token, twice over): the tokenizer is slow on a
        # whole corpus
        text = "\n\n".join(docs)[:8 * T * W]
        t0 = time.time()
        ids = [int(i) for i in tok.encode(text)]
        log(f"text: {len(text)} characters, {len(ids)} tokens ({time.time() - t0:.0f} s)")
        span = len(ids) - T
        wins = [ids[int(i * span / max(1, W - 1)):][:T] for i in range(W)]
        meta["ppl"] = dict(windows=W, window_tokens=T, prefix=prefix, scored=W * (T - 1 - prefix))
        for budget in ([] if args.no_covering else [T]) + budgets:
            for kv in kv_dtypes:
                cc = default_cache_config(model.config, num_seqs=W, max_tokens=T, page_size=args.page_size,
                                          token_budget=budget, dtype=args.dtype, **cache_fields(kv))
                t0 = time.time()
                s = TeacherForcedScorer(model, cc).score(wins, prefix).summary()
                rows.append(dict(part="ppl", kv_dtype=kv, budget=budget, covering=budget >= T, **s,
                                 seconds=round(time.time() - t0, 1)))
                log(f"ppl budget {budget} {kv}: ppl {s['ppl']:.4f} (dense {s['dense_ppl']:.4f}) top1 "
                    f"{s['top1_agreement']:.4f} kl {s['kl']:.5f} ({time.time() - t0:.0f} s)")
                save()

    # ---- greedy answers to needle prompts
    if args.context:
        prompts, prov = make_prompts(tok, tasks=["niah_single"], contexts=[args.context], depths=[0.1, 0.5, 0.9],
                                     num_prompts=max(1, args.num_prompts // 3), haystack=args.haystack, seed=0)
        meta["answers"] = dict(context=args.context, prompts=len(prompts), task="niah_single", haystack=prov)
        pids = [chat_ids(tok, p["text"]) for p in prompts]
        mn = max(p["max_new_tokens"] for p in prompts)
        stops = stop_ids_of(model, tok)
        texts = {}
        for budget in ([] if args.no_covering else [args.context]) + budgets:
            for kv in kv_dtypes:
                cc = default_cache_config(model.config, num_seqs=min(8, len(pids)), max_tokens=args.context,
                                          page_size=args.page_size, token_budget=budget, dtype=args.dtype,
                                          **cache_fields(kv))
                t0 = time.time()
                out = generate(model, pids, max_new_tokens=mn, cache_config=cc, attention="sparse", stop_ids=stops)
                txt = [tok.decode(o) for o in out]
                texts[(budget, kv)] = txt
                acc = float(np.mean([ruler_tasks.score(ruler_tasks.Prompt(
                    task=p["task"], context=p["context"], depth=p["depth"], seed=p["seed"], text="",
                    answers=tuple(p["answers"]), prompt_tokens=p["prompt_tokens"]), t) for p, t in zip(prompts, txt)]))
                same = float(np.mean([a == b for a, b in zip(txt, texts[(budget, kv_dtypes[0])])]))
                rows.append(dict(part="answers", kv_dtype=kv, budget=budget, covering=budget >= args.context,
                                 accuracy=acc, same_as_auto=same, n=len(txt), seconds=round(time.time() - t0, 1),
                                 outputs=txt))
                log(f"answers budget {budget} {kv}: accuracy {acc:.3f} same as {kv_dtypes[0]} {same:.3f} "
                    f"({time.time() - t0:.0f} s)")
                save()

    log("| part | budget | kv_dtype | ppl (dense) | top-1 vs dense | KL | accuracy | same answers |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = f"{r['budget']}{' (all pages)' if r['covering'] else ''}"
        if r["part"] == "ppl":
            log(f"| ppl | {b} | {r['kv_dtype']} | {r['ppl']:.4f} ({r['dense_ppl']:.4f}) | {r['top1_agreement']:.4f} "
                f"| {r['kl']:.5f} | | |")
        else:
            log(f"| answers | {b} | {r['kv_dtype']} | | | | {r['accuracy']:.3f} | {r['same_as_auto']:.3f} |")


if __name__ == "__main__":
    main()
