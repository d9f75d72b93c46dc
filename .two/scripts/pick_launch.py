"""Command-line flags for the fastest measured selection kernels: reads bench_select's JSON and prints
`--score-launch BP W` for the fastest score launch shape that matched the reference, and `--topk ref` when
lax.top_k beat the radix-select kernel (the GPU default) there. Prints nothing when the file is missing, so a
device script falls back to the defaults: `python3 scripts/bench_decode.py ... $(python3 scripts/pick_launch.py select.json)`.
"""
from __future__ import annotations

import json
import sys


def pick(select: dict) -> list[str]:
    rows = select.get("rows", [])
    flags = []
    kern = [r for r in rows if r.get("kind") == "scores" and r.get("impl") == "pallas" and r.get("ok") and "us" in r]
    if kern:
        best = min(kern, key=lambda r: r["us"])
        flags += ["--score-launch", str(best["block_pages"]), str(best["num_warps"])]
    # the decode's kernel is the one-launch radix select (chunks 1, or rows older than the chunks field)
    topk = {r["impl"]: r for r in rows if r.get("kind") == "top_k" and r.get("ok") and "us" in r
            and r.get("chunks", 1) == 1}
    if "lax.top_k" in topk and ("pallas_radix" not in topk or topk["lax.top_k"]["us"] < topk["pallas_radix"]["us"]):
        flags += ["--topk", "ref"]
    return flags


def main(argv: list[str]) -> None:
    try:
        with open(argv[0]) as f:
            select = json.load(f)
    except (IndexError, OSError, ValueError):
        return
    print(" ".join(pick(select)))


if __name__ == "__main__":
    main(sys.argv[1:])
