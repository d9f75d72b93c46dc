"""Command-line flags for the fastest measured selection kernels: reads bench_select's JSON (and optionally a
bench_layer JSON) and prints `--score-launch BP W` for the fastest score launch shape that matched the reference,
plus `--topk pallas` when the radix-select top-k matched lax.top_k and was faster (and, given a layer JSON, its
layer row also passed the all-reference check). Prints nothing when a file is missing, so a device script can
fall back to the defaults: `python3 scripts/bench_decode.py ... $(python3 scripts/pick_launch.py select.json)`.
"""
from __future__ import annotations

import json
import sys


def pick(select: dict, layer: dict | None = None) -> list[str]:
    rows = select.get("rows", [])
    scores = [r for r in rows if r.get("kind") == "scores" and r.get("ok") and "us" in r]
    flags = []
    kern = [r for r in scores if r["impl"] == "pallas"]
    if kern:
        best = min(kern, key=lambda r: r["us"])
        flags += ["--score-launch", str(best["block_pages"]), str(best["num_warps"])]
    topk = {r["impl"]: r for r in rows if r.get("kind") == "top_k" and r.get("ok") and "us" in r}
    if "pallas_radix" in topk and "lax.top_k" in topk and topk["pallas_radix"]["us"] < topk["lax.top_k"]["us"]:
        layer_ok = layer is None or any(r.get("kind") == "resident-topk-kernel" and r.get("ok")
                                        for r in layer.get("rows", []))
        if layer_ok:
            flags += ["--topk", "pallas"]
    return flags


def main(argv: list[str]) -> None:
    docs = []
    for path in argv[:2]:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError):
            docs.append(None)
    if not docs or docs[0] is None:
        return
    print(" ".join(pick(docs[0], docs[1] if len(docs) > 1 else None)))


if __name__ == "__main__":
    main(sys.argv[1:])
