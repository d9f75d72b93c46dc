"""Query-aware page selection (Quest bound), per sequence and KV-head group.

Score of page p for group j: sum over the group's query heads h and dims d of max(q_hd * kmin_pd, q_hd * kmax_pd).
Since kmax >= kmin, max(q*kmin, q*kmax) = relu(q)*kmax + min(q, 0)*kmin, so summing over heads first gives
    score[p] = kmax[p] . sum_h relu(q_h) + kmin[p] . sum_h min(q_h, 0)
exactly: two mat-vecs over the summaries, a memory-bound read of 2/page_size of the K bytes. With
CacheConfig.summary_split = split > 1 each page holds `split` sub-page summaries (min/max over page_size // split
tokens each) and score[p] is the max of its sub-pages' bounds (2 * split / page_size of the K bytes read); selection
and transfer stay per page. The first
`sink_pages` and last `recent_pages` flushed pages always win; only flushed pages are candidates (unflushed tail
pages are always attended from the tail ring).
"""
from __future__ import annotations

from ulacache_jax.pallas_kernels import page_scores, page_topk
from ulacache_jax.pallas_kernels.page_scores import fold_queries


def ref_page_scores(q, kmin, kmax, split: int = 1):
    """q [B, Q, H, D]; kmin, kmax [B, G, P * split, g, D] (one layer's summaries) -> scores [B, G, P] fp32 (Quest
    bound; split > 1: the max over each page's sub-pages); the same math as the kernel's reference, which reads the
    summaries of every layer in place."""
    B, G, PS, g, D = kmin.shape
    qpos, qneg = fold_queries(q, G, g)
    return page_scores.ref_page_scores(kmin[:, None], kmax[:, None], qpos, qneg, layer=0, split=split)


def select_pages(scores, flushed, *, select_pages: int, sink_pages: int, recent_pages: int, impl: str = "ref"):
    """scores [B, G, P]; flushed [B] int32 candidate pages per sequence -> page ids [B, G, K] int32 (K =
    min(select_pages, P)), -1 for unused; every flushed page when flushed <= K. Order: by page id (ids first, then
    the -1s). impl: 'ref' (lax.top_k) or 'pallas' / 'auto' (pallas_kernels/page_topk.py, one kernel for the
    masking and the top-k: the same result)."""
    return page_topk.select_top_pages(scores, flushed, min(select_pages, scores.shape[-1]), sink=sink_pages,
                                      recent=recent_pages, impl=impl)
