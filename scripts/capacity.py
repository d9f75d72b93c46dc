"""Capacity table (issue 50 item 4): the largest batch of each context per machine kind, bf16 and fp8 pages, sparse
and dense, for the 8B and 70B shapes, computed by the library's one sizing rule (ulacache_jax/runtime/sizing.py)
with tensor parallelism over every GPU of the machine.

    python -m scripts.capacity --out docs/benchmarks

A computed table, not a measurement: each cell is what `generate` / the Engine / the CLI would build (the default
cache: HBM frames for every sequence's token budget, host pages for every token) against the machine's memory.
Machines: H200 kinds of 1, 2, 4 and 8 GPUs; HBM per GPU = 139 GiB x XLA_PYTHON_CLIENT_MEM_FRACTION 0.95; host RAM
128 / 256 / 512 / 560 GiB (the device tool's kinds; the 2-8 GPU H200 kinds assumed to have their H100 twins'
RAM), of which raise_host_limit pins 0.9 of MemAvailable (RAM less 8 GiB taken for the OS). Each cell also gives
the sparse side without the first ingest's host transient (cache.state.host_need), what "host memory usable to
its end" (issue 50 item 1) would add. Writes capacity.json (rows) and capacity.png (batch vs context per machine).
"""
from __future__ import annotations

import argparse

GIB = 2**30
MACHINES = ((1, 128), (2, 256), (4, 512), (8, 560))           # (GPUs, host RAM GiB)
HBM_GIB, MEM_FRACTION, PIN_FRACTION, OS_GIB = 139, 0.95, 0.9, 8
MODELS = ("llama-3.1-8b", "llama-3.1-70b")
CONTEXTS = (32768, 65536, 131072, 262144, 524288)
KV_DTYPES = ("auto", "float8_e4m3fn")


def machines():
    from ulacache_jax.runtime import sizing
    return [sizing.Machine(f"H200 x{g}", g, int(MEM_FRACTION * HBM_GIB * GIB), int(PIN_FRACTION * (ram - OS_GIB) * GIB))
            for g, ram in MACHINES]


def rows(models=MODELS, contexts=CONTEXTS, kv_dtypes=KV_DTYPES, cap: int = 1024) -> list[dict]:
    """One row per (model, machine, kv dtype, context, attention): the largest batch and what stops one more."""
    from ulacache_jax.models import PRESETS
    from ulacache_jax.runtime import sizing
    out = []
    for name in models:
        mc = PRESETS[name]
        for m in machines():
            for kv in kv_dtypes:
                for ctx in contexts:
                    for att in ("sparse", "dense"):
                        fit = sizing.largest_batch(mc, ctx, m, attention=att, kv_dtype=kv, cap=cap)
                        row = dict(model=name, machine=m.name, gpus=m.gpus, hbm_gib=m.hbm_bytes / GIB,
                                   host_gib=m.host_bytes / GIB, kv_dtype="bf16" if kv == "auto" else "fp8",
                                   context=ctx, attention=att, batch=fit.batch, limit=fit.limit,
                                   why=fit.why(m), tokens=fit.batch * ctx)
                        if att == "sparse":   # the same without the ingest's transient (issue 50 item 1's goal)
                            row["batch_without_transient"] = sizing.largest_batch(
                                mc, ctx, m, attention=att, kv_dtype=kv, cap=cap, transient=False).batch
                        out.append(row)
    return out


def table(rs: list[dict], model: str) -> str:
    """Markdown: one line per (machine, kv dtype), a column per context, each cell sparse / dense batch."""
    ctxs = sorted({r["context"] for r in rs})
    head = "| machine | pages | " + " | ".join(f"{c // 1024}K" for c in ctxs) + " |"
    lines = [head, "|" + "---|" * (2 + len(ctxs))]
    keys = sorted({(r["gpus"], r["machine"], r["kv_dtype"]) for r in rs if r["model"] == model})
    for g, mname, kv in keys:
        cells = []
        for c in ctxs:
            got = {r["attention"]: r for r in rs if (r["model"], r["machine"], r["kv_dtype"], r["context"])
                   == (model, mname, kv, c)}
            sp, de = got["sparse"], got["dense"]
            extra = (f" ({sp['batch_without_transient']})" if sp["batch_without_transient"] != sp["batch"] else "")
            cells.append(f"{sp['batch']}{extra} / {de['batch']}")
        lines.append(f"| {mname} | {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rs: list[dict], path: str) -> None:
    from scripts import bench_meta
    plt = bench_meta.pyplot()
    models = sorted({r["model"] for r in rs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for g, kv, att in sorted({(r["gpus"], r["kv_dtype"], r["attention"]) for r in rs}):
            # colour: the machine; line: solid sparse, dashed dense; marker: circle bf16, square fp8
            style = "bgrk"[[1, 2, 4, 8].index(g) % 4] + ("-" if att == "sparse" else "--") + ("o" if kv == "bf16" else "s")
            pts = sorted((r["context"], r["batch"]) for r in rs
                         if (r["model"], r["gpus"], r["kv_dtype"], r["attention"]) == (model, g, kv, att))
            xs = [c // 1024 for c, b in pts if b > 0]
            ys = [b for _, b in pts if b > 0]
            if xs:
                ax.plot(xs, ys, style, label=f"x{g} {kv} {att}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("largest batch")
        ax.set_title(f"{model}: H200 kinds, TP over every GPU (computed)")
        ax.legend(fontsize=6, ncol=2)
    bench_meta.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    from scripts import bench_meta
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_meta.add_common_args(ap, out_default=None, out_default_help="none: print the tables only",
                               files="capacity.json, capacity.png")
    return ap


def main(argv=None) -> int:
    import os
    from scripts import bench_meta
    args = build_parser().parse_args(argv)
    rs = rows()
    for model in MODELS:
        print(f"\n{model} (sparse / dense largest batch; in parentheses: sparse without the ingest transient)")
        print(table(rs, model))
    if args.out:
        meta = bench_meta.run_meta(args.commit, kind="computed (runtime/sizing.py), not measured",
                                   hbm_gib_per_gpu=MEM_FRACTION * HBM_GIB, mem_fraction=MEM_FRACTION,
                                   pin_fraction=PIN_FRACTION, machines=[dict(gpus=g, ram_gib=r) for g, r in MACHINES])
        bench_meta.write_json(os.path.join(args.out, "capacity.json"), dict(meta=meta, rows=rs))
        plot(rs, os.path.join(args.out, "capacity.png"))
        print(f"wrote {args.out}/capacity.json, capacity.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
