"""Exact mode's decode speed at the Llama-3.1-8B shape (issue 48 item 5), one process a row: dense decoding, the
sparse drafter's own decoding, and exact mode's cycle (the drafter proposes K tokens, the dense cache verifies K +
1 rows, the drafter commits), all on the same model and the same caches.

Per row (context x batch): random bf16 8B weights; a dense cache filled synthetically (`bench_decode.
synthetic_fill_dense`) and the drafter's UlaCache cache beside it (`Generator.sibling`: the same parameters; pool
--kv-fraction of the KV pages, hot pages planted by --hot-share so its hit rate stays at or under a trained
model's trace, `bench_decode.synthetic_fill_sparse`), budget --budget-ratio x the context, labels
--key-channels @ --label-bits. Timed (medians, host syncs included as the Engine runs them):
- dense_ms / sparse_ms: a plain decode step of each cache (a page_size-step chunk / page_size);
- cycle_ms at each K of --ks: propose (K + 1 drafter steps in one call) + dense verification of K + 1 rows + the
  drafter's commit, over reps whose rows are not cut by a flush point; propose_ms / verify_ms / commit_ms its parts
  (each ended by a host sync: the commit's is added to time it, the Engine's next step waits on it anyway).
Random weights accept drafts at an arbitrary rate (their `acceptance` is recorded, not used), so tokens/s is
given for a drafter accepting each draft with probability a (--acceptance, e.g. a trained model's measured rate
from `bench_longctx --rules exact:K:<rule>`): a cycle yields 1 + a + ... + a^K tokens a sequence, so
exact tok/s = batch x (1 - a^(K + 1)) / (1 - a) / cycle seconds; ratio_vs_dense = that / dense tok/s. The
ceiling beside it (`bound_tok_s`: every draft accepted) is batch x (K + 1) / cycle seconds.

Checked before timing (`check`, the tiny model in float32): exact mode's greedy tokens through `generate` equal
plain dense decoding's, the reference the timed cycle is the step of.

    python -m scripts.bench_exact --out docs/benchmarks --rows 131072:3,262144:1 --ks 2,4
    python -m scripts.bench_exact --small --out /tmp/x          # tiny model on CPU: a check of the script
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

from scripts.bench_meta import Results, add_common_args, run_meta


def parse_rows(text: str) -> list[tuple[int, int]]:
    rows = []
    for part in text.split(","):
        ctx, _, b = part.partition(":")
        try:
            rows.append((int(ctx), int(b)))
        except ValueError:
            raise SystemExit(f"--rows {part!r}: CONTEXT:BATCH, e.g. 131072:3") from None
        if rows[-1][0] < 1 or rows[-1][1] < 1:
            raise SystemExit(f"--rows {part!r}: context and batch must be >= 1")
    return rows


def exact_tok_s(batch: int, k: int, a: float, cycle_s: float) -> float:
    """Tokens/s of exact mode whose drafts are each accepted with probability a (after an accepted one)."""
    per_cycle = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return batch * per_cycle / cycle_s


class Cycle:
    """Exact mode's step over a dense Generator `gen` and its drafter `dg` (the calls SpecDecoder.decode makes,
    without an Engine): propose -> verify -> commit. Every slot is live; lengths are host mirrors."""

    def __init__(self, gen, dg, batch: int, prompt: int, length: int, k: int):
        import numpy as np
        from ulacache_jax.runtime.sampling import SamplingArrays
        self.gen, self.dg, self.K = gen, dg, k
        S = gen.config.max_seqs
        self.S, self.page = S, gen.config.page_size
        self.L = length                            # committed tokens of every live slot
        self.ctx = prompt                          # where the flush points start (the fills' length)
        self.tok = np.zeros(S, np.int32)
        self.live = np.arange(S) < batch
        self.sampling = SamplingArrays.fill(S)

    def run(self, step: int):
        """One cycle -> (tokens delivered per slot [S], rows verified (K + 1 unless a flush point cuts them),
        seconds, its parts in `self.parts`)."""
        import numpy as np
        import jax
        import jax.numpy as jnp
        from ulacache_jax.runtime.sampling import row_keys
        from ulacache_jax.runtime.speculative.rules import next_flush
        K, S = self.K, self.S
        b = next_flush(self.ctx, self.L, self.page)
        n = min(K + 1, b - self.L)
        nrows = np.where(self.live, n, 0).astype(np.int32)
        keys = row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, 1000 + step, jnp.uint32))
        t = time.perf_counter()
        db = self.dg.backend
        args = jax.device_put((self.tok, nrows, keys, self.sampling), self.dg.replicated)
        db.cache, drafts, probs = self.dg.program.propose(K + 1)(self.dg.params, db.cache, db.host, *args)
        tokens = np.zeros((S, K + 1), np.int32)
        tokens[:, 0] = self.tok
        tokens[:, 1:] = np.asarray(drafts)
        t_propose = time.perf_counter()
        gb = self.gen.backend
        a = jax.device_put((tokens, nrows, np.full(S, b, np.int32), keys, self.sampling, probs), self.gen.replicated)
        gb.cache, gb.host, out, n_new, length, flush, _ = self.gen.program.verify(K + 1, True)(
            self.gen.params, gb.cache, gb.host, *a)
        out, n_new = np.asarray(out), np.asarray(n_new)
        t_verify = time.perf_counter()
        db.cache, db.host = self.dg.program.commit(db.cache, db.host, length, flush,
                                                   jax.device_put(self.live, self.dg.replicated))
        jax.block_until_ready(db.cache)
        end = time.perf_counter()
        self.parts = dict(propose=t_propose - t, verify=t_verify - t_propose, commit=end - t_verify)
        self.tok = np.where(self.live, out[np.arange(S), np.maximum(n_new - 1, 0)], 0).astype(np.int32)
        self.L += int(n_new[0])
        return n_new, n, end - t


def run_row(args, res, ctx: int, batch: int) -> None:
    import numpy as np
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from scripts.bench_decode import bench_config, synthetic_fill_dense, synthetic_fill_sparse
    from scripts.bench_speculative import plain_step_ms
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.generator import Generator
    preset = "tiny" if args.small else "llama-3.1-8b"
    mc = get_preset(preset)
    dtype = jnp.float32 if args.small else jnp.bfloat16
    model = LlamaModel(mc, dtype=dtype, rngs=nnx.Rngs(0))
    page = 16 if args.small else 64
    budget = max(page, int(ctx * args.budget_ratio) // page * page)
    K = max(args.ks)
    cycles = (args.reps + 2) * len(args.ks) * (K + 1) // page + 4
    ns = argparse.Namespace(chunks=2 * args.chunks + cycles + 2, budget=budget, label_bits=args.label_bits)
    cfg_d = dataclasses.replace(bench_config(mc, "dense", batch, ctx, ns, 1.0, page=page), verify_rows=K + 1,
                                dtype=jnp.dtype(dtype).name)
    gen = Generator(model, cfg_d, attention="dense")
    synthetic_fill_dense(gen, batch, ctx, seed=batch)
    cfg_s = dataclasses.replace(bench_config(mc, "sparse", batch, ctx, ns, args.kv_fraction, page=page,
                                             key_channels=args.key_channels), dtype=jnp.dtype(dtype).name)
    dg = gen.sibling(cfg_s, attention="sparse")
    reserve = ctx + (ns.chunks + 1) * page
    slots = [dg.admit(reserve) for _ in range(batch)]
    synthetic_fill_sparse(dg.cache, slots, ctx, seed=batch, chunk=min(ctx, 32768), hot_share=args.hot_share)
    jax.block_until_ready((gen.dense, dg.cache.state))
    live = np.arange(cfg_d.max_seqs) < batch
    dense_ms, _ = plain_step_ms(gen, live, chunks=args.chunks)
    dg.reset_stats()
    sparse_ms, _ = plain_step_ms(dg, live, chunks=args.chunks)
    hits, misses = int(dg.stats.hits), int(dg.stats.misses)
    # the plain chunks advanced both caches by args.chunks whole pages: the same length, on a flush point
    length = ctx + args.chunks * page
    for k in args.ks:
        cyc = Cycle(gen, dg, batch, ctx, length, k)
        times, acc, prop, parts = [], 0, 0, []
        step = 0
        while len(times) < args.reps + 1:
            n_new, n, sec = cyc.run(step)
            step += 1
            if n == k + 1:                              # cut rows (at a flush point) are not a K cycle
                times.append(sec)
                parts.append(cyc.parts)
                acc += int(n_new[:batch].sum() - batch)
                prop += k * batch
        length = cyc.L
        cycle_ms = 1e3 * statistics.median(times[1:])   # the first compiles
        dense_tok_s = batch / (dense_ms / 1e3)
        row = dict(model=preset, context=ctx, batch=batch, budget=budget, page=page, num_tokens=k,
                   key_channels=args.key_channels, label_bits=args.label_bits, kv_fraction=args.kv_fraction,
                   hot_share=args.hot_share, dense_ms=dense_ms, sparse_ms=sparse_ms, cycle_ms=cycle_ms,
                   cycle_over_dense=cycle_ms / dense_ms, hit_rate=hits / max(1, hits + misses),
                   **{f"{p}_ms": 1e3 * statistics.median(x[p] for x in parts[1:]) for p in parts[0]},
                   random_acceptance=acc / max(1, prop), dense_tok_s=dense_tok_s, sparse_tok_s=batch / (sparse_ms / 1e3),
                   bound_tok_s=exact_tok_s(batch, k, 1.0, cycle_ms / 1e3), reps=len(times) - 1,
                   at_acceptance={f"{a:g}": dict(tok_s=exact_tok_s(batch, k, a, cycle_ms / 1e3),
                                                 ratio_vs_dense=exact_tok_s(batch, k, a, cycle_ms / 1e3) / dense_tok_s)
                                  for a in args.acceptance})
        res.add(row)
        print(json.dumps(row), flush=True)
    del gen, dg
    gc.collect()


def check(args) -> None:
    """The reference check (module docstring) on the tiny model: a verification whose drafts are the dense cache's
    own greedy continuation accepts every draft, and the delivered tokens are those of plain dense decoding."""
    import numpy as np
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.generation import default_cache_config, generate
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    mc = get_preset("tiny")
    model = LlamaModel(mc, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, mc.vocab_size, 200).tolist()]
    cfg = default_cache_config(mc, num_seqs=1, max_tokens=256, page_size=16, token_budget=64)
    dense = generate(model, prompts, max_new_tokens=16, cache_config=cfg, attention="dense")
    exact = generate(model, prompts, max_new_tokens=16, cache_config=cfg, speculative=SpecConfig("sparse", 3))
    if exact != dense:
        raise SystemExit("check failed: exact mode's tokens differ from dense decoding's")
    print("check: exact mode = dense decoding (tiny model, float32)", flush=True)


def plot(rows: list[dict], path: str) -> str | None:
    """Exact mode's tok/s over dense's against the drafts' acceptance rate, one line per row (context x batch, K,
    variant), the break-even at 1; None where matplotlib is missing (the GPU machine: `--png` draws it later)."""
    try:
        from scripts.bench_meta import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, r in enumerate(rows):
        acc = sorted(r["at_acceptance"], key=float)
        label = (f"{r['context'] // 1024}K x {r['batch']}, K={r['num_tokens']}"
                 + (f", {r['variant']}" if r.get("variant") else "") + f" ({r['cycle_ms']:.0f} ms a cycle)")
        ax.plot([float(a) for a in acc], [r["at_acceptance"][a]["ratio_vs_dense"] for a in acc], marker="o",
                color=f"C{i}", label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("draft acceptance rate")
    ax.set_ylabel("exact mode tok/s / dense tok/s")
    ax.set_title("exact mode (sparse drafts, dense verification), 8B shape", fontsize=9)
    ax.legend(fontsize=6)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, files="exact.json")
    p.add_argument("--rows", default="131072:3,262144:1", help="CONTEXT:BATCH, comma separated")
    p.add_argument("--ks", default="2,4", help="drafts a cycle (K), comma separated")
    p.add_argument("--budget-ratio", type=float, default=1 / 32, help="the drafter's token budget / context")
    p.add_argument("--key-channels", type=int, default=32)
    p.add_argument("--label-bits", type=int, default=4, choices=(0, 4, 8))
    p.add_argument("--kv-fraction", type=float, default=0.125, help="the drafter's HBM pool / KV pages")
    p.add_argument("--hot-share", type=float, default=0.9)
    p.add_argument("--acceptance", default="0.7,0.8,0.9,0.95", help="draft acceptance rates to report tok/s at")
    p.add_argument("--chunks", type=int, default=4, help="plain decode chunks a side (the first compiles)")
    p.add_argument("--reps", type=int, default=8, help="timed cycles per K (after one that compiles)")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out's exact.json")
    p.add_argument("--small", action="store_true", help="the tiny model in float32 (a CPU check of the script)")
    p.add_argument("--png", default=None, metavar="JSON", help="draw JSON's PNG beside it (no run) and exit")
    return p


def main(argv=None):
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()  # before JAX starts: XLA's pinned host pool is 64 GiB by default
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")   # both caches beside the weights
    args = build_parser().parse_args(argv)
    if args.png:
        with open(args.png) as f:
            print(plot(json.load(f)["rows"], os.path.splitext(args.png)[0] + ".png"))
        return None
    args.ks = sorted({int(k) for k in args.ks.split(",")})
    args.acceptance = [float(a) for a in args.acceptance.split(",")]
    if not args.ks or min(args.ks) < 1 or not all(0 <= a <= 1 for a in args.acceptance):
        raise SystemExit("--ks must be ints >= 1 and --acceptance rates in [0, 1]")
    rows = parse_rows(args.rows if not args.small else "512:2")
    if args.small:   # the tiny model's head_dim is 16: a quarter of it, as 32 of the 8B's 128
        args.reps, args.chunks, args.key_channels = min(args.reps, 3), min(args.chunks, 2), 4
    path = os.path.join(args.out, "exact.json")
    res = Results(path, run_meta(args.commit, kind="exact_mode"))
    if args.append and os.path.exists(path):
        with open(path) as f:
            res.rows = json.load(f).get("rows", [])
    elif os.path.exists(path):
        raise SystemExit(f"{path} exists: pass --append to add rows, or another --out")
    check(args)
    for ctx, batch in rows:
        run_row(args, res, ctx, batch)
    plot(res.rows, os.path.splitext(path)[0] + ".png")
    print(f"{'ctx':>7} {'B':>2} {'K':>2} {'dense ms':>9} {'sparse ms':>9} {'cycle ms':>9} {'propose':>8} "
          f"{'verify':>7} {'commit':>7} {'hit':>6} "
          + " ".join(f"{'x@' + k:>7}" for k in (f"{a:g}" for a in args.acceptance)))
    nan = float("nan")
    for r in res.rows:
        print(f"{r['context']:>7} {r['batch']:>2} {r['num_tokens']:>2} {r['dense_ms']:>9.2f} {r['sparse_ms']:>9.2f} "
              f"{r['cycle_ms']:>9.2f} {r.get('propose_ms', nan):>8.2f} {r.get('verify_ms', nan):>7.2f} "
              f"{r.get('commit_ms', nan):>7.2f} {r['hit_rate']:>6.3f} "
              + " ".join(f"{v['ratio_vs_dense']:>7.2f}" for v in r["at_acceptance"].values()))
    return res


if __name__ == "__main__":
    main()
