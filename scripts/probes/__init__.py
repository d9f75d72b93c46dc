"""One-question probes run on the H200 (`python -m scripts.probes.<name>`)."""
