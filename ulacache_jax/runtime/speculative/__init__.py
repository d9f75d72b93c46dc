"""Speculative decoding: the rules (config, acceptance, bounds, back-off, host ngram drafter: rules.py), the device
ngram drafter (ngram.py), and the Engine's speculative step over a Generator (decoder.py)."""
