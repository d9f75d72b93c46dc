"""Studies whose answers are in docs/BENCHMARKS.md (`python -m scripts.studies.<name>`)."""
