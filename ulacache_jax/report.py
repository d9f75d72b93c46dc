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

from .config import CacheConfig


def _pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else None


def _ms(x):
    return None if x is None else 1e3 * x


def footprint(config: CacheConfig, attention: str) -> dict:
    """Bytes of the KV cache: HBM (all ranks) and host. Dense: every K/V in HBM, no host tier."""
    c = config
    if attention == "dense":
        kv = 2 * c.num_layers * c.max_seqs * c.max_context * c.num_kv_heads * c.head_dim * c.jnp_dtype.itemsize
        return {"hbm_bytes": kv, "host_bytes": 0, "hbm_detail": {"dense_kv": kv}}
    fp = c.footprint()
    hbm = {k: v * c.tp for k, v in fp.items() if k != "host"}
    return {"hbm_bytes": sum(hbm.values()), "host_bytes": fp["host"] * c.tp, "hbm_detail": hbm}


def build_report(engine, requests=None, *, wall_s: float | None = None, model_label: str = "",
                 random_weights: bool = False, param_bytes: int | None = None, extra: dict | None = None) -> dict:
    """A JSON-able dict. `requests`: the finished Requests to summarise (default: those the engine still holds)."""
    c: CacheConfig = engine.config
    attention = engine.gen.attention
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
    sparse = attention == "sparse"
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
        "attention": attention,
        "cache_config": dataclasses.asdict(c),
        "requests": {"total": len(reqs), "ok": len(ok), "failed": reasons["error"], "finish_reasons": reasons},
        "tokens": {"prompt": prompt_tokens, "generated": gen_tokens},
        "wall_s": wall,
        "engine_s": t_total,
        "compile_steps_s": compile_s,
        "compile_steps": len(compiled),
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
        "footprint": {**footprint(c, attention), "param_bytes": param_bytes},
        "timeline": timeline,
    }
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
        f"HBM frames {c['num_buckets'] * c['slots_per_bucket']}, host pages {c['host_pages']}, dtype {c['dtype']}",
        f"  requests: {q['total']} ({q['ok']} ok, {q['failed']} failed; finish reasons {q['finish_reasons']})",
        f"  tokens:   {rep['tokens']['prompt']} prompt, {rep['tokens']['generated']} generated",
        f"  time:     {rep['wall_s']:.2f} s wall, of which {rep['compile_steps_s']:.2f} s in "
        f"{rep['compile_steps']} steps that compiled",
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
    if rep.get("input_errors"):
        lines.append(f"  input errors: {len(rep['input_errors'])} lines (see stderr / the output file)")
    lines.append("=" * 78)
    return "\n".join(lines)


def write_json(rep: dict, path: str | os.PathLike) -> None:
    """Written to a temp file beside `path` and renamed over it: a crash leaves the old report or the new one."""
    from .jsonl_io import atomic_write_bytes
    atomic_write_bytes(path, (json.dumps(rep, indent=1, default=str) + "\n").encode())


def plot_timeline(rep: dict, path: str | os.PathLike) -> None:
    """PNG: HBM hit rate per step and throughput (per step and cumulative) against time (written to a temp file
    and renamed, like the report)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = rep["timeline"]
    t = [r["t_end_s"] for r in tl]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    title = f"{rep['model']} - {rep['attention']} attention"
    if rep.get("random_weights") and "random" not in title.lower():
        title += " (random weights)"
    fig.suptitle(title, fontsize=10)
    hr = [(x, r["hit_rate"]) for x, r in zip(t, tl) if r["hit_rate"] is not None]
    if hr:
        ax1.plot(*zip(*hr), marker=".", lw=1)
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_ylabel("HBM hit rate\n(per decode chunk)")
    ax1.grid(alpha=0.3)
    ax2.plot(t, [r["tokens_per_s"] for r in tl], marker=".", lw=1, label="per step (prefill + chunk)")
    ax2.plot(t, [r["cum_tokens_per_s"] for r in tl], lw=1.5, label="cumulative")
    for x, r in zip(t, tl):
        if r["compiled"]:
            ax2.axvline(x, color="0.8", lw=0.8, zorder=0)
    ax2.set_ylabel("generated tokens/s")
    ax2.set_xlabel("time since engine start (s); grey lines: steps that compiled")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    from .jsonl_io import atomic_write
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
