#!/usr/bin/env python
"""Batch offline inference: a thin wrapper over `ulacache generate` (same options; see --help).

    python scripts/batch_infer.py --input prompts.jsonl --output results.jsonl [--model PATH_OR_PRESET] ...
"""
import sys

from ulacache_jax.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
