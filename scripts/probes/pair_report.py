"""The report of a same-call decode pair (`scripts/probes/regression_pair.sh`): reads the old and new trees'
`decode.json` under OUT, prints tokens/s per row and the change, and writes `<name>.json` (meta: device, jax,
the two commits, date, command; the pairs; both trees' full rows) and `<name>.png` (tokens/s side by side).

The pair script labels its rows "old" / "new" (each tree is a `git archive` export without history); the real
commits come in here (`--old-commit`, `--new-commit`) so that the JSON cites them.
  python3 scripts/probes/pair_report.py OUT --old-commit 737bd7b --new-commit 1a56825 --name decode_sieve_floor \
      --out docs/benchmarks
"""
from __future__ import annotations

import argparse
import json
import os

from scripts import bench_meta


def load_rows(out: str, side: str) -> tuple[dict, list[dict]]:
    """(meta, rows with a tokens/s) of one tree's decode.json; empty when that tree's rows all failed."""
    path = os.path.join(out, side, "decode.json")
    if not os.path.exists(path):
        return {}, []
    with open(path) as f:
        data = json.load(f)
    rows = data.pop("rows", [])
    return data, [r for r in rows if "tokens_per_s" in r]


def pairs_of(old: list[dict], new: list[dict]) -> list[dict]:
    """One entry per (attention, context, batch, kv_fraction) row, with either side None where that tree's row
    failed (kept, not dropped: a pair where one commit fails is the finding)."""
    by_row: dict[tuple, dict] = {}
    for side, rows in (("old", old), ("new", new)):
        for r in rows:
            by_row.setdefault((r["attention"], r["context"], r["batch"], r.get("kv_fraction")), {})[side] = r
    pairs = []
    for (attention, context, batch, kv_fraction), v in sorted(by_row.items(),
                                                              key=lambda kv: kv[0][:3] + (kv[0][3] or 0.0,)):
        o, n = v.get("old"), v.get("new")
        pairs.append(dict(attention=attention, context=context, batch=batch, kv_fraction=kv_fraction,
                          old_tokens_per_s=o and o["tokens_per_s"], new_tokens_per_s=n and n["tokens_per_s"],
                          old_hit_rate=o and o.get("hit_rate"), new_hit_rate=n and n.get("hit_rate"),
                          change=(n["tokens_per_s"] / o["tokens_per_s"] - 1) if o and n else None))
    return pairs


def label(p: dict) -> str:
    """'sparse 256K x 1 pool 0.0156': the row's side, shape and HBM pool fraction (dense rows have none)."""
    pool = "" if p.get("kv_fraction") in (None, 1.0) else f" pool {p['kv_fraction']:.3g}"
    return f"{p['attention']} {p['context'] // 1024}K x {p['batch']}{pool}"


def table(pairs: list[dict]) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    lines = [f"{'row':30s} {'old tok/s':>10s} {'new tok/s':>10s} {'change':>8s}"]
    for p in pairs:
        ch = "-" if p["change"] is None else f"{100 * p['change']:+.1f}%"
        lines.append(f"{label(p):30s} "
                     f"{fmt(p['old_tokens_per_s']):>10s} {fmt(p['new_tokens_per_s']):>10s} {ch:>8s}")
    return "\n".join(lines)


def plot(pairs: list[dict], old_commit: str, new_commit: str, path: str) -> str:
    plt = bench_meta.pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(pairs), 3.6))
    xs = range(len(pairs))
    for off, side, commit in ((-0.2, "old", old_commit), (0.2, "new", new_commit)):
        # a side whose row failed is NaN: no bar, rather than a bar of zero tokens/s
        ax.bar([x + off for x in xs], [p[f"{side}_tokens_per_s"] or float("nan") for p in pairs], width=0.4,
               label=commit)
    ax.set_xticks(list(xs), [label(p).replace(" pool", "\npool") for p in pairs])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("same-call decode pair (median of the chunks)")
    ax.legend()
    return bench_meta.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", metavar="OUT", help="regression_pair.sh's OUT (holds old/decode.json and new/decode.json)")
    ap.add_argument("--old-commit", default="old")
    ap.add_argument("--new-commit", default="new")
    ap.add_argument("--name", default="regression_pair")
    # no --commit: the rows' commits are the two trees', --old-commit and --new-commit
    return bench_meta.add_common_args(ap, out_default=None, out_default_help="OUT, beside the two trees' rows",
                                      files="NAME.json, NAME.png (--name)", commit=False)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    old_meta, old = load_rows(args.pairs, "old")
    new_meta, new = load_rows(args.pairs, "new")
    if not (old or new):
        raise SystemExit(f"no decode rows with tokens_per_s under {args.pairs}/old or {args.pairs}/new")
    pairs = pairs_of(old, new)
    print(table(pairs))
    meta_src = new_meta or old_meta
    for rows, commit in ((old, args.old_commit), (new, args.new_commit)):
        for r in rows:
            r["commit"] = commit
    meta = dict(device=meta_src.get("device"), jax=meta_src.get("jax"),
                commit=f"{args.old_commit} (old) / {args.new_commit} (new)", date=meta_src.get("date"),
                model=meta_src.get("model"), kv=meta_src.get("kv"),
                command=f"old: {old_meta.get('command', '-')}; new: {new_meta.get('command', '-')}")
    dest = args.out or args.pairs
    bench_meta.write_json(os.path.join(dest, f"{args.name}.json"), dict(meta=meta, pairs=pairs, rows=old + new))
    try:
        plot(pairs, args.old_commit, args.new_commit, os.path.join(dest, f"{args.name}.png"))
    except ImportError as e:  # the GPU image may lack matplotlib: rerun this script on the JSON's machine
        print(f"no PNG ({e}); the JSON is written: rerun pair_report.py on {args.pairs} where matplotlib is installed")


if __name__ == "__main__":
    main()
