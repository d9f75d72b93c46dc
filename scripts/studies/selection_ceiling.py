"""Study (issue 48): what limits sparse perplexity at a fixed budget, beyond the page scores? bench_quality's ppl
task (teacher forced, scripts/scoring.py) with one of two changes that the library does not offer:

    python -m scripts.studies.selection_ceiling --dense-layers 2 -- --text austen --tasks ppl --ppl-window 8192 \\
        --ppl-prefix 7680 --ppl-windows 2 --budgets 256 --pages 16 --key-channels 32 --label-bits 4 --dtype float32 \\
        --out DIR --name NAME
    python -m scripts.studies.selection_ceiling --cross-head 2 -- ... --budgets 512 ...

--dense-layers N: the first N layers attend densely (to the dense reference's K/V of the window, which those
    layers' inputs make exact), the rest through the sparse cache: Quest's paper keeps its first two layers dense.
--cross-head F: the cache's budget is F x the per-head average wanted; each (sequence, layer) keeps the G x K best
    of its heads' winners by the rule's score (sink and recent pages always), so a diffuse head takes more pages
    and a focused head fewer at the same total (Ada-KV's adaptive per-head budgets, applied to selection). Scores
    must be comparable across heads: the label / key-copy masses are (each row's mass sums to 1), Quest's bounds
    are not. Give --budgets F times the budget studied.
The exact-mass ceiling needs no change: bench_quality --key-channels head_dim --label-bits 0 scores every page by
its true attention mass under the current queries. Answers: docs/BENCHMARKS.md, "Probes and studies".
"""
from __future__ import annotations

import argparse
import dataclasses
import types


def dense_layers_scorer(scorer_cls, n: int):
    """A TeacherForcedScorer subclass whose first n layers attend densely to the window's dense K/V. Windows go
    to cache slots 0..W-1 in order (CacheManager.admit's order; n = num_layers reproduces dense exactly)."""
    import jax.numpy as jnp
    from ulacache_jax.models.attention import dense_attention

    @dataclasses.dataclass(frozen=True)
    class DenseFirst:
        inner: object
        k: object          # [n, S, T, KV, D]
        v: object

        def attend(self, cache, host, layer, q, k, v, pos, live, rank, **kw):
            cache, o, s = self.inner.attend(cache, host, layer, q, k, v, pos, live, rank, **kw)
            if layer < n:
                S, T = q.shape[0], self.k.shape[2]
                kpos = jnp.broadcast_to(jnp.arange(T)[None], (S, T))
                o = dense_attention(q, self.k[layer], self.v[layer], pos[:, None], kpos,
                                    k_valid=kpos <= pos[:, None]).astype(o.dtype)
            return cache, o, s

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class Scorer(scorer_cls):
        def dense_forward(self, ids):
            h, k, v = super().dense_forward(ids)
            self.kv_windows.append((k[:n], v[:n]))
            return h, k, v

        def score(self, windows, prefix):
            self.kv_windows, self._chunk = [], None      # the chunk program closes over this call's windows
            return super().score(windows, prefix)

        def _decode_chunk(self, params, state, host, toks, nsteps):
            S = self.config.max_seqs
            ks = jnp.stack([a for a, _ in self.kv_windows], 1)                  # [n, W, T, KV, D]
            vs = jnp.stack([b for _, b in self.kv_windows], 1)
            pad = ((0, 0), (0, S - ks.shape[1]), (0, 0), (0, 0), (0, 0))
            inner = self.ops
            self.ops = DenseFirst(inner, jnp.pad(ks, pad), jnp.pad(vs, pad))
            try:
                return super()._decode_chunk(params, state, host, toks, nsteps)
            finally:
                self.ops = inner

    return Scorer


def cross_head_selection(quest, page_topk, factor: int):
    """The selection module decode_layer calls, with select_pages keeping G x (select_pages / factor) winners per
    sequence across its heads."""
    import jax.numpy as jnp

    def select_pages(scores, flushed, *, select_pages, sink_pages, recent_pages, impl="ref"):
        sel = quest.select_pages(scores, flushed, select_pages=select_pages, sink_pages=sink_pages,
                                 recent_pages=recent_pages, impl=impl)                 # [S, G, K'] per head
        S, G, K = sel.shape
        valid = sel >= 0
        page = jnp.maximum(sel, 0)
        x = jnp.take_along_axis(scores.astype(jnp.float32), page, axis=-1)
        x = page_topk.candidate_scores(x, page, flushed[:, None, None], scores.shape[-1], sink=sink_pages,
                                       recent=recent_pages)                          # sink / recent: +inf
        x = jnp.where(valid, x, -jnp.inf).reshape(S, G * K)
        rank = jnp.argsort(jnp.argsort(-x, axis=-1, stable=True), axis=-1).reshape(S, G, K)
        return jnp.where(valid & (rank < G * (select_pages // factor)), sel, -1)

    mod = types.SimpleNamespace(**{k: getattr(quest, k) for k in dir(quest) if not k.startswith("__")})
    mod.select_pages = select_pages
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense-layers", type=int, default=0)
    ap.add_argument("--cross-head", type=int, default=0)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench_quality's arguments")
    args = ap.parse_args(argv)
    if args.dense_layers < 0 or args.cross_head < 0 or (args.dense_layers and args.cross_head):
        ap.error("give one of --dense-layers N >= 1 and --cross-head F >= 2")
    from scripts import bench_quality, scoring
    if args.dense_layers:
        scoring.TeacherForcedScorer = dense_layers_scorer(scoring.TeacherForcedScorer, args.dense_layers)
    if args.cross_head:
        from ulacache_jax.cache import decode_layer
        from ulacache_jax.cache.select import quest
        from ulacache_jax.pallas_kernels import page_topk
        decode_layer.selection = cross_head_selection(quest, page_topk, args.cross_head)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return bench_quality.main(rest)


if __name__ == "__main__":
    main()
