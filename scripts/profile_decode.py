"""Device trace of one decode chunk: every kernel and XLA op of one layer by name, its time, and the gaps.

Per row (attention, context, batch), in its own process: the cache of `bench_decode.py` (Llama-3.1-8B shape,
random bf16 weights, synthetic KV fill), one warm-up chunk (compiles), then one chunk of `page_size` decode steps
under `jax.profiler.trace`. The trace's device events are summarised three ways:
- per op name: launches and device time per layer-step (total / (steps x layers));
- one layer of a middle step, in launch order: each op's time and the idle gap before it (layer boundaries are
  the launches of the one op that runs exactly once per layer-step, found from the counts);
- the chunk: device busy time, idle time (gaps between launches), wall time per step.
Writes `decode_profile.json` (rows + the ordered layer of each row) to --out and prints a table per row.
`--key-channels C --label-bits B` profile the sparse rows with the key copy or labels (rows record them),
`--hot-share X` fills them as bench_decode --hot-share does (the trace's hit rate instead of random weights'),
`--two-stage MULT` profiles them as a two-stage rule's second stage (bench_decode --two-stage), `--token-shortlist M`
with per-token selection in M x the budget's pages (bench_decode --token-shortlist).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile

from scripts.bench_meta import add_common_args


def load_device_events(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the first accelerator in a jax.profiler perfetto trace; the host's events on
    CPU (where there is no device timeline: the CPU test exercises the summary, not the timing)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = sorted(p for p, n in procs.items() if n.startswith("/device:GPU") or n.startswith("/device:TPU"))
    pids = {dev[0]} if dev else set(procs)
    return [e for e in events if e.get("ph") == "X" and e["pid"] in pids and e.get("dur") is not None]


def _op_name(e: dict) -> str:
    """A launch's kernel name without XLA's per-instance numeric suffix (fusion.123 -> fusion), so the unrolled
    layers' copies of one op add up. The kernel name, not the event's `hlo_op`: with XLA's command buffers (on by
    default) the hlo_op of every captured kernel is just "command_buffer"."""
    return re.sub(r"[._]\d+$", "", e["name"])


def hlo_sources(text: str) -> dict[str, str]:
    """Optimized HLO text (a dump's *after_optimizations.txt, or `Compiled.as_text()`) -> {instruction name:
    "root op @ file:line (function) [ops fused in it]"} for every instruction that calls a computation (fusions):
    what a profiled kernel named e.g. loop_select_fusion_65 (HLO: loop_select_fusion.65) computes, and where in our
    code, read off the instructions' metadata (op_name; stack_frame_id into the module's StackFrames /
    FileLocations / FileNames / FunctionNames tables)."""
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section, comp = None, None
    ops_in: dict[str, list[str]] = {}                  # computation -> the short op names of its instructions
    frames_in: dict[str, list[str]] = {}               # computation -> its instructions' stack frames, ROOT first
    calls: dict[str, tuple[str, str | None, str]] = {}  # instruction -> (root op name, stack frame id, callee)
    for raw in text.splitlines():
        line = raw.strip()
        if line in tables:
            section = line
            continue
        if section is not None:
            m = re.match(r"(\d+) (.*)", line)
            if m:
                tables[section][m[1]] = m[2]
                continue
            section = None
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            comp = head[1]
            ops_in[comp], frames_in[comp] = [], []
            continue
        inst = re.match(r"(?:ROOT )?%([\w.\-]+) = ", line)
        if inst is None or comp is None:
            continue
        md = re.search(r'op_name="([^"]*)"(?: stack_frame_id=(\d+))?', line)
        if md:
            ops_in[comp].append(md[1].rsplit("/", 1)[-1])
            if md[2]:
                frames_in[comp].insert(0 if line.startswith("ROOT") else len(frames_in[comp]), md[2])
        callee = re.search(r"calls=%([\w.\-]+)", line)
        if callee and md:
            calls[inst[1]] = (md[1].rsplit("/", 1)[-1], md[2], callee[1])

    def field(entry: str, key: str) -> str | None:
        m = re.search(key + r"=(\d+)", entry)
        return m[1] if m else None

    def where(frame: str | None) -> str:
        loc = tables["FileLocations"].get(field(tables["StackFrames"].get(frame or "", ""), "file_location_id") or "")
        if loc is None:
            return "?"
        file = tables["FileNames"].get(field(loc, "file_name_id") or "", "?").strip('"')
        fn = tables["FunctionNames"].get(field(loc, "function_name_id") or "", "?").strip('"')
        return f"{os.path.basename(file)}:{field(loc, 'line')} ({fn})"

    # a fusion made by a GPU pass may carry no stack frame of its own: then its fused instructions' (ROOT first)
    return {name: f"{root} @ {where(frame or next(iter(frames_in.get(callee, [])), None))} "
                  f"[{' '.join(sorted(set(ops_in.get(callee, []))))}]"
            for name, (root, frame, callee) in calls.items()}


def summarize(events: list[dict], *, steps: int, layers: int) -> dict:
    """events: one decode chunk's device events. Returns per-op totals, one ordered layer and the chunk's busy and
    idle time (microseconds)."""
    ev = sorted(events, key=lambda e: e["ts"])
    if not ev:
        return dict(ops=[], layer=[], busy_us=0.0, idle_us=0.0, span_us=0.0)
    busy, end = 0.0, ev[0]["ts"]
    for e in ev:                                     # union of intervals (streams may overlap)
        s, t = max(e["ts"], end), e["ts"] + e["dur"]
        if t > s:
            busy += t - s
        end = max(end, t)
    span = end - ev[0]["ts"]
    counts = collections.Counter(_op_name(e) for e in ev)
    dur = collections.Counter()
    for e in ev:
        dur[_op_name(e)] += e["dur"]
    per = steps * layers
    ops = [dict(name=n, launches=c, launches_per_layer_step=c / per, us_per_layer_step=dur[n] / per,
                share=dur[n] / max(busy, 1e-9)) for n, c in counts.most_common()]
    ops.sort(key=lambda r: -r["us_per_layer_step"])
    # layer boundaries: an op launched exactly once per layer-step (the latest such op in launch order of a step)
    marks = [n for n, c in counts.items() if c == per]
    layer = []
    if marks:
        mark = max(marks, key=lambda n: dur[n])
        idx = [i for i, e in enumerate(ev) if _op_name(e) == mark]
        mid = (steps // 2) * layers + layers // 2     # a middle layer of a middle step: no step overhead
        lo, hi = idx[mid - 1] + 1 if mid > 0 else 0, idx[mid] + 1
        prev_end = ev[lo - 1]["ts"] + ev[lo - 1]["dur"] if lo > 0 else ev[lo]["ts"]
        for e in ev[lo:hi]:
            layer.append(dict(name=_op_name(e), kernel=e["name"], hlo_op=e.get("args", {}).get("hlo_op"),
                              us=e["dur"], gap_before_us=max(0.0, e["ts"] - prev_end)))
            prev_end = max(prev_end, e["ts"] + e["dur"])
    return dict(ops=ops, layer=layer, busy_us=busy, idle_us=span - busy, span_us=span,
                layer_us=sum(r["us"] + r["gap_before_us"] for r in layer))


def profile_row(attention: str, ctx: int, batch: int, args) -> dict:
    """Build the row's cache as bench_decode does, warm up, trace one chunk, summarise; each launch of the
    summarised layer gets the `source` of its fusion (`hlo_sources` over XLA's optimized-HLO dump of the traced
    module, written for this row before the backend starts)."""
    dump = tempfile.mkdtemp(prefix="profile_hlo_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    from scripts import bench_decode as bd
    import dataclasses
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.cache.decode_layer import DecodeOptions
    from ulacache_jax.runtime.generation import Generator
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys
    mc = dataclasses.replace(get_preset("llama-3.1-8b"), num_layers=args.layers)
    model = LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ns = argparse.Namespace(chunks=2, budget=args.budget, two_stage=args.two_stage, page_size=args.page_size,
                            token_shortlist=args.token_shortlist)
    cfg = bd.bench_config(mc, attention, batch, ctx, ns, args.kv_fraction, key_channels=args.key_channels,
                          label_bits=args.label_bits)
    gen = Generator(model, cfg, attention=attention, options=DecodeOptions())
    if attention == "sparse":
        slots = [gen.admit(ctx + 3 * cfg.page_size) for _ in range(batch)]
        bd.synthetic_fill_sparse(gen.cache, slots, ctx, seed=batch, chunk=32768, hot_share=args.hot_share)
    else:
        bd.synthetic_fill_dense(gen, batch, ctx, seed=batch)
    S = cfg.max_seqs
    tok, done = jnp.zeros(S, jnp.int32), jnp.arange(S) >= batch
    rem, sampling, stops = jnp.full(S, 1 << 30, jnp.int32), SamplingArrays.fill(S), jnp.asarray([-1], jnp.int32)
    keys = lambda i: row_keys(jnp.arange(S, dtype=jnp.uint32), jnp.full(S, i, jnp.uint32))
    jax.block_until_ready(gen.decode_chunk(tok, done, rem, keys(0), sampling, stops))      # compile + warm
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(gen.decode_chunk(tok, done, rem, keys(1), sampling, stops))
        events = load_device_events(tmp)
    res = summarize(events, steps=cfg.page_size, layers=mc.num_layers)
    attach_sources(res["layer"], events, dump)
    mid = len(events) // 2
    res["sample_events"] = sorted(events, key=lambda e: e["ts"])[mid:mid + 40]   # raw, for reading the names
    res.update(attention=attention, context=ctx, batch=batch, budget=args.budget, layers=mc.num_layers,
               steps=cfg.page_size, page_size=cfg.page_size,
               kv_fraction=args.kv_fraction if attention == "sparse" else 1.0,
               key_channels=cfg.key_channels if attention == "sparse" else None,
               label_bits=cfg.label_bits if attention == "sparse" else None,
               hot_share=args.hot_share if attention == "sparse" else None,
               two_stage=args.two_stage if attention == "sparse" else None,
               token_shortlist=cfg.token_shortlist if attention == "sparse" else None,
               device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               step_ms=res["span_us"] / cfg.page_size / 1e3)
    return res


def attach_sources(layer: list[dict], events: list[dict], dump: str) -> None:
    """Adds `source` (hlo_sources) to each launch of `layer` whose kernel is a fusion of the events' module (found
    by the event's hlo_op, else by its kernel name: fusion_12 is HLO's fusion.12), read from the largest
    optimized-HLO dump of that module in `dump` (the decode chunk's program); then removes the dump. A kernel of
    our own (Pallas) gets no source: its name is ours."""
    try:
        module = collections.Counter(e["args"]["hlo_module"] for e in events
                                     if e.get("args", {}).get("hlo_module")).most_common(1)[0][0]
        files = sorted(glob.glob(os.path.join(dump, f"*.{module}.*after_optimizations.txt")), key=os.path.getsize)
        if files:
            with open(files[-1]) as f:
                text = f.read()
            src = hlo_sources(text)
            if src and all(" @ ? " in v for v in src.values()):
                # no place resolved: show what a fusion's metadata and the module's tables look like, to fix it
                sample = next((ln.strip() for ln in text.splitlines() if "calls=%" in ln and "metadata" in ln), "")
                print(f"hlo_sources: no file:line for any fusion; tables present: "
                      f"{[t for t in ('FileNames', 'StackFrames') if t in text]}; a fusion: {sample[-400:]}")
            for x in layer:
                found = (src.get(x.get("hlo_op") or "") or src.get(re.sub(r"_(\d+)$", r".\1", x["kernel"]))
                         or src.get(x["kernel"]))
                if found:
                    x["source"] = found
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def print_row(r: dict, top: int = 12) -> None:
    print(f"\n== {r['attention']} {r['context'] // 1024}K x {r['batch']} page {r.get('page_size', 64)}: "
          f"{r['step_ms']:.3f} ms/step device span, "
          f"busy {r['busy_us'] / 1e3:.2f} ms, idle {r['idle_us'] / 1e3:.2f} ms over {r['steps']} steps; "
          f"one layer {r.get('layer_us', 0):.1f} us in {len(r['layer'])} launches")
    print(f"{'op':48s} {'launch/ls':>9s} {'us/ls':>8s} {'share':>6s}")
    for o in r["ops"][:top]:
        print(f"{o['name'][:48]:48s} {o['launches_per_layer_step']:9.2f} {o['us_per_layer_step']:8.2f} "
              f"{100 * o['share']:5.1f}%")
    print("one middle layer, in launch order (us, fusion source):")
    for x in r["layer"]:
        print(f"  {x['us']:7.2f} {x['name'][:34]:34s} {x.get('source', '')[:150]}")


def bd_hot_share(text: str) -> float:
    """--hot-share's argparse type: bench_decode's (imported when parsed: bench_decode imports jax)."""
    from scripts.bench_decode import hot_share_arg
    return hot_share_arg(text)


def bd_two_stage(text: str) -> int:
    """--two-stage's argparse type: bench_decode's."""
    from scripts.bench_decode import two_stage_arg
    return two_stage_arg(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="sparse:131072:1,dense:131072:1,sparse:262144:1,dense:262144:1",
                   help="attention:context:batch list")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=64, choices=[16, 32, 64, 128],
                   help="tokens a page, both sides (bench_decode --page-size): a page-16 step does 4x the per-page "
                   "work of a page-64 one at the same budget")
    p.add_argument("--kv-fraction", type=float, default=0.25)
    p.add_argument("--row-timeout", type=float, default=300)
    p.add_argument("--append", action="store_true", help="keep the rows (and commands) of an existing "
                   "decode_profile.json in --out")
    p.add_argument("--key-channels", type=int, default=0, help="sparse rows: CacheConfig.key_channels (the key "
                   "copy, or labels with --label-bits)")
    p.add_argument("--label-bits", type=int, default=0, choices=(0, 4, 8), help="sparse rows with --key-channels: "
                   "labels at 4 or 8 bits")
    p.add_argument("--hot-share", type=bd_hot_share, default=0.0, help="sparse rows: bench_decode --hot-share")
    p.add_argument("--two-stage", type=bd_two_stage, default=None, metavar="MULT",
                   help="sparse rows: the rule above as a TwoStage's second stage (bench_decode --two-stage)")
    p.add_argument("--token-shortlist", type=int, default=0, metavar="M",
                   help="sparse rows with --key-channels: per-token selection in M x the budget's pages "
                   "(bench_decode --token-shortlist)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # child: run the single row
    return add_common_args(p, files="decode_profile.json")


def main(argv=None):
    args = build_parser().parse_args(argv)
    from scripts.bench_decode import check_token_shortlist
    check_token_shortlist(args.token_shortlist, args.key_channels)
    specs = [(a, int(c), int(b)) for a, c, b in (r.split(":") for r in args.rows.split(","))]
    if args.one:
        (a, c, b), = specs
        print("ROW " + json.dumps(profile_row(a, c, b, args)), flush=True)
        return
    from ulacache_jax.cache.state import raise_host_limit
    raise_host_limit()          # the row processes inherit it: XLA's pinned-host pool is 64 GiB by default
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    from scripts.bench_meta import appended_meta, earlier_run, git_commit, row_in_child, write_json
    commit = args.commit or git_commit()
    path = os.path.join(args.out, "decode_profile.json")
    earlier, rows = earlier_run(path, args.append)
    meta = earlier | appended_meta(earlier, commit, "profile_decode.py " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv))
    for a, c, b in specs:           # each row in its own process: one row's HBM cannot starve the next
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--rows", f"{a}:{c}:{b}", "--layers",
               str(args.layers), "--budget", str(args.budget), "--page-size", str(args.page_size),
               "--kv-fraction", str(args.kv_fraction),
               "--key-channels", str(args.key_channels), "--label-bits", str(args.label_bits),
               "--hot-share", str(args.hot_share), "--token-shortlist", str(args.token_shortlist)]
        cmd += ["--two-stage", str(args.two_stage)] if args.two_stage else []
        row = row_in_child(cmd, args.row_timeout, attention=a, context=c, batch=b)
        row["commit"] = commit
        rows.append(row)
        write_json(path, dict(meta, rows=rows))
        if "error" in row:
            print(f"{a} {c} {b}: ERROR {row['error'][-300:]}")
        else:
            print_row(row)


if __name__ == "__main__":
    main()
