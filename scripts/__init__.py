"""Benchmarks, the quality harness and batch tools, run as `python -m scripts.<name>` from the repo root."""
