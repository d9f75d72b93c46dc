"""Probe: the radix-select top-k (pallas_kernels/page_topk.py) at 1, 2, 3, 4 threshold bits a pass, against lax.top_k.

Why: the 1-bit kernel runs 32 passes one after another, each ending in a block reduction (a cross-warp barrier);
b bits a pass take 32 / b passes but 2^b - 1 compares an element each. Which wins on an H200 decides the bits kept.
Every variant is first checked against `ref_top_k` exactly (values and indices, np.array_equal; bit patterns are
recorded too), on random normal scores and on rows full of ties (signed zeros, infinities, one-ulp steps,
denormals); then timed as a jitted fori_loop of --calls calls, each call's scores depending on the previous call's
result (so no call is hoisted), median of --reps runs. A variant that fails to compile or to match is recorded and
the rest still run; the exit status is 1 if any failed.
    python3 scripts/probes/topk_variants.py [--commit SHA] [--out FILE] [--warps 4 8 16] [--small]
--small: tiny shapes in interpret mode, 2 reps (checks the script on CPU). Prints one JSON line per variant, a table
last; writes FILE (default $OUT/topk_variants.json, else /tmp/topk_variants.json).
"""
import argparse
import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

SHAPES = [(8, 4224, 32), (24, 2112, 32), (24, 4224, 32), (8, 2112, 16)]   # rows x pages x k (decode shapes)
SMALL_SHAPES = [(3, 100, 8), (2, 257, 16)]
BITS = (1, 2, 3, 4)


def tie_scores(rng, rows: int, pages: int) -> np.ndarray:
    """[rows, pages] float32 with few distinct values (ties at the k-th score of every row), first rows the edges."""
    f32 = lambda u: np.asarray(u, np.uint32).view(np.float32)                  # bit patterns -> float32
    s = rng.integers(-3, 4, (rows, pages)).astype(np.float32)                  # many exact ties
    edges = [np.full(pages, 1.5),                                              # all equal
             rng.choice([-1, -0.0, 0.0, 1], pages),                            # signed zeros tie
             f32(np.float32(1).view(np.uint32) + rng.integers(0, 4, pages)),   # one-ulp steps above 1
             f32(rng.integers(0, 8, pages)) * rng.choice([-1, 1], pages),      # the smallest +-denormals, +-0
             np.r_[rng.integers(-3, 4, 10), np.full(pages - 10, -np.inf)],     # fewer real pages than k
             np.where(rng.random(pages) < 0.01, np.inf, s[0])]                 # a few +inf
    n = min(rows, len(edges))
    s[:n] = np.stack(edges[:n]).astype(np.float32)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "topk_variants.json"))
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16], help="num_warps of the kernel (GPU)")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes, interpret mode, 2 reps (CPU)")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax import lax
    from ulacache_jax.bench_meta import median_seconds, run_meta
    from ulacache_jax.pallas_kernels import on_gpu
    from ulacache_jax.pallas_kernels.page_topk import ref_top_k, top_k_pallas

    interpret = a.small or not on_gpu()
    shapes, reps = (SMALL_SHAPES, 2) if a.small else (SHAPES, a.reps)
    calls = min(a.calls, 10) if a.small else a.calls
    warps = [None] if interpret else a.warps                  # interpret mode has no warps
    rng = np.random.default_rng(0)
    sets = [(f"normal {r}x{p} k={k}", rng.standard_normal((r, p)).astype(np.float32), k) for r, p, k in shapes]
    r, p, k = shapes[0]
    sets.append((f"ties {r}x{p} k={k}", tie_scores(rng, r, p), k))
    variants = [(f"bits={b}" + (f" w={w}" if w else ""), dict(bits=b, num_warps=w)) for b in BITS for w in warps]

    def timed(fn, s):
        """Seconds per call of fn over a chain of `calls` calls: each call's scores depend on the last result."""
        @jax.jit
        def chain(s):  # s [R, P] float32
            def body(_, c):
                # + min(index, 0): a 0.0 that XLA cannot fold away (0 * value would be NaN for an infinite score)
                v, i = fn(s + jnp.minimum(c, 0).astype(jnp.float32))
                return i[0, 0]
            return lax.fori_loop(0, calls, body, jnp.int32(0))
        return median_seconds(lambda: chain(s), reps, per_call=calls)

    meta = run_meta(a.commit, interpret=interpret, calls=calls, reps=reps)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    rows, failed = [], False

    def save():  # after every row: a run cut short by its time limit keeps what it measured
        with open(a.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)

    for name, s_np, k in sets:
        s = jnp.asarray(s_np)                                      # [R, P] float32
        rv, ri = (np.asarray(x) for x in ref_top_k(s, k))         # [R, k] float32, int32: what every variant returns
        fns = [("ref_top_k", {}, lambda x, k=k: ref_top_k(x, k))] + [
            (label, kw, lambda x, k=k, kw=kw: top_k_pallas(x, k, interpret=interpret, **kw)) for label, kw in variants]
        for label, kw, fn in fns:
            row = dict(set=name, rows=s.shape[0], pages=s.shape[1], k=k, variant=label, **kw)
            try:
                v, i = (np.asarray(x) for x in jax.jit(fn)(s))
                row["ok"] = bool(np.array_equal(v, rv) and np.array_equal(i, ri))
                row["bitwise"] = bool(np.array_equal(v.view(np.uint32), rv.view(np.uint32)))
                if not row["ok"]:  # which rows: in the ties set, each of the first rows is one edge case
                    row["bad_rows"] = np.nonzero(~((v == rv) & (i == ri)).all(axis=1))[0].tolist()
                t = timed(fn, s)
                row.update(us=t.median_s * 1e6, min_us=t.min_s * 1e6, max_us=t.max_s * 1e6)
            except Exception as e:  # noqa: BLE001 - one variant failing to lower or compile must not lose the others
                row.update(ok=False, error=repr(e)[:400])
            failed |= not row["ok"]
            rows.append(row)
            save()
            print(json.dumps(row), flush=True)

    print(f"\n{meta['device']}, jax {meta['jax']}, commit {meta['commit']}: us per call ({calls} calls, median of "
          f"{reps}) -> {a.out}")
    print("| set | variant | us | ok | bitwise |\n|---|---|---|---|---|")
    for x in rows:
        us = f"{x['us']:.2f}" if "us" in x else "ERROR " + x.get("error", "")[:60]
        print(f"| {x['set']} | {x['variant']} | {us} | {x['ok']} | {x.get('bitwise', '')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
