"""The projected key copy (select/key_pca.py): a cache built by ingest + decode steps holds every flushed key's
coordinates in the principal basis of its sequence's first ingested block (checked against numpy's own
eigendecomposition, up to each direction's sign), at 8 / 4 bits within the labels' rounding; with C = D the page
mass is the true attention mass whatever the basis; generate with a covering budget gives dense's tokens, a small
budget runs through the Engine; bad values are refused."""
import numpy as np
import pytest
import jax.numpy as jnp

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.cache.select import key_copy
from ulacache_jax.cache.select.key_pca import KeyPCA, pick_basis
from ulacache_jax.cache.select.labels import dequantize
from cache_steps import assert_covering_budget_equals_dense, ingest_and_decode, tiny_model

PAGE, C, D = 8, 4, 16


def _config(rule):
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=D, max_seqs=3, max_pages_per_seq=32, page_size=PAGE,
                       num_buckets=4, slots_per_bucket=8, host_pages=512, token_budget=32, dtype="float32",
                       sink_pages=1, recent_pages=1, selection=rule)


def _np_basis(k):
    """numpy's reference: (C principal directions of the centred keys [D, C], their mean [D])."""
    mean = k.mean(0)
    w, v = np.linalg.eigh((k - mean).T @ (k - mean))
    return v[:, ::-1][:, :C], mean


def test_pick_basis_is_the_centred_principal_subspace():
    rng = np.random.default_rng(0)
    offset = np.zeros(D, np.float32)
    offset[D - 1] = 40.0                                 # a large common offset: uncentred PCA would spend a direction on it
    k = rng.standard_normal((50, 1, D)).astype(np.float32) * np.linspace(3, 0.1, D).astype(np.float32) + offset
    live = np.arange(50) < 40
    proj = np.asarray(pick_basis(jnp.asarray(k), jnp.asarray(live), C))[0]           # [D + 1, C]
    b, shift = proj[:D], proj[D]
    want, mean = _np_basis(k[:40, 0])
    np.testing.assert_allclose(np.abs(np.sum(b * want, axis=0)), 1.0, atol=1e-4)      # same directions
    np.testing.assert_allclose(b.T @ b, np.eye(C), atol=1e-5)                        # orthonormal
    np.testing.assert_allclose(shift, -mean @ b, rtol=1e-4, atol=1e-3)
    assert np.abs(b[D - 1]).max() < 0.2                  # the offset channel has little variance: not a direction
    none = np.asarray(pick_basis(jnp.asarray(k), jnp.zeros(50, bool), C))[0]
    np.testing.assert_array_equal(none, np.eye(D + 1, C))


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_copy_holds_each_key_in_its_sequences_basis(bits):
    rule = KeyPCA(channels=C, bits=bits)
    c = _config(rule)
    rng = np.random.default_rng(1)
    lengths = [37, 61, 8]
    _, state, _, ks = ingest_and_decode(c, lengths, 13, rng, key_scale=rng.uniform(0.2, 3.0, D).astype(np.float32))
    sel = state.sel
    assert sel.chan.shape == (1, 3, 2, 2, 1, D + 1, C) and sel.chan.dtype == jnp.float32
    for s, (k, n0) in enumerate(zip(ks, lengths)):
        fl = int(state.seqs.flushed[s])
        for l in range(2):
            for gi in range(2):
                proj = np.asarray(sel.chan[0, s, l, gi, 0])                           # [D + 1, C]
                b = proj[:D]
                ref, mean = _np_basis(k[l, :n0, gi])
                np.testing.assert_allclose(np.abs(np.sum(b * ref, axis=0)), 1.0, atol=1e-3)
                want = (k[l, :fl * PAGE, gi] - mean) @ b                              # [T, C]
                codes = sel.kc[0, s, l, gi, :fl]                                      # [fl, PAGE, 1, Cs]
                if bits:
                    got = np.asarray(dequantize(codes, sel.ksc[0, s, l, gi, :fl], bits)).reshape(-1, C)
                    step = np.asarray(sel.ksc[0, s, l, gi, :fl], np.float32).reshape(fl, 1, C)
                    err = np.abs(got - want).reshape(fl, PAGE, C)
                    assert (err <= step * 0.5 + 1e-2 * np.abs(want).max()).all()
                else:
                    np.testing.assert_allclose(np.asarray(codes).reshape(-1, C), want, rtol=1e-4, atol=1e-4)


def test_every_coordinate_gives_the_true_mass():
    """C = D: (q B) . (k B + shift) = q . k + a constant for an orthonormal B, so the page mass is the key copy's with
    every channel."""
    rng = np.random.default_rng(2)
    S, G, P, g, H = 2, 2, 4, 1, 2
    k = rng.standard_normal((S, 1, G, P, PAGE, g, D)).astype(np.float32)
    q = rng.standard_normal((S, 1, G * g * H, D)).astype(np.float32)
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
    shift = rng.standard_normal(D).astype(np.float32)             # a shift adds q . const to every logit: no change
    B = jnp.broadcast_to(jnp.asarray(np.concatenate([basis, shift[None]], 0)), (S, G, g, D + 1, D))
    kc = key_copy.compress(jnp.asarray(k).reshape(S, 1, G, P * PAGE, g, D), B[:, None]).reshape(k.shape)
    flushed = jnp.asarray([4, 3], jnp.int32)
    got = key_copy.page_mass(kc, B, jnp.asarray(q), flushed, layer=0, impl="ref")
    ids = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (S, G, g, D))
    want = key_copy.page_mass(jnp.asarray(k), ids, jnp.asarray(q), flushed, layer=0, impl="ref")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bits", [0, 4])
def test_generate_covering_budget_equals_dense(bits):
    assert_covering_budget_equals_dense(tiny_model(), selection=KeyPCA(channels=4, bits=bits))


def test_engine_small_budget():
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.generation import Generator, default_cache_config
    model = tiny_model()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (120, 45)]
    cfg = default_cache_config(model.config, num_seqs=2, max_tokens=192, page_size=16, token_budget=48,
                               selection=KeyPCA(channels=4, bits=4))
    eng = Engine(generator=Generator(model, cfg, attention="sparse"), prefix_cache=False)
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=12))
    assert all(r.finish_reason == "length" and len(r.tokens) == 12 for r in reqs), [r.error for r in reqs]


@pytest.mark.parametrize("rule, msg", [(KeyPCA(channels=0), "channels = 0"), (KeyPCA(channels=17), "channels = 17"),
                                       (KeyPCA(channels=3, bits=4), "bits = 4"), (KeyPCA(channels=4, bits=2), "bits = 2"),
                                       (KeyPCA(channels=4, table=((0, 1, 2, 3),)), "channel table")])
def test_bad_values(rule, msg):
    with pytest.raises(ValueError, match=msg):
        _config(rule)


def test_cli_key_basis_pca(tmp_path, capsys):
    """`ulacache generate --key-channels C --key-basis pca [--label-bits B]` decodes with the projected copy, is
    fingerprinted apart from the channel copy, and refuses a basis without channels or with a channel table."""
    import json
    from ulacache_jax.app import cli, jsonl_io
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": list(range(1 + i, 150 + i))}) + "\n" for i in range(2)))
    args = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", "2", "--max-context", "256",
            "--max-new-tokens", "4", "--no-progress", "--stop-ids", "none", "--compile-cache", "off", "--quiet",
            "--attention", "sparse"]
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "--input", str(inp), "--output", str(out), "--key-channels", "4", "--label-bits", "4",
                     "--key-basis", "pca", *args]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows] == ["length", "length"] and all(len(r["token_ids"]) == 4 for r in rows)
    parser = cli.build_parser()
    settings = lambda *extra: cli.run_settings(parser.parse_args(["generate", "--input", "i", "--output", "o",
                                                                  "--key-channels", "4", *extra, *args]))
    pca, chans = settings("--key-basis", "pca"), settings()
    assert pca["key_basis"] == "pca" and "key_basis" not in chans
    assert jsonl_io.settings_fingerprint(pca) != jsonl_io.settings_fingerprint(chans)
    for extra, msg in ((["--key-basis", "pca"], "--key-basis pca needs --key-channels"),
                       (["--key-basis", "pca", "--key-channels", "4", "--label-bits", "4", "--channel-table",
                         str(tmp_path / "t.json")], "does not apply")):
        assert cli.main(["generate", "--input", str(inp), "--output", str(tmp_path / "x.jsonl"), *extra, *args]) == 2
        assert msg in capsys.readouterr().err
