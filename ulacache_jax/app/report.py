"""The run report of an Engine: throughput, latency, HBM hit rate, PCIe bytes, footprints; JSON, text and a PNG.

What the numbers mean (labels in the report say the same):
- Tokens arrive per decode chunk: one chunk runs `page_size` decode steps for the whole slot batch with one host
  sync at the end. So the inter-token latency of a request is measured per delivery: (time since its previous
  delivery) / (tokens in this delivery), counted once per token. It includes the prefills of other requests that
  ran between two of its chunks (the price of continuous batching). The decode step time is chunk time /
  page_size (every step of a chunk runs, finished slots masked).
- Compilation: steps that compiled (the first decode chunk, the first prompt of each prompt-length bucket) are
  reported as `compile_steps_s` and left out of the steady-state rates and latencies; the end-to-end rate
  includes them.
- HBM hit rate: selected (flushed) pages found in the HBM frame pool / all selected pages, summed over layers,
  groups and steps. Tail pages (the last, unflushed ones) are read from the HBM tail ring and not counted.
- PCIe bytes: host->HBM = fetched pages x page_bytes x 2 (K and V); HBM->host write-through = pages completed
  per (layer, group) of each sequence x page_bytes x 2 (prefill and decode flushes; on CPU both are copies
  within host memory, the same code path).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from ulacache_jax.cache.config import CacheConfig


def _pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else None


def _ms(x):
    return None if x is None else 1e3 * x


def build_report(engine, requests=None, *, wall_s: float | None = None, model_label: str = "",
                 random_weights: bool = False, param_bytes: int | None = None, extra: dict | None = None,
                 load_s: float | None = None) -> dict:
    """A JSON-able dict. `requests`: the finished Requests to summarise (default: those the engine still holds).
    load_s: seconds from the process's start to the engine's (model load, cache build); the wall time splits into
    it, the steps that compiled, the steady steps and the rest (idle between steps, writing results)."""
    c: CacheConfig = engine.config
    backend = engine.gen.backend        # the kind that ran, resolved once by backends.make_backend
    reqs = list(engine.requests.values()) if requests is None else list(requests)
    wall = engine.elapsed() if wall_s is None else wall_s
    tl = engine.timeline
    compiled = {r.index for r in tl if r.compiled}

    ok = [r for r in reqs if r.finish_reason != "error"]
    reasons = {k: sum(r.finish_reason == k for r in reqs) for k in ("stop", "length", "error")}
    gen_tokens = sum(len(r.tokens) for r in ok)
    prompt_tokens = sum(len(r.prompt_ids) for r in ok)

    itl, ttft = [], []
    for r in ok:
        if r.t_first_token is not None:
            ttft.append(r.t_first_token - r.t_added)
        for (t_prev, _, _), (t, n, step) in zip(r.deliveries, r.deliveries[1:]):
            if step not in compiled and n > 0:
                itl.extend([(t - t_prev) / n] * n)
    steady = [r for r in tl if not r.compiled]
    chunk = [r.decode_s for r in steady if r.decode_steps]
    step_t = [r.decode_s / r.decode_steps for r in steady if r.decode_steps]
    dec_tok = sum(r.decode_tokens for r in steady)
    dec_s = sum(r.decode_s for r in steady)
    pre_tok = sum(r.prefill_tokens for r in tl if not r.prefill_compiled)
    pre_s = sum(r.prefill_s for r in tl if not r.prefill_compiled)
    compile_s = sum(r.t_end - r.t_start for r in tl if r.compiled)

    hits, misses, overflow, fetched = (sum(getattr(r, k) for r in tl) for k in ("hits", "misses", "overflow",
                                                                                   "fetched"))
    groups = c.num_layers * c.num_groups
    written = sum(groups * ((len(r.prompt_ids) + max(len(r.tokens) - 1, 0)) // c.page_size) for r in ok)
    sparse = backend.host_tier          # pages cross PCIe: hit rates and PCIe bytes mean something
    prefix = engine.prefix_stats() if hasattr(engine, "prefix_stats") else None
    if prefix is not None:
        written -= groups * (prefix.hit_tokens // c.page_size)      # attached pages are not written again
    t_total = max(tl[-1].t_end if tl else 0.0, 1e-9)
    cum, timeline = 0, []
    for r in tl:
        cum += r.tokens
        dt = max(r.t_end - r.t_start, 1e-9)
        sel = r.hits + r.misses
        timeline.append({"step": r.index, "t_end_s": round(r.t_end, 6), "step_s": round(dt, 6),
                         "tokens": r.tokens, "tokens_per_s": r.tokens / dt,
                         "cum_tokens_per_s": cum / max(r.t_end, 1e-9),
                         "hit_rate": (r.hits / sel) if sel else None, "fetched_pages": r.fetched,
                         "prefills": r.prefills, "live_slots": r.live_slots, "queued": r.queued,
                         "running": r.running, "compiled": r.compiled})

    rep = {
        "model": model_label,
        "random_weights": random_weights,
        "attention": backend.kind,
        "host_tier": backend.host_tier,
        "cache_config": dataclasses.asdict(c),
        "selection": describe_selection(c) if sparse else None,
        "requests": {"total": len(reqs), "ok": len(ok), "failed": reasons["error"], "finish_reasons": reasons},
        "tokens": {"prompt": prompt_tokens, "generated": gen_tokens},
        "wall_s": wall,
        "engine_s": t_total,
        "compile_steps_s": compile_s,
        "compile_steps": len(compiled),
        "load_s": load_s,
        "steady_steps_s": sum(r.t_end - r.t_start for r in steady),
        "throughput": {
            "generated_tokens_per_s": gen_tokens / wall if wall > 0 else None,
            "decode_tokens_per_s_steady": dec_tok / dec_s if dec_s > 0 else None,
            "prefill_tokens_per_s_steady": pre_tok / pre_s if pre_s > 0 else None,
            "note": "generated_tokens_per_s: all generated tokens / wall time, compilation included; *_steady: "
                    "steps that compiled left out",
        },
        "latency_ms": {
            "inter_token_p50": _ms(_pct(itl, 50)), "inter_token_p99": _ms(_pct(itl, 99)),
            "decode_step_p50": _ms(_pct(step_t, 50)), "decode_step_p99": _ms(_pct(step_t, 99)),
            "chunk_p50": _ms(_pct(chunk, 50)), "chunk_p99": _ms(_pct(chunk, 99)),
            "ttft_p50": _ms(_pct(ttft, 50)), "ttft_p99": _ms(_pct(ttft, 99)),
            "tokens_per_chunk": c.page_size,
            "note": f"tokens arrive per chunk of page_size = {c.page_size} decode steps (one host sync); "
                    "inter_token = interval between a request's deliveries / tokens delivered, per token "
                    "(includes other requests' prefills in between); decode_step = chunk time / page_size; "
                    "ttft includes queue wait; steps that compiled left out (ttft excepted)",
        },
        "cache": {
            "hbm_hit_rate": (hits / (hits + misses)) if sparse and hits + misses else None,
            "selected_pages": hits + misses, "hits": hits, "misses": misses,
            "overflow_reads": overflow, "fetched_pages": fetched,
            "page_bytes": c.page_bytes,
            "pcie_h2d_bytes": fetched * c.page_bytes * 2 if sparse else 0,
            "pcie_d2h_writethrough_bytes": written * c.page_bytes * 2 if sparse else 0,
            "note": "hit rate over selected flushed pages (tail-ring pages not counted); h2d = fetched pages x "
                    "page_bytes x 2 (K and V); d2h = completed pages written through to the host pool",
        },
        "footprint": {**backend.footprint(c), "param_bytes": param_bytes},
        "prefix_cache": None if prefix is None else {
            "enabled": engine.gen.prefixes is not None,
            "prefix_cache_hit_tokens": prefix.hit_tokens, "prefill_tokens": prefix.prefill_tokens,
            "hits": prefix.hits, "lookups": prefix.lookups, "evicted": prefix.evicted,
            "host_pages_saved": prefix.saved_host_pages * c.tp,
            "host_bytes_saved": prefix.saved_host_pages * c.tp * c.page_bytes * 2,
            "note": "prefix_cache_hit_tokens: prompt tokens attached from stored prefixes instead of prefilled; "
                    "host_bytes_saved: host pages (K and V, all ranks) those prompts did not allocate (sparse; "
                    "dense copies the rows: 0)",
        },
        "timeline": timeline,
        "request_timeline": request_timeline(reqs, engine.t0),
    }
    if hasattr(engine, "occupancy"):   # the pools' use at the end (serve exports it live: app/metrics.py)
        rep["occupancy_at_end"] = engine.occupancy()
    spec = getattr(engine, "spec", None)
    if spec is not None:   # the figures `ulacache serve` exports as spec_*_tokens (app/metrics.py)
        rep["speculative"] = {"method": spec.spec.method, "proposed_tokens": int(spec.proposed),
                              "accepted_tokens": int(spec.accepted),
                              "acceptance_rate": spec.acceptance_rate if spec.proposed else None}
        draft = getattr(spec, "draft", None)
        if draft is not None:   # the draft model's (exact mode: the sparse drafter's) own cache, beside the footprint
            dfp = draft.backend.footprint(draft.config)
            rep["speculative"]["draft_cache"] = {"attention": draft.attention, "hbm_bytes": dfp["hbm_bytes"],
                                                 "host_bytes": dfp["host_bytes"]}
    if extra:
        rep.update(extra)
    return rep


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _f(x, fmt="{:.2f}", none="n/a") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _time_line(rep: dict) -> str:
    """Where the wall time went: load (model and cache, before the engine), steps that compiled (the compile and
    the step's own work: its prefill and a whole decode chunk), steady steps, and the rest."""
    wall, comp = rep["wall_s"], rep["compile_steps_s"]
    load, steady = rep.get("load_s"), rep.get("steady_steps_s")
    if load is None or steady is None:
        return f"  time:     {wall:.2f} s wall, of which {comp:.2f} s in {rep['compile_steps']} steps that compiled"
    rest = max(0.0, wall - load - comp - steady)
    return (f"  time:     {wall:.2f} s wall = load {load:.2f} s (model, cache) + {comp:.2f} s in "
            f"{rep['compile_steps']} steps that compiled (compile + the steps' own prefill / decode chunk) + "
            f"{steady:.2f} s steady steps + {rest:.2f} s other (between steps, writing results)")


def describe_selection(c: CacheConfig) -> str:
    """The page-selection rule in words, for the report: its name, and for the key copy and the labels their
    channels, bits and where the channels come from."""
    rule = c.selection_rule
    if c.selection is not None or not c.key_channels:
        return rule.name
    bits = f"{c.label_bits}-bit" if c.label_bits else c.dtype
    source = ("an offline table" if c.channel_table is not None else
              f"each prompt's first {rule.calibration_tokens(c)} tokens")
    return f"{rule.name}: {c.key_channels} of {c.head_dim} key channels, {bits}, chosen from {source}"


def format_report(rep: dict) -> str:
    c = rep["cache_config"]
    q, tp, lat, ca, fp = rep["requests"], rep["throughput"], rep["latency_ms"], rep["cache"], rep["footprint"]
    lines = [
        "=" * 78,
        f"ulacache report: {rep['model']}" + ("   [RANDOM WEIGHTS: output text is gibberish]" if rep["random_weights"]
                                              else ""),
        f"  attention {rep['attention']}"
        + (f" (TP {c['tp']} ranks; HBM frames and host pages per rank)" if c["tp"] > 1 else "")
        + f"; page_size {c['page_size']}, token_budget {c['token_budget']}, "
        f"max_seqs {c['max_seqs']}, max context {c['max_pages_per_seq'] * c['page_size']} tokens, "
        f"HBM frames {c['num_buckets'] * c['slots_per_bucket']}, host pages {c['host_pages']}, dtype {c['dtype']}"
        + (f", kv_dtype {c['kv_dtype']}" if c.get("kv_dtype", "auto") != "auto" else ""),
        *([f"  selection: {rep['selection']}"] if rep.get("selection") else []),
        f"  requests: {q['total']} ({q['ok']} ok, {q['failed']} failed; finish reasons {q['finish_reasons']})",
        f"  tokens:   {rep['tokens']['prompt']} prompt, {rep['tokens']['generated']} generated",
        _time_line(rep),
        f"  throughput: {_f(tp['generated_tokens_per_s'], '{:.1f}')} generated tok/s end to end; steady decode "
        f"{_f(tp['decode_tokens_per_s_steady'], '{:.1f}')} tok/s, "
        f"prefill {_f(tp['prefill_tokens_per_s_steady'], '{:.0f}')} tok/s",
        f"  inter-token latency (per delivery / tokens; tokens arrive in chunks of {lat['tokens_per_chunk']} steps): "
        f"p50 {_f(lat['inter_token_p50'])} ms, p99 {_f(lat['inter_token_p99'])} ms",
        f"  decode step (chunk / page_size): p50 {_f(lat['decode_step_p50'])} ms, p99 {_f(lat['decode_step_p99'])} ms;"
        f" chunk p50 {_f(lat['chunk_p50'])} ms; TTFT (incl. queue) p50 {_f(lat['ttft_p50'], '{:.0f}')} ms, "
        f"p99 {_f(lat['ttft_p99'], '{:.0f}')} ms",
        f"  HBM hit rate {_f(ca['hbm_hit_rate'], '{:.3f}')} "
        f"({ca['hits']} hits / {ca['selected_pages']} selected pages, "
        f"{ca['overflow_reads']} overflow reads)",
        f"  PCIe: host->HBM {_fmt_bytes(ca['pcie_h2d_bytes'])} "
        f"({ca['fetched_pages']} pages x {ca['page_bytes']} B x 2),"
        f" HBM->host write-through {_fmt_bytes(ca['pcie_d2h_writethrough_bytes'])}",
        f"  footprint: HBM {_fmt_bytes(fp['hbm_bytes'])} KV cache"
        + (f" + {_fmt_bytes(fp['param_bytes'])} params" if fp.get("param_bytes") else "")
        + f", host {_fmt_bytes(fp['host_bytes'])}",
    ]
    pc = rep.get("prefix_cache")
    if pc and pc["enabled"]:
        lines.append(f"  shared prefixes: prefix_cache_hit_tokens {pc['prefix_cache_hit_tokens']} (prompt tokens "
                     f"attached, not prefilled; {pc['prefill_tokens']} prefilled), host memory saved "
                     f"{_fmt_bytes(pc['host_bytes_saved'])}")
    sp = rep.get("speculative")
    if sp:
        dc = sp.get("draft_cache")
        lines.append(f"  speculative ({sp['method']}): {sp['accepted_tokens']} of {sp['proposed_tokens']} draft "
                     f"tokens accepted (rate {_f(sp['acceptance_rate'], '{:.3f}')})"
                     + (f"; draft cache ({dc['attention']}) HBM {_fmt_bytes(dc['hbm_bytes'])}, host "
                        f"{_fmt_bytes(dc['host_bytes'])}" if dc else ""))
    if rep.get("input_errors"):
        lines.append(f"  input errors: {len(rep['input_errors'])} lines (see stderr / the output file)")
    lines.append("=" * 78)
    return "\n".join(lines)


def write_json(rep: dict, path: str | os.PathLike) -> None:
    """Written to a temp file beside `path` and renamed over it: a crash leaves the old report or the new one."""
    from ulacache_jax.app.jsonl_io import atomic_write_bytes
    atomic_write_bytes(path, (json.dumps(rep, indent=1, default=str) + "\n").encode())


def plot_timeline(rep: dict, path: str | os.PathLike, *, max_gantt_rows: int = 64) -> None:
    """PNG of a run at a glance, three panels on one time axis (seconds since the process started: the load before
    the engine is shaded, where the report has `load_s`; else since the engine started):
    - requests: one row each (queued, prefill, decode, finished), the first `max_gantt_rows` of them (the panel
      title says when more ran), so hundreds of requests stay fast and readable;
    - generated tokens/s per step;
    - HBM hit rate per decode chunk (sparse only; dense says so).
    Steps that compiled are hatched in every panel and their points drawn unjoined (their rates include the
    compile). Lines break where the engine was idle between steps for more than twice the median step
    (`break_gaps`), so no line is drawn across an idle period. Written to a temp file and renamed, like the
    report."""
    if isinstance(max_gantt_rows, bool) or not isinstance(max_gantt_rows, int) or max_gantt_rows < 1:
        raise ValueError(f"max_gantt_rows = {max_gantt_rows!r} must be an int >= 1")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the axis starts at the process's start: the engine's times shifted by the load before it (shaded)
    off = float(rep.get("load_s") or 0.0)
    tl = [dict(r, t_end_s=r["t_end_s"] + off) for r in rep.get("timeline") or []]
    reqs = sorted(({k: (v + off if k.startswith("t_") and k.endswith("_s") and v is not None else v)
                    for k, v in r.items()} for r in rep.get("request_timeline") or []), key=lambda r: r["id"])
    shown = reqs[:max_gantt_rows]
    t_end = np.array([r["t_end_s"] for r in tl], np.float64)             # [steps]
    t_start = t_end - np.array([r["step_s"] for r in tl], np.float64)    # [steps]
    compiled = np.array([bool(r["compiled"]) for r in tl], bool)         # [steps]
    t_max = max([float(t_end.max()) if tl else 0.0, off + float(rep.get("engine_s") or 0.0)]
                + [r[k] for r in shown for k in ("t_added_s", "t_finished_s") if r.get(k) is not None]) or 1.0

    gantt_h = min(max(0.11 * len(shown) + 0.8, 1.6), 6.5)
    fig, (ax_r, ax_t, ax_h) = plt.subplots(3, 1, figsize=(11, gantt_h + 4.6), sharex=True,
                                           gridspec_kw={"height_ratios": [gantt_h, 2.1, 1.8]})
    fig.suptitle(_plot_title(rep), fontsize=10)

    for ax in (ax_r, ax_t, ax_h):
        for a, b in zip(t_start[compiled], t_end[compiled]):
            ax.axvspan(a, b, zorder=0, **_compile_span())
        ax.grid(alpha=0.3, axis="x" if ax is ax_r else "both")
    if off > 0:
        for ax in (ax_r, ax_t, ax_h):
            ax.axvspan(0, off, zorder=0, color="0.85", alpha=0.6)
        ax_t.text(off / 2, 0.96, f"load\n{off:.1f} s", ha="center", va="top", fontsize=7, color="0.3",
                  transform=ax_t.get_xaxis_transform(), zorder=4)
    for a, b in zip(t_start[compiled], t_end[compiled]):
        if b - a > 0.04 * t_max:   # wide enough to name; its own rate point sits near 0, the top is free
            ax_t.text((a + b) / 2, 0.96, f"compile\n{b - a:.1f} s", ha="center", va="top", fontsize=7,
                      color="darkred", transform=ax_t.get_xaxis_transform(), zorder=4,
                      bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
    _plot_requests(ax_r, shown, len(reqs), t_start[compiled], t_end[compiled])

    # throughput: steady steps joined (broken at idle gaps), steps that compiled as separate hollow points
    steady = ~compiled
    tps = np.array([r["tokens_per_s"] for r in tl], np.float64)           # [steps]
    x, y = break_gaps(t_end[steady], tps[steady], starts=t_start[steady])
    ax_t.plot(x, y, ".-" if steady.sum() <= 200 else "-", color="tab:blue", lw=1, ms=4,
              label="per step (prefill + decode chunk)")
    if compiled.any():
        ax_t.plot(t_end[compiled], tps[compiled], "o", mfc="none", color="tab:red", ms=5,
                  label="step that compiled")
    rate = (rep.get("throughput") or {}).get("decode_tokens_per_s_steady")
    if rate:
        ax_t.axhline(rate, color="0.35", ls="--", lw=1, label=f"steady decode {rate:.1f} tok/s")
    ax_t.set_ylim(bottom=0)
    ax_t.set_ylabel("generated tokens/s")
    _legend_above(ax_t)

    # HBM hit rate per decode chunk
    if not rep.get("host_tier", True):
        ax_h.text(0.5, 0.5, "dense: no hit rate (every K/V in HBM)", transform=ax_h.transAxes, ha="center",
                  va="center", fontsize=10, color="0.35")
        ax_h.set_yticks([])
    else:
        has = np.array([r["hit_rate"] is not None for r in tl], bool)     # [steps]
        hr = np.array([np.nan if r["hit_rate"] is None else r["hit_rate"] for r in tl], np.float64)
        m = has & steady
        x, y = break_gaps(t_end[m], hr[m], starts=t_start[m])
        ax_h.plot(x, y, ".-" if m.sum() <= 200 else "-", color="tab:green", lw=1, ms=4, label="per decode chunk")
        if (has & compiled).any():
            ax_h.plot(t_end[has & compiled], hr[has & compiled], "o", mfc="none", color="tab:red", ms=5,
                      label="chunk that compiled")
        overall = (rep.get("cache") or {}).get("hbm_hit_rate")
        if overall is not None:
            ax_h.axhline(overall, color="0.35", ls="--", lw=1, label=f"whole run {overall:.3f}")
        if not has.any():
            ax_h.text(0.5, 0.5, "no flushed pages were selected: nothing to hit or miss", transform=ax_h.transAxes,
                      ha="center", va="center", fontsize=9, color="0.35")
        else:
            _legend_above(ax_h)
        ax_h.set_ylim(-0.03, 1.03)
        ax_h.set_ylabel("HBM hit rate")
    ax_h.set_xlim(0, 1.02 * t_max)
    ax_h.set_xlabel("seconds since the process started" if off > 0 else "seconds since engine start")
    fig.tight_layout()
    from ulacache_jax.app.jsonl_io import atomic_write
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)


def break_gaps(x, y, *, starts=None, factor: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) with a NaN point inserted wherever consecutive points are separated by a gap, so matplotlib draws
    separate segments and no line spans the gap. With `starts` (each point's step start; x is its end) a gap is
    idle time, starts[i + 1] - x[i], longer than `factor` x the median step (x - starts); without, a spacing
    x[i + 1] - x[i] longer than `factor` x the median positive spacing. x non-decreasing; y may hold NaN."""
    x = np.asarray(x, np.float64)                                    # [n]
    y = np.asarray(y, np.float64)                                    # [n]
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D of one length (got shapes {x.shape} and {y.shape})")
    if not factor > 0:
        raise ValueError(f"factor = {factor!r} must be > 0")
    if x.size < 2:
        return x.copy(), y.copy()
    if np.any(np.diff(x) < 0):
        raise ValueError("x must be non-decreasing (step end times in order)")
    if starts is None:
        gap = np.diff(x)                                             # [n - 1]
        ref = gap[gap > 0]
    else:
        s = np.asarray(starts, np.float64)
        if s.shape != x.shape:
            raise ValueError(f"starts must have the shape of x {x.shape} (got {s.shape})")
        gap = s[1:] - x[:-1]                                         # [n - 1] idle time between steps
        ref = (x - s)[(x - s) > 0]
    if not ref.size:
        return x.copy(), y.copy()
    cut = np.flatnonzero(gap > factor * float(np.median(ref))) + 1   # first index of each new segment
    return np.insert(x, cut, np.nan), np.insert(y, cut, np.nan)


def request_timeline(requests, t0: float) -> list[dict]:
    """Per request, in id order, the plot's Gantt rows: when it was queued (added), admitted (its prefill
    started), got its first token (prefill done) and finished, in seconds since the engine started (None where
    it never got there), the step of its prefill (its first delivery) and its token counts."""
    def rel(t):
        return None if t is None else round(t - t0, 6)
    return [{"id": r.request_id, "t_added_s": rel(r.t_added), "t_admitted_s": rel(r.t_admitted),
             "t_first_token_s": rel(r.t_first_token), "t_finished_s": rel(r.t_finished),
             "prefill_step": r.deliveries[0][2] if r.deliveries else None, "prompt_tokens": len(r.prompt_ids),
             "generated_tokens": len(r.tokens), "finish_reason": r.finish_reason}
            for r in sorted(requests, key=lambda r: r.request_id)]


def _plot_title(rep: dict) -> str:
    c = rep.get("cache_config") or {}
    head = f"{rep.get('model') or 'model'}  |  {rep.get('attention', '?')} attention  |  batch {c.get('max_seqs', '?')}"
    if rep.get("host_tier", True) and "token_budget" in c:
        head += f"  |  token budget {c['token_budget']}, page {c.get('page_size', '?')}"
    if rep.get("random_weights") and "random" not in head.lower():
        head += "  |  RANDOM WEIGHTS"
    q, tok = rep.get("requests") or {}, rep.get("tokens") or {}
    sub = []
    if q:
        sub.append(f"{q.get('total', 0)} requests ({q.get('failed', 0)} failed)")
    if tok:
        sub.append(f"{tok.get('generated', 0)} tokens generated")
    if rep.get("wall_s") is not None:
        sub.append(f"{rep['wall_s']:.2f} s wall, {rep.get('compile_steps_s', 0.0):.2f} s in "
                   f"{rep.get('compile_steps', 0)} steps that compiled")
    return head + ("\n" + ", ".join(sub) if sub else "")


def _plot_requests(ax, rows: list[dict], total: int, compile_a, compile_b) -> None:
    """The Gantt panel: one row per request, y = row (first request on top)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    colours = {"queued": "0.82", "prefill": "tab:orange", "decode": "tab:blue"}
    if not rows:
        ax.text(0.5, 0.5, "no per-request timings in this report", transform=ax.transAxes, ha="center",
                va="center", fontsize=9, color="0.35")
        ax.set_yticks([])
    bars = {k: ([], [], []) for k in colours}                       # kind -> (row, left, width)
    done, failed = ([], []), ([], [])                                # (t, row)
    for i, r in enumerate(rows):
        a, adm, first, fin = r["t_added_s"], r["t_admitted_s"], r["t_first_token_s"], r["t_finished_s"]
        for kind, lo, hi in (("queued", a, adm if adm is not None else fin), ("prefill", adm, first),
                             ("decode", first, fin)):
            if lo is not None and hi is not None and hi >= lo:
                bars[kind][0].append(i), bars[kind][1].append(lo), bars[kind][2].append(hi - lo)
        if fin is not None:
            m = failed if r.get("finish_reason") == "error" else done
            m[0].append(fin), m[1].append(i)
    for kind, (yy, left, width) in bars.items():
        if yy:   # an edge of the bar's own colour keeps millisecond prefills visible (one pixel at least)
            ax.barh(yy, width, left=left, height=0.7, color=colours[kind], edgecolor=colours[kind], lw=0.6,
                    zorder=2)
    ax.plot(*done, "|", color="black", ms=6, mew=1.0, zorder=3)
    ax.plot(*failed, "x", color="tab:red", ms=6, mew=1.5, zorder=3)
    if rows:
        ax.set_ylim(len(rows) - 0.5, -0.5)                           # first request on top
        if len(rows) <= 24:
            ax.set_yticks(range(len(rows)), [str(r["id"]) for r in rows], fontsize=7)
        else:
            step = -(-len(rows) // 16)
            ax.set_yticks(range(0, len(rows), step), [str(r["id"]) for r in rows[::step]], fontsize=7)
    ax.set_ylabel("request id")
    what = f"requests: first {len(rows)} of {total} shown" if total > len(rows) else f"requests ({total})"
    ax.set_title(what, fontsize=9, loc="left")
    handles = [Patch(color=colours[k], label=k) for k in colours]  # queued = added, not yet admitted
    handles += [Line2D([], [], ls="none", marker="|", color="black", ms=6, mew=1.0, label="finished"),
                Line2D([], [], ls="none", marker="x", color="tab:red", ms=6, mew=1.5, label="failed")]
    if len(compile_a):
        handles.append(Patch(label="step that compiled", **_compile_span()))
    _legend_above(ax, handles)


def _compile_span() -> dict:
    return dict(facecolor=(0.85, 0.1, 0.1, 0.06), edgecolor=(0.8, 0.1, 0.1, 0.3), hatch="///", lw=0)


def _legend_above(ax, handles=None) -> None:
    """One row of legend above the panel's top right corner: it never hides a point."""
    kw = {} if handles is None else {"handles": handles}
    n = len(handles) if handles is not None else len(ax.get_legend_handles_labels()[0])
    ax.legend(**kw, fontsize=8, ncol=max(n, 1), loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False,
              handlelength=1.5, columnspacing=1.0, borderaxespad=0.2)
