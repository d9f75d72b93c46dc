"""The serving benchmark (issue 49 item 6): `ulacache serve` driven by concurrent streaming `openai` clients, beside
the offline Engine on the same requests.

The script starts `python -m ulacache_jax.app.cli serve` itself on a free loopback port with the engine options
given, waits for /health 200 (ready only after its warm-up compiles), then:
1. check: one request per prompt length of the mix (prompts of their own), streamed greedily, one at a time (their prefill programs
   compile here, untimed); their texts are compared with the offline Engine's below (`same_text`);
2. alone: the long prompt (the mix's longest length) alone: its TTFT;
3. load: `--clients` concurrent AsyncOpenAI clients, each streaming `--requests-per-client` completions (prompts
   drawn from `--prompt-lengths` by `--weights`, `max_tokens`, `ignore_eos`, greedy, `logprobs=0` so every chunk
   says how many tokens it holds); once every client has its first token, the long prompt arrives once more: its
   TTFT under load, and the running streams' per-token ITL while it prefills (chunks arriving between its send and
   its first token). Bounded: `--time-limit` seconds for the load, loopback only.
The load runs twice: untimed (whatever programs its batches need compile, as the offline Engine's untimed run
below), then timed (`--no-warm-pass`: timed only, compiles included).
Per request at the client: TTFT (send to first token), every inter-token gap (time between chunks / the chunk's
tokens, once per token), end to end; throughput = generated tokens of the load / its wall time.
Then the server stops (one GPU holds one of them) and the offline Engine, built as `ulacache serve` builds it
(cli.build_parser, cli.serve_engine), runs the check requests (untimed; their text is
the reference), then every load request plus the long one, added at once, twice: untimed (its programs compile),
then timed: its throughput (generated tokens / wall), TTFT and ITL from Request.deliveries. Greedy text of every load request is compared as well.

Prompts are token ids of real text (pydoc of standard-library modules, scripts/haystacks.py) under the model's
tokenizer; random ids for a model without one.

CPU check of the script (the tiny random preset, ~30 s on 2 shared cores; docs/benchmarks/serve.json is the GPU's):
  python -m scripts.bench_serve --model tiny --clients 8 --prompt-lengths 64,256,1024 --weights 0.5,0.3,0.2 \
    --max-tokens 64 --page-size 16 --token-budget 128 --prefill-chunk-tokens 256 --decode-chunk-steps 8 --out /tmp/serve
H200 (scripts/bench_gpu.sh step `serve`):
  python -m scripts.bench_serve --model qwen2.5-coder-0.5b --dtype bfloat16 --clients 32 \
    --prompt-lengths 1024,4096,32768 --weights 0.6,0.3,0.1 --max-tokens 256 --prefill-chunk-tokens 2048 --out out/gpu
JSON to <out>/serve.json (bench_meta.Results, row by row), PNG beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from scripts.bench_meta import add_common_args


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _stats(prefix: str, xs, scale=1.0) -> dict:
    return {f"{prefix}_p50": None if not xs else _pct(xs, 50) * scale,
            f"{prefix}_p99": None if not xs else _pct(xs, 99) * scale,
            f"{prefix}_max": None if not xs else max(xs) * scale}


def _quantiles(xs, n=101) -> list[float]:
    """n evenly spaced quantiles of xs (the CDF the plot draws), in ms."""
    if not xs:
        return []
    xs = sorted(xs)
    return [1e3 * xs[min(len(xs) - 1, int(round(i / (n - 1) * (len(xs) - 1))))] for i in range(n)]


# ---- prompts -----------------------------------------------------------------------------------------------------
def tokenizer_of(model: str):
    """The model's tokenizer without loading its weights (no device touched: the server needs the GPU first);
    None for a preset without one (random ids then)."""
    from ulacache_jax import models
    if model in models.PRESETS and not os.path.exists(model):
        mc = models.get_preset(model)
        return (models.ByteTokenizer() if mc.vocab_size == models.BYTE_VOCAB_SIZE else None), mc.vocab_size
    tok = models.load_tokenizer(model)
    return tok, None


def make_requests(args) -> dict:
    """-> {"load", "warm": the load's prompts (the warm pass's are others of the same lengths), "check": one per
    length, "long": 3 prompts of the longest length (alone, warm pass, timed), "source": what text they are}.
    Lengths drawn from the mix by --seed. Every prompt starts with 8 ids from random places of the text, so no two share a first page and
    the prefix cache (on, as `ulacache serve` runs) never serves one from another: every prefill is real."""
    import numpy as np
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    weights = [float(x) for x in args.weights.split(",")] if args.weights else [1.0] * len(lengths)
    if len(weights) != len(lengths):
        raise SystemExit(f"--weights has {len(weights)} entries for {len(lengths)} --prompt-lengths")
    if min(lengths) <= 8:
        raise SystemExit("--prompt-lengths must be > 8 tokens")
    n = args.clients * args.requests_per_client
    drawn = rng.choice(lengths, size=n, p=np.array(weights) / sum(weights)).tolist()
    drawn[:len(lengths)] = lengths[:n]            # every length of the mix appears at least once
    tok, vocab = tokenizer_of(args.model)
    if tok is not None:
        from scripts import haystacks
        text = "\n\n".join(haystacks.load("pydoc"))
        ids = list(tok.encode(text, add_special_tokens=False) if _takes_special(tok) else tok.encode(text))
        source = f"pydoc text ({len(ids)} tokens, wrapped), 8 of its ids at random places first"
    else:
        ids = rng.integers(0, vocab, 1 << 16).tolist()
        source = "random ids"
    at = [0]

    def take(ln: int) -> list[int]:
        out = [ids[j] for j in rng.integers(0, len(ids), 8)]     # 8 ids of the text at random places
        while len(out) < ln:
            piece = ids[at[0]:at[0] + ln - len(out)]
            out += piece
            at[0] = (at[0] + len(piece)) % len(ids)
        return out

    return dict(check=[take(ln) for ln in lengths], warm=[take(ln) for ln in drawn], load=[take(ln) for ln in drawn],
                long=[take(max(lengths)) for _ in range(3)], source=source)


def _takes_special(tok) -> bool:
    import inspect
    try:
        return "add_special_tokens" in inspect.signature(tok.encode).parameters
    except (TypeError, ValueError):
        return False


# ---- the server --------------------------------------------------------------------------------------------------
def engine_args(args) -> list[str]:
    """The options the server and the offline Engine share (`ulacache serve`'s)."""
    a = ["--model", args.model, "--dtype", args.dtype, "--page-size", str(args.page_size),
         "--token-budget", str(args.token_budget), "--max-seqs", str(args.max_seqs),
         "--max-context", str(args.max_context), "--attention", args.attention, "--compile-cache", args.compile_cache]
    if args.prefill_chunk_tokens:
        a += ["--prefill-chunk-tokens", str(args.prefill_chunk_tokens)]
    if args.decode_chunk_steps:
        a += ["--decode-chunk-steps", str(args.decode_chunk_steps)]
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log):
    cmd = [sys.executable, "-m", "ulacache_jax.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-queue", str(args.max_queue), "--warmup", args.warmup, "--max-new-tokens", str(args.max_tokens),
           "--log-level", "warning", *engine_args(args)]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready (log: {log.name})")
        if time.monotonic() - t0 > args.startup_timeout:
            stop_server(proc)
            raise RuntimeError(f"the server was not ready within {args.startup_timeout} s (log: {log.name})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base, time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)


def stop_server(proc) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# ---- clients -----------------------------------------------------------------------------------------------------
async def stream_one(client, model: str, prompt: list[int], args, on_first=None) -> dict:
    """One streamed completion -> {text, tokens, t_send, ttft_s, e2e_s, chunks: [(t, tokens)], error}."""
    t_send = time.perf_counter()
    chunks, text, err = [], [], None
    try:
        s = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, stream=True,
                                            temperature=0, logprobs=0, extra_body={"ignore_eos": True})
        async for c in s:
            t = time.perf_counter()
            for ch in c.choices:
                n = len(ch.logprobs.tokens) if ch.logprobs is not None and ch.logprobs.tokens else 0
                text.append(ch.text or "")
                if n:
                    if not chunks and on_first is not None:
                        on_first()
                    chunks.append((t, n))
    except Exception as e:  # noqa: BLE001 - an error is a result of the benchmark, reported per request
        err = repr(e)[:300]
    t_end = time.perf_counter()
    return dict(text="".join(text), tokens=sum(n for _, n in chunks), t_send=t_send, chunks=chunks, error=err,
                ttft_s=chunks[0][0] - t_send if chunks else None, e2e_s=t_end - t_send)


def itl_samples(chunks, window: tuple[float, float] | None = None) -> list[float]:
    """Per-token inter-token latencies of one stream (a chunk's gap / its tokens, once per token); with `window`,
    only chunks arriving inside it."""
    out = []
    for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
        if window is None or window[0] <= t1 <= window[1]:
            out.extend([(t1 - t0) / n] * n)
    return out


async def drive(base: str, model: str, sets: dict, args) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=args.time_limit)
    try:
        check = [await stream_one(client, model, p, args) for p in sets["check"]]
        alone = await stream_one(client, model, sets["long"][0], args)
        if args.warm_pass:          # untimed, other prompts of the same lengths: the load's programs compile
            await load_phase(client, model, sets["warm"], sets["long"][1], args)
        got = await load_phase(client, model, sets["load"], sets["long"][2], args)
        return dict(check=check, alone=alone, **got)
    finally:
        await client.close()


async def load_phase(client, model, prompts, long_prompt, args) -> dict:
    """The clients stream their requests; the long prompt arrives once each client (up to the slots) has its first
    token -> {load: {i: result}, long: result, wall_s, timed_out}."""
    started = asyncio.Event()
    firsts = [0]
    want = min(args.clients, args.max_seqs)

    def first():
        firsts[0] += 1
        if firsts[0] >= want:
            started.set()

    async def worker(k):
        res = []
        for j in range(args.requests_per_client):
            i = k * args.requests_per_client + j
            res.append((i, await stream_one(client, model, prompts[i], args, first if j == 0 else None)))
        return res

    async def long_under_load():
        try:
            await asyncio.wait_for(started.wait(), args.time_limit / 2)
        except asyncio.TimeoutError:
            pass
        return await stream_one(client, model, long_prompt, args)

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(worker(k)) for k in range(args.clients)]
    long_task = asyncio.ensure_future(long_under_load())
    done, pending = await asyncio.wait(tasks + [long_task], timeout=args.time_limit)
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - t0
    results = {}
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is None:
            results.update(dict(t.result()))
    loaded = long_task.result() if long_task in done and long_task.exception() is None else None
    return dict(load=results, long=loaded, wall_s=wall, timed_out=bool(pending))


# ---- the offline Engine ------------------------------------------------------------------------------------------
def offline(args, sets: dict) -> dict:
    from ulacache_jax.app import cli
    from ulacache_jax.runtime.requests import SamplingParams
    eargs = cli.build_parser().parse_args(["serve", *engine_args(args)])
    engine, _, _ = cli.serve_engine(eargs)
    sp = SamplingParams(max_new_tokens=args.max_tokens, stop_ids=(), logprobs=0)
    ref = engine.run(sets["check"], sp)                                 # untimed: the reference texts
    engine.run(sets["warm"] + [sets["long"][1]], sp)                    # untimed: its programs compile here
    t0 = time.perf_counter()
    reqs = engine.run(sets["load"] + [sets["long"][2]], sp)
    wall = time.perf_counter() - t0
    ttft = [r.t_first_token - r.t_added for r in reqs if r.t_first_token is not None]
    itl = []
    for r in reqs[:-1]:
        itl += itl_samples([(t, n) for t, n, _ in r.deliveries if n > 0])
    return dict(check_text=[r.text for r in ref], check_tokens=[len(r.tokens) for r in ref],
                text=[r.text for r in reqs], tokens=[len(r.tokens) for r in reqs], wall_s=wall,
                generated=sum(len(r.tokens) for r in reqs[:-1]) + len(reqs[-1].tokens), ttft=ttft, itl=itl,
                errors=[r.error for r in reqs if r.finish_reason == "error"])


# ---- report ------------------------------------------------------------------------------------------------------
def plot(res: dict, path: str) -> str | None:
    try:
        from scripts.bench_meta import pyplot, save_figure
        plt = pyplot()
    except ImportError:
        return None
    rows = {r["kind"]: r for r in res["rows"]}
    if "server" not in rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for kind, color in (("server", "C0"), ("offline", "C1")):
        q = rows.get(kind, {}).get("itl_quantiles_ms") or []
        if q:
            ax.plot(q, [i / (len(q) - 1) for i in range(len(q))], color=color, label=f"{kind} ITL")
    lp = rows.get("long_prompt", {}).get("window_itl_quantiles_ms") or []
    if lp:
        ax.plot(lp, [i / (len(lp) - 1) for i in range(len(lp))], "C3--", label="server ITL, long prompt prefilling")
    ax.set_xscale("log")
    ax.set_xlabel("per-token inter-token latency (ms)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    ax = axes[1]
    names, vals = [], []
    for kind in ("server", "offline"):
        r = rows.get(kind, {})
        for q in ("p50", "p99"):
            if r.get(f"ttft_{q}_s") is not None:
                names.append(f"{kind}\nTTFT {q}")
                vals.append(r[f"ttft_{q}_s"])
    lr = rows.get("long_prompt", {})
    for key, name in (("ttft_alone_s", "long\nalone"), ("ttft_under_load_s", "long\nunder load")):
        if lr.get(key) is not None:
            names.append(name)
            vals.append(lr[key])
    ax.bar(names, vals, color=["C0"] * 2 + ["C1"] * 2 + ["C3"] * 2 if len(vals) == 6 else None)
    ax.set_ylabel("time to first token (s)")
    ax.tick_params(axis="x", labelsize=7)
    m = res["meta"]
    fig.suptitle(f"serve: {m.get('clients')} streaming clients, prompts {m.get('prompt_lengths')}, "
                 f"{m.get('max_tokens')} new tokens, {m.get('model')} on {m.get('device')} (bench_serve.py)",
                 fontsize=9)
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, files="serve.json, serve.png, serve_server.log", model="tiny", dtype="float32")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--requests-per-client", type=int, default=1, help="requests each client sends, one after another")
    p.add_argument("--prompt-lengths", default="32,64,128", help="prompt tokens of the mix (the longest is also the "
                   "long prompt of the admitted-under-load scenario)")
    p.add_argument("--weights", default=None, help="the mix's weights, one per length (default: equal)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens a request (ignore_eos: all generated)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=None, help="sequence slots (default: clients + 1, the long prompt)")
    p.add_argument("--max-context", type=int, default=None, help="default: the longest prompt + max tokens, paged")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None)
    p.add_argument("--decode-chunk-steps", type=int, default=None)
    p.add_argument("--attention", default="auto", choices=("auto", "sparse", "dense"))
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--warmup", default="full", choices=("full", "basic", "off"))
    p.add_argument("--compile-cache", default="off", help="the server's and the offline Engine's --compile-cache")
    p.add_argument("--time-limit", type=float, default=420, help="seconds the load may take (then cut, reported)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for /health 200")
    p.add_argument("--seed", type=int, default=0, help="the prompt mix's draw")
    p.add_argument("--no-warm-pass", dest="warm_pass", action="store_false",
                   help="skip the untimed pass of the load through the server (the offline Engine has one too)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    args.max_seqs = args.max_seqs or args.clients + 1
    if args.max_context is None:
        need = max(lengths) + args.max_tokens
        args.max_context = -(-need // args.page_size) * args.page_size
    sets = make_requests(args)
    prompts, long_prompt, source = sets["load"], sets["long"][2], sets["source"]
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "serve_server.log")
    model_name = args.model
    with open(log_path, "w") as log:
        proc, base, ready_s = start_server(args, free_port(), log)
        try:
            got = asyncio.run(drive(base, model_name, sets, args))
        finally:
            rc = stop_server(proc)
    print(f"server ready after {ready_s:.1f} s; stopped ({rc})", flush=True)

    # the server is gone: this process may take the device now
    from scripts.bench_meta import Results, run_meta
    path = os.path.join(args.out, "serve.json")
    res = Results(path, run_meta(args.commit, model=args.model, dtype=args.dtype, clients=args.clients,
                                 requests=len(prompts), prompt_lengths=args.prompt_lengths, weights=args.weights,
                                 max_tokens=args.max_tokens, page_size=args.page_size,
                                 token_budget=args.token_budget, max_seqs=args.max_seqs, max_context=args.max_context,
                                 prefill_chunk_tokens=args.prefill_chunk_tokens,
                                 decode_chunk_steps=args.decode_chunk_steps, attention=args.attention,
                                 prompt_source=source, server_ready_s=ready_s), settings=vars(args))
    load = [got["load"].get(i) for i in range(len(prompts))]
    done = [r for r in load if r is not None and r["error"] is None]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in done]
    itl = [x for r in done for x in itl_samples(r["chunks"])]
    long_ = got["long"]
    generated = sum(r["tokens"] for r in done) + (long_["tokens"] if long_ else 0)
    srv = dict(kind="server", requests=len(prompts), completed=len(done), timed_out=got["timed_out"],
               errors=[r["error"] for r in load if r is not None and r["error"]][:5],
               generated_tokens=generated, wall_s=got["wall_s"], tokens_per_s=generated / got["wall_s"],
               ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99),
               ttft_median_s=statistics.median(ttft) if ttft else None,
               **_stats("itl_ms", itl, 1e3), itl_samples=len(itl), itl_quantiles_ms=_quantiles(itl),
               e2e_p50_s=_pct(e2e, 50), e2e_p99_s=_pct(e2e, 99))
    res.add(srv)

    off = offline(args, sets)
    check_same = [s["text"] == t and s["tokens"] == n
                  for s, t, n in zip(got["check"], off["check_text"], off["check_tokens"])]
    load_same = [r is not None and r["text"] == off["text"][i] and r["tokens"] == off["tokens"][i]
                 for i, r in enumerate(load)]
    res.add(dict(kind="check", requests=len(sets["check"]), same_text=all(check_same), same=check_same,
                 errors=[s["error"] for s in got["check"] if s["error"]],
                 load_same_text=sum(load_same), load_requests=len(load),
                 long_same_text=long_ is not None and long_["text"] == off["text"][-1]))
    res.add(dict(kind="offline", requests=len(prompts) + 1, generated_tokens=off["generated"], wall_s=off["wall_s"],
                 tokens_per_s=off["generated"] / off["wall_s"], errors=off["errors"][:5],
                 **{f"ttft_{q}_s": _pct(off["ttft"], int(q[1:])) for q in ("p50", "p99")},
                 **_stats("itl_ms", off["itl"], 1e3), itl_quantiles_ms=_quantiles(off["itl"]),
                 server_over_offline=srv["tokens_per_s"] / (off["generated"] / off["wall_s"])))
    alone = got["alone"]
    window_itl = []
    if long_ is not None and long_["ttft_s"] is not None:
        win = (long_["t_send"], long_["t_send"] + long_["ttft_s"])
        window_itl = [x for r in done for x in itl_samples(r["chunks"], win)]
    res.add(dict(kind="long_prompt", prompt_tokens=len(long_prompt), ttft_alone_s=alone["ttft_s"],
                 ttft_under_load_s=long_["ttft_s"] if long_ else None,
                 under_load_over_alone=(long_["ttft_s"] / alone["ttft_s"]
                                        if long_ and long_["ttft_s"] and alone["ttft_s"] else None),
                 errors=[x["error"] for x in (alone, long_) if x and x["error"]],
                 window_itl_samples=len(window_itl), **_stats("window_itl_ms", window_itl, 1e3),
                 window_itl_p99_over_p50=(_pct(window_itl, 99) / _pct(window_itl, 50)
                                          if window_itl and _pct(window_itl, 50) else None),
                 window_itl_quantiles_ms=_quantiles(window_itl)))
    with open(path) as f:
        png = plot(json.load(f), os.path.splitext(path)[0] + ".png")
    rows = {r["kind"]: r for r in res.rows}
    s, o, c, lp = rows["server"], rows["offline"], rows["check"], rows["long_prompt"]
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)
    print(f"\nJSON {path}\nPNG  {png}")
    print(f"{'':10s} {'tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>9s} {'ITL p99':>9s}  (s, ms)")
    for name, r in (("server", s), ("offline", o)):
        print(f"{name:10s} {f(r['tokens_per_s'], '.1f'):>9s} {f(r['ttft_p50_s']):>9s} {f(r['ttft_p99_s']):>9s} "
              f"{f(r['itl_ms_p50']):>9s} {f(r['itl_ms_p99']):>9s}")
    print(f"server / offline throughput {o['server_over_offline']:.3f}; greedy check same text: {c['same_text']} "
          f"({c['requests']} requests), load requests same text {c['load_same_text']}/{c['load_requests']}")
    print(f"long prompt ({lp['prompt_tokens']} tokens): TTFT alone {f(lp['ttft_alone_s'])} s, under load "
          f"{f(lp['ttft_under_load_s'])} s; running streams' ITL during its prefill p50 {f(lp['window_itl_ms_p50'])} "
          f"ms p99 {f(lp['window_itl_ms_p99'])} ms ({lp['window_itl_samples']} samples)")
    return dict(meta=res.meta, rows=res.rows)


if __name__ == "__main__":
    main()
