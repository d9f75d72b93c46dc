"""Speculative decoding: draft rules, acceptance, and the device n-gram drafter."""
