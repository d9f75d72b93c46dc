"""Offline calibration of label channels (issue 48, Double Sparsity's offline step): per layer and KV head, which
rotary pairs of the head dimension carry the most of q.k after RoPE on real text.

    python -m scripts.calibrate_labels --model qwen2.5-coder-0.5b --channels 8,16 --out models/calibration
    python -m scripts.calibrate_labels --tiny --out /tmp/cal            # the tiny random model (tests)

A dense forward over a few windows of shipped text (scripts/haystacks.py: Austen, the essays, pydoc) records, for
every layer, KV head and channel d, mean |q_d| over the query heads of the group and every token, and mean |k_d|
over every token. Their product is the mean of |q_d k_d| over all (query, key) pairs (the sums factor), the
channel's expected share of the logits' magnitude. A pair (d, d + D/2) scores the sum of its members'
(select/labels.pair_channels picks the C / 2 best pairs). Output: one JSON per model, named by the model file's
sha256 (`<digest16>.json`), `{"model_digest", "model", "text", "windows", "tokens", "score" [L][KV][D],
"channels": {"C": [L][KV][C]}}`; CacheConfig.channel_table takes `channels[str(C)]` (the CLI's --channel-table
finds the file by the model's digest).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from scripts.bench_meta import add_common_args, git_commit, write_json


def channel_stats(model, windows):
    """windows [N, T] int token ids -> (mean |q| [L, KV, D], mean |k| [L, KV, D]) float64 over every window's
    tokens, q averaged over each KV head's query heads. One jitted dense forward per window (blocked attention:
    memory linear in T)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax.models.attention import blocked_attention

    L, KV = model.config.num_layers, model.config.num_kv_heads
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, ids):
        m = nnx.merge(graphdef, params)
        pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

        def attn(cache, q, k, v, meta, layer):
            b, t, h, d = q.shape
            qa = jnp.abs(q.astype(jnp.float32)).reshape(b, t, KV, h // KV, d).mean(axis=(0, 1, 3))   # [KV, D]
            ka = jnp.abs(k.astype(jnp.float32)).mean(axis=(0, 1))                                    # [KV, D]
            cache = (cache[0].at[layer].set(qa), cache[1].at[layer].set(ka))
            return cache, blocked_attention(q, k, v, meta, meta)

        D = model.config.head_dim
        zero = (jnp.zeros((L, KV, D), jnp.float32), jnp.zeros((L, KV, D), jnp.float32))
        (qs, ks), _ = m.forward_with_cache(zero, ids, pos, pos, attn)
        return qs, ks

    qsum = ksum = 0.0
    for w in windows:
        qs, ks = run(params, jnp.asarray(w, jnp.int32)[None])
        qsum, ksum = qsum + np.asarray(qs, np.float64), ksum + np.asarray(ks, np.float64)
    return qsum / len(windows), ksum / len(windows)


def tables(score, channels):
    """score [L, KV, D] -> {C: [L][KV][C]} pair-aware picks (labels.pair_channels) for each C."""
    import jax.numpy as jnp
    from ulacache_jax.cache.select import labels
    return {str(c): np.asarray(labels.pair_channels(jnp.asarray(score, jnp.float32), c)).tolist() for c in channels}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny random-weight preset (tests)")
    ap.add_argument("--channels", default="8,16", help="comma list of C (even) to write tables for")
    ap.add_argument("--text", default="austen", help="haystack source of the windows (scripts/haystacks.py)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens a window")
    # --out required: the shipped tables live in models/calibration/, a test's in its scratch folder; the model is
    # the 32K model the tables ship for; float32: channel statistics, not decoding, so no bf16 rounding in them
    return add_common_args(ap, out_required=True, files="<model digest16>.json", model="qwen2.5-coder-0.5b",
                           dtype="float32")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    channels = [int(c) for c in args.channels.split(",")]
    if any(c < 2 or c % 2 for c in channels):
        ap.error(f"--channels {args.channels}: each C must be even and >= 2 (whole rotary pairs)")
    if args.windows < 1 or args.tokens < 16:
        ap.error(f"--windows {args.windows} must be >= 1 and --tokens {args.tokens} >= 16")
    import jax.numpy as jnp
    from ulacache_jax import models
    from ulacache_jax.models import calibration
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    if args.tiny:
        from flax import nnx
        model = models.LlamaModel(models.get_preset("tiny"), dtype=dt, rngs=nnx.Rngs(0))
        windows = rng.integers(0, model.config.vocab_size, (args.windows, args.tokens))
        digest, label, text = "tiny-random-seed0", "tiny", "random tokens"
    else:
        from scripts import haystacks
        path = models.resolve_model_path(args.model)
        model, tok = models.from_pretrained(str(path), dtype=dt), models.load_tokenizer(str(path))
        fn = haystacks.haystack_fn(args.text, tok)
        windows = []
        for i in range(args.windows):
            ids = tok.encode(fn(args.tokens + 64, seed=1000 + i))
            ids = getattr(ids, "ids", ids)[:args.tokens]
            windows.append(ids)
        digest, label, text = calibration.file_digest(path), str(args.model), args.text
    if any(c > model.config.head_dim for c in channels):
        ap.error(f"--channels {args.channels}: C must be <= head_dim = {model.config.head_dim}")
    t0 = time.perf_counter()
    qm, km = channel_stats(model, windows)
    score = qm * km
    out = dict(model_digest=digest, model=label, text=text, windows=len(windows), tokens=args.tokens,
               commit=args.commit or git_commit(), score=score.round(6).tolist(), channels=tables(score, channels))
    dest = pathlib.Path(args.out) / f"{digest[:16]}.json"
    write_json(str(dest), out, indent=None)   # one result, written whole (the shipped tables are compact)
    print(f"{label}: {len(windows)} windows x {args.tokens} tokens in {time.perf_counter() - t0:.1f} s -> {dest}",
          file=sys.stderr)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
