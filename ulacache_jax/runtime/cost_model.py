"""attention="auto": sparse (UlaCache) or dense, chosen from a cost model of one decode step.

`resolve_attention` turns what the caller asked for ('auto', 'sparse', 'dense') into a `Decision` once, when a
Generator is built, from the batch (max_seqs), the max context, the model's shape, the cache's page size, budget
and HBM pool, and the device's memory; the backend is made from `Decision.kind`, so nothing after it sees 'auto'.
A sequence never changes path mid-decode (nor at admission: one Generator has one backend).

The model: seconds per decode step of B sequences, per rank (`CostModel.step_seconds`):
  dense   (W + B * T * kv_tok) / hbm_bw                                   + L * dense_layer_s
  sparse  (W + B * (A * kv_tok + summ)) / hbm_bw + miss / pcie_bw        + L * (sparse_layer_s
          + B * G * P * sparse_page_s + F * sparse_frame_s) + B * kern / score_kernel_bw
W: weight bytes a step reads (every layer + the LM head); T: context; kv_tok: K + V bytes of one token over all
layers; A: attended tokens (min(T, budget) + the tail pages); summ: one sequence's page summaries (min and max of
K per page, all layers; a key copy's or the labels' bytes are `kern` instead, read by the page-lse kernel at its
own measured rate); G: KV-head groups per rank; P: pages a group requests from the sieve a step (budget / page;
per-token selection: CacheConfig.shortlist_pages, more than the budget's, while A stays the budget's tokens); F: HBM
frames of the pool (the PB-LRU state the sieve reads grows with it); miss: (1 - hit) * B * L * G * P K+V pages a
step fetches over PCIe. No per-token row is in the fit: for it the page and PCIe terms are extrapolations. The
constants are a least-squares fit (relative error, `fit`) to the H200 decode rows of docs/benchmarks/decode.json
(the one-program pairs among them) and the issue 21 pairs; tests/test_cost_model.py checks the model against every
one of them and prints predicted vs measured. The hit rate is not predicted here:
`expected_hit_rate` reads it off PB-LRU's measured curve on a trained model's selections (pool frames / one
step's selection frames); the auto pool is `pool_headroom` times one step's selection frames.
"""
from __future__ import annotations

import dataclasses
import math

from ulacache_jax.cache.select.quest import Quest

KINDS = ("sparse", "dense")
CHOICES = ("auto",) + KINDS
TAIL_TOKENS_PAGES = 2     # tail pages a sparse step attends beside the budget (config.TAIL_PAGES)
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The constants of the step model (module docstring). Defaults: `fit` to one H200's decode rows of the
    Llama-3.1-8B shape (bf16, budget 2048, page 64, contexts 8K-256K, batches 1-27, pools 1/16-1/2 of the KV);
    the per-layer costs are taken as independent of the model's width, so other models are extrapolations."""
    hbm_bytes_per_s: float = 4.29e12      # weights + K/V + summaries read (cuDNN alone reads at 4.42-4.48 TB/s)
    dense_layer_s: float = 38.6e-6        # per layer and step, beside the bytes: norms, RoPE, launches
    sparse_layer_s: float = 77.5e-6       # the same for sparse: + append, scores, top-k, sieve, plan, fetch launch
    sparse_page_s: float = 21.3e-9        # per selected page (one sequence, group and layer): 5.5 us a sequence
    sparse_frame_s: float = 0.050e-9      # per HBM pool frame and layer (the sieve reads the PB-LRU state)
    pcie_bytes_per_s: float = 48.2e9      # missed pages host -> HBM (the fetch kernel alone: 51 GB/s)
    # the page log-sum-exp kernel's rate over the key copy / labels a rule's `kernel_bytes` names: it is bound by
    # instructions (unpack, a product and a sum per query row and channel), far below HBM; measured alone at the 8B
    # shape (labels 64 @ 4 bits, codes to floats by bits, one page a program at 1 warp; bench_labels, BENCHMARKS.md).
    # 4-bit labels now take the tensor-core kernel (page_lse.label_lse_mma), 1.9x this kernel's rate on an H100 in
    # one call; not refit here until an H200 measures it, so for 4-bit labels this rate errs slow (auto leans dense)
    score_kernel_bytes_per_s: float = 597e9
    # PB-LRU hit rate by pool frames / one step's selection frames, on SmolLM2's own selections over 8K-token
    # windows on the H200 (BENCHMARKS.md, quality section: 58.9% at 1x, 94.5% at 1.25x, 97.9% at 1.5x, 99.3% at
    # 2x; CPU's 1K windows gave 59.5 / 95.3 / 98.4 / 99.0%); linear in between, 0 at 0
    hit_curve: tuple[tuple[float, float], ...] = ((0.0, 0.0), (1.0, 0.589), (1.25, 0.945), (1.5, 0.979),
                                                 (2.0, 0.993))
    pool_headroom: float = 1.5            # auto pool: this many times one step's selection frames
    hbm_usable: float = 0.95              # of the device's memory, for weights + a dense cache (the rest: activations)
    default_hbm_bytes: int = 139 * 2**30  # where the device reports no memory: an H200's (the constants' device)
    dense_margin: float = 0.03            # sparse must be predicted this much faster (dense is exact; run spread ~3%)

    # ---- bytes ----------------------------------------------------------------------------------------------
    @staticmethod
    def weight_bytes(mc, itemsize: int, tp: int = 1) -> float:
        """Weight bytes one rank reads a step: its share of every layer's projections and MLP, and the whole LM
        head (replicated under TP; the embedding reads only B rows)."""
        e, f, h, k, d = mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
        per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * f
        return (mc.num_layers * per_layer / tp + mc.vocab_size * e) * itemsize

    @staticmethod
    def groups(mc) -> int:
        """KV-head groups of the cache (generator.default_cache_config: one per KV head, at most 16)."""
        return mc.num_kv_heads if mc.num_kv_heads <= 16 else 16

    def step_frames(self, mc, *, batch: int, token_budget: int, page_size: int, tp: int = 1) -> int:
        """HBM frames one step's selections occupy on a rank (every layer): the pool's unit."""
        return batch * mc.num_layers * max(1, self.groups(mc) // tp) * (token_budget // page_size)

    def expected_hit_rate(self, mc, *, batch: int, context: int, token_budget: int, page_size: int,
                          pool_frames: int, tp: int = 1) -> float:
        """The HBM hit rate a pool of `pool_frames` frames is expected to reach: 1 when it holds every page, else
        read off `hit_curve` at pool / one step's selection frames."""
        step = self.step_frames(mc, batch=batch, token_budget=token_budget, page_size=page_size, tp=tp)
        every = batch * mc.num_layers * max(1, self.groups(mc) // tp) * math.ceil(context / page_size)
        if pool_frames >= every:
            return 1.0
        r = pool_frames / step
        pts = self.hit_curve
        if r >= pts[-1][0]:
            return pts[-1][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if r <= x1:
                return y0 + (y1 - y0) * (r - x0) / (x1 - x0)
        return pts[-1][1]

    def auto_pool_frames(self, mc, *, batch: int, context: int, token_budget: int, page_size: int,
                         tp: int = 1) -> int:
        """The pool attention='auto' sizes: `pool_headroom` x one step's selection frames, at most every page."""
        step = self.step_frames(mc, batch=batch, token_budget=token_budget, page_size=page_size, tp=tp)
        every = batch * mc.num_layers * max(1, self.groups(mc) // tp) * math.ceil(context / page_size)
        return min(every, math.ceil(self.pool_headroom * step))

    # ---- time -----------------------------------------------------------------------------------------------
    def step_terms(self, kind: str, mc, *, batch: int, context: int, token_budget: int, page_size: int,
                   itemsize: int, tp: int = 1, pool_frames: int | None = None,
                   hit_rate: float | None = None, rule=None,
                   kv_itemsize: float | None = None, fetch_budget: int | None = None) -> dict[str, float]:
        """The step model's terms (module docstring) in the units their constants multiply: 'hbm' bytes, 'pcie'
        bytes, 'layer' (L), 'page' (L * B * G * P), 'frame' (L * F). pool_frames None: the auto pool; hit_rate
        None: `expected_hit_rate` of that pool; rule: the selection rule object (CacheConfig.selection_rule: Quest
        at any summary split, the key copy, labels, a two-stage rule or one of a user's), whose `step_bytes` the
        scores read every step, `kernel_bytes` of them through the page-lse kernel (None: Quest). kv_itemsize: bytes a
        stored K/V element takes (the page format's: CacheConfig.page_bytes per element, scales included; 1 and a
        bit for fp8), None: `itemsize`; the weights and the selection metadata stay at `itemsize`. fetch_budget:
        tokens of the pages a group requests a step (per-token selection: CacheConfig.shortlist_pages * page_size),
        None: token_budget; the pool, hit rate, page and PCIe terms count those pages, the K/V read the budget's."""
        L, B, T = mc.num_layers, batch, context
        kv_heads = mc.num_kv_heads / tp
        kv_isz = itemsize if kv_itemsize is None else kv_itemsize
        kv_tok = 2 * L * kv_heads * mc.head_dim * kv_isz
        w = self.weight_bytes(mc, itemsize, tp)
        if kind == "dense":
            return {"hbm": w + B * T * kv_tok, "pcie": 0.0, "layer": L, "page": 0.0, "frame": 0.0, "score": 0.0}
        if kind != "sparse":
            raise ValueError(f"kind = {kind!r} must be one of {KINDS}")
        G = max(1, self.groups(mc) // tp)
        fetched = token_budget if fetch_budget is None else fetch_budget
        P = fetched // page_size
        if pool_frames is None:
            pool_frames = self.auto_pool_frames(mc, batch=B, context=T, token_budget=fetched,
                                                page_size=page_size, tp=tp)
        if hit_rate is None:
            hit_rate = self.expected_hit_rate(mc, batch=B, context=T, token_budget=fetched, page_size=page_size,
                                              pool_frames=pool_frames, tp=tp)
        attended = min(T, token_budget + TAIL_TOKENS_PAGES * page_size)
        if rule is None:
            rule = Quest()
        rule_shape = dict(context=T, num_layers=L, kv_heads=kv_heads, head_dim=mc.head_dim, itemsize=itemsize,
                          page_size=page_size)
        kern = rule.kernel_bytes(**rule_shape)                              # read by the page-lse kernel
        summ = rule.step_bytes(**rule_shape) - kern                         # the rest of what the scores read
        page_kv = 2 * page_size * (kv_heads / G) * mc.head_dim * kv_isz            # K + V of one group's page
        return {"hbm": w + B * (attended * kv_tok + summ), "pcie": (1.0 - hit_rate) * B * L * G * P * page_kv,
                "layer": L, "page": L * B * G * P, "frame": L * pool_frames, "score": B * kern}

    def step_seconds(self, kind: str, mc, **shape) -> float:
        """Seconds of one decode step of `kind` ('sparse' or 'dense'); shape: as `step_terms`."""
        t = self.step_terms(kind, mc, **shape)
        layer = self.dense_layer_s if kind == "dense" else self.sparse_layer_s
        return (t["hbm"] / self.hbm_bytes_per_s + t["pcie"] / self.pcie_bytes_per_s + t["layer"] * layer
                + t["page"] * self.sparse_page_s + t["frame"] * self.sparse_frame_s
                + t["score"] / self.score_kernel_bytes_per_s)

    def tokens_per_s(self, kind: str, mc, **shape) -> float:
        """Decode tokens/s of a full batch: batch / step seconds."""
        return shape["batch"] / self.step_seconds(kind, mc, **shape)

    def dense_hbm_bytes(self, mc, *, max_seqs: int, max_context: int, itemsize: int, tp: int = 1,
                        kv_itemsize: float | None = None) -> float:
        """HBM one rank needs for the dense path: weights + every K/V of max_seqs x max_context tokens (at
        kv_itemsize bytes an element, None: itemsize)."""
        kv_isz = itemsize if kv_itemsize is None else kv_itemsize
        kv = 2 * mc.num_layers * max_seqs * max_context * (mc.num_kv_heads / tp) * mc.head_dim * kv_isz
        return self.weight_bytes(mc, itemsize, tp) + kv


def fit(rows, mc) -> CostModel:
    """A CostModel whose step constants are the least-squares fit (relative error) of `rows`: dicts with
    attention, batch, context, budget, page, tokens_per_s and, for sparse, pool_frames and hit_rate (the rows
    scripts/bench_decode.py writes), all of model `mc` in bfloat16 at tp 1. Dense rows fit hbm_bytes_per_s and
    dense_layer_s; sparse rows, given that bandwidth, the sparse constants and pcie_bytes_per_s."""
    import numpy as np
    base = CostModel()

    def terms(r):
        return base.step_terms(r["attention"], mc, batch=r["batch"], context=r["context"], token_budget=r["budget"],
                               page_size=r["page"], itemsize=2, pool_frames=r.get("pool_frames"),
                               hit_rate=r.get("hit_rate"))

    def solve(a, y):
        w = 1.0 / y                                 # relative error: every row counts alike
        x, *_ = np.linalg.lstsq(np.asarray(a) * w[:, None], y * w, rcond=None)
        return x

    dense = [r for r in rows if r["attention"] == "dense"]
    sparse = [r for r in rows if r["attention"] == "sparse"]
    if len(dense) < 2 or len(sparse) < 4:
        raise ValueError(f"fit needs >= 2 dense and >= 4 sparse rows, got {len(dense)} and {len(sparse)}")
    y = np.array([r["batch"] / r["tokens_per_s"] for r in dense])
    inv_bw, layer = solve([[terms(r)["hbm"], terms(r)["layer"]] for r in dense], y)
    ts = [terms(r) for r in sparse]
    y = np.array([r["batch"] / r["tokens_per_s"] for r in sparse]) - np.array([t["hbm"] for t in ts]) * inv_bw
    s_layer, s_page, s_frame, inv_pcie = solve([[t["layer"], t["page"], t["frame"], t["pcie"]] for t in ts],
                                               np.maximum(y, 1e-9))
    return dataclasses.replace(base, hbm_bytes_per_s=float(1 / inv_bw), dense_layer_s=float(layer),
                               sparse_layer_s=float(s_layer), sparse_page_s=float(s_page),
                               sparse_frame_s=float(s_frame), pcie_bytes_per_s=float(1 / inv_pcie))


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which attention runs and why. kind: 'sparse' or 'dense' (what the backend is built for); requested:
    'auto', 'sparse' or 'dense'; tokens_per_s: the model's prediction per kind at a full batch of the max
    context (dense None where its cache does not fit); hit_rate and pool_frames: what the sparse prediction
    assumed; hbm_bytes / hbm_source: the device memory the choice was made against."""
    kind: str
    requested: str
    reason: str
    tokens_per_s: dict
    hit_rate: float
    pool_frames: int
    hbm_bytes: int
    hbm_source: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line: 'auto -> sparse: reason (predicted sparse X tok/s, dense Y tok/s)'."""
        pred = ", ".join(f"{k} {'does not fit' if v is None else f'{v:.0f} tok/s'}"
                         for k, v in self.tokens_per_s.items())
        return f"{self.requested} -> {self.kind}: {self.reason} (predicted {pred})"


def _positive_int(name: str, v) -> int:
    integral = not isinstance(v, bool) and (isinstance(v, int) or hasattr(v, "__index__"))
    if not integral or int(v) < 1:
        raise ValueError(f"{name} = {v!r} must be an int >= 1")
    return int(v)


def itemsize(dtype) -> int:
    """Bytes per element of a cache dtype given by name ('bfloat16', ...) or as a numpy/jax dtype."""
    size = getattr(dtype, "itemsize", None)
    if size is None:
        name = str(getattr(dtype, "name", dtype))
        if name not in _ITEMSIZE:
            raise ValueError(f"dtype = {dtype!r} must be one of {sorted(_ITEMSIZE)}")
        size = _ITEMSIZE[name]
    return int(size)


def choose_attention(model_config, *, max_seqs: int, max_context: int, token_budget: int, page_size: int, dtype,
                     hbm_bytes: int, tp: int = 1, pool_frames: int | None = None, requested: str = "auto",
                     hbm_source: str = "given", rule=None, kv_itemsize: float | None = None,
                     fetch_budget: int | None = None, costs: CostModel = CostModel()) -> Decision:
    """The attention for a Generator of max_seqs slots of up to max_context tokens (a full batch at the max
    context: the decision holds for its whole life). Dense when its cache fits in `hbm_bytes` and it is predicted
    no slower (within `costs.dense_margin`), or when every page would be attended anyway (max_context <=
    token_budget: sparse equals dense there, at more cost); sparse otherwise. pool_frames: the sparse cache's HBM
    frames per rank (None: the auto pool). requested 'sparse'/'dense': that kind, with the predictions beside it.
    kv_itemsize: bytes of a stored K/V element (the page format's, `CostModel.step_terms`), None: dtype's.
    fetch_budget: tokens of the pages a group requests a step (per-token selection's), None: token_budget."""
    mc = model_config
    if requested not in CHOICES:
        raise ValueError(f"attention = {requested!r} must be one of {CHOICES}")
    S, T = _positive_int("max_seqs", max_seqs), _positive_int("max_context", max_context)
    budget, page, tp = (_positive_int("token_budget", token_budget), _positive_int("page_size", page_size),
                        _positive_int("tp", tp))
    hbm = _positive_int("hbm_bytes", hbm_bytes)
    if budget % page:
        raise ValueError(f"token_budget = {budget} must be a multiple of page_size = {page}")
    isz = itemsize(dtype)
    fetched = budget if fetch_budget is None else _positive_int("fetch_budget", fetch_budget)
    shape = dict(batch=S, context=T, token_budget=budget, page_size=page, itemsize=isz, tp=tp,
                 kv_itemsize=kv_itemsize, fetch_budget=fetched)
    if pool_frames is None:
        pool_frames = costs.auto_pool_frames(mc, batch=S, context=T, token_budget=fetched, page_size=page, tp=tp)
    pool_frames = _positive_int("pool_frames", pool_frames)
    hit = costs.expected_hit_rate(mc, batch=S, context=T, token_budget=fetched, page_size=page,
                                  pool_frames=pool_frames, tp=tp)
    sparse = costs.tokens_per_s("sparse", mc, pool_frames=pool_frames, hit_rate=hit, rule=rule, **shape)
    need = costs.dense_hbm_bytes(mc, max_seqs=S, max_context=T, itemsize=isz, tp=tp, kv_itemsize=kv_itemsize)
    usable = costs.hbm_usable * hbm
    fits = need <= usable
    dense = costs.tokens_per_s("dense", mc, **shape)
    pred = {"sparse": sparse, "dense": dense if fits else None}
    gib = 2**30
    if requested != "auto":
        kind, reason = requested, "asked for"
    elif not fits:
        kind = "sparse"
        reason = (f"the dense cache ({need / gib:.1f} GiB with the weights, per rank) exceeds "
                  f"{costs.hbm_usable:.0%} of the device's {hbm / gib:.1f} GiB")
    elif T <= budget:
        kind, reason = "dense", (f"max_context {T} <= token_budget {budget}: every page is attended, sparse would "
                                 "equal dense at more cost")
    elif sparse > dense * (1 + costs.dense_margin):
        kind, reason = "sparse", f"sparse predicted at {sparse / dense:.2f}x dense's tokens/s at {S} x {T} tokens"
    elif dense >= sparse:
        kind, reason = "dense", (f"dense predicted at {dense / sparse:.2f}x sparse's tokens/s at {S} x {T} tokens "
                                 "(the cache fits in HBM)")
    else:   # sparse ahead by less than the margin: dense is exact, so it takes the near tie
        kind, reason = "dense", (f"sparse predicted at only {sparse / dense:.2f}x dense's tokens/s at {S} x {T} "
                                 f"tokens, within the {costs.dense_margin:.0%} margin (the cache fits in HBM)")
    return Decision(kind=kind, requested=requested, reason=reason, tokens_per_s=pred, hit_rate=hit,
                    pool_frames=pool_frames, hbm_bytes=hbm, hbm_source=hbm_source)


def hbm_capacity(device=None, costs: CostModel = CostModel()) -> tuple[int, str]:
    """-> (bytes, where from): the allocator's limit of `device` (default: jax's first) where it reports one (GPU
    memory_stats 'bytes_limit'), else `costs.default_hbm_bytes`, an H200's, which the constants describe."""
    if device is None:
        import jax
        device = jax.devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:   # noqa: BLE001 - CPU devices may not report memory stats
        limit = None
    if limit:
        return int(limit), f"{device.device_kind} memory_stats bytes_limit"
    return costs.default_hbm_bytes, f"default (an H200's; {device.platform} reports no memory limit)"


def pool_headroom(attention, costs: CostModel = CostModel()) -> float:
    """The HBM pool a default-sized cache gets, in frames per frame of one step's selections
    (generator.default_cache_config's pool_headroom): 'auto' sizes it (`costs.pool_headroom`); 'sparse' and
    'dense' keep the library default of 1 (dense has no pool)."""
    if isinstance(attention, Decision) or attention in KINDS:
        return 1.0
    if attention != "auto":
        raise ValueError(f"attention = {attention!r} must be one of {CHOICES}")
    return costs.pool_headroom


def resolve_attention(attention, model_config, cache_config, device=None, costs: CostModel = CostModel()) -> Decision:
    """The one place 'auto' is resolved: `attention` ('auto', 'sparse', 'dense', or a Decision made earlier for
    this config, returned as is) for a cache of `cache_config` (max_seqs, max_context, budget, page, dtype, tp,
    its HBM frames) on `device` (memory: `hbm_capacity`)."""
    if isinstance(attention, Decision):
        if attention.kind not in KINDS:
            raise ValueError(f"Decision.kind = {attention.kind!r} must be one of {KINDS}")
        return attention
    if attention not in CHOICES:
        raise ValueError(f"attention = {attention!r} must be one of {CHOICES}")
    c = cache_config
    hbm, source = hbm_capacity(device, costs)
    return choose_attention(model_config, max_seqs=c.max_seqs, max_context=c.max_context,
                            token_budget=c.token_budget, page_size=c.page_size, dtype=c.dtype, hbm_bytes=hbm,
                            tp=c.tp, pool_frames=c.num_frames, requested=attention, hbm_source=source,
                            rule=c.selection_rule, costs=costs, fetch_budget=c.shortlist_pages * c.page_size,
                            kv_itemsize=c.page_bytes / (c.page_size * c.kv_heads_per_group * c.head_dim))
