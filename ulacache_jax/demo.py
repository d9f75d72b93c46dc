"""`make demo`: batch offline inference through the `ulacache generate` command on the built-in tiny preset with
RANDOM weights and built-in long prompts (ulacache_jax/demo_prompts.py), then the report.

The prompts (1.2K-3.7K byte tokens) are far longer than the token budget (512 tokens = 8 pages of 64 per
KV-head group), so query-aware selection picks pages every step; the HBM frame pool (128 frames) holds just one
step's selections of the four slots (4 x 2 layers x 2 groups x 8 pages), so as selections move, pages are
evicted and fetched back from the host tier, which holds every page; six requests share four slots, so
continuous batching admits the queued ones as others finish. The generated text is
gibberish (random weights); the numbers are the cache's. Runs the jnp reference paths on CPU.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from .demo_prompts import demo_prompts

DEMO_ARGS = ["--page-size", "64", "--token-budget", "512", "--hbm-pages", "128", "--max-seqs", "4",
             "--max-prefill-tokens", "4096", "--seed", "0"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ulacache_jax.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=None, help="where to write results, report and plot (default: a temp dir)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out_dir or tempfile.mkdtemp(prefix="ulacache-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    prompts = demo_prompts()
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print("UlaCache-JAX demo: batch inference with the `ulacache generate` command")
    print("  model: the built-in 'tiny' preset with RANDOM weights (2 layers, 2 KV heads, byte vocab):")
    print("         the generated text is gibberish; the cache statistics are real")
    print(f"  prompts: {len(prompts)} built-in long prompts of "
          f"{min(len(p['prompt']) for p in prompts)}-{max(len(p['prompt']) for p in prompts)} bytes "
          "(byte tokens), 4 sequence slots, continuous batching")
    print("  cache: page 64, token budget 512 (8 pages a KV-head group), 128 HBM frames (one step's selections),")
    print("         every page in the host tier")
    print(f"  files: {out}/")
    sys.stdout.flush()
    from . import cli

    t0 = time.perf_counter()
    rc = cli.main(["generate", "--input", str(out / "prompts.jsonl"), "--output", str(out / "results.jsonl"),
                   "--report", str(out / "report.json"), "--overwrite", *DEMO_ARGS])
    print(f"demo: `ulacache generate` took {time.perf_counter() - t0:.1f} s (exit code {rc})")
    if (out / "results.jsonl").exists():
        print("sample outputs (random weights, so gibberish):")
        for line in (out / "results.jsonl").read_text().splitlines()[:3]:
            r = json.loads(line)
            text = (r.get("text") or r.get("error") or "").replace("\n", " ")
            print(f"  {r['id']:>12}: {r.get('finish_reason')}, {r.get('completion_tokens', 0)} tokens: "
                  f"{text[:60]!r}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
