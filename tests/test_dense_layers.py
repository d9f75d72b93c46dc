"""scripts/studies/dense_layers.py: the oracle keeps the sink, recent, tail and heaviest pages; a budget covering the
context, or every layer dense, decodes dense's tokens; layer sets parse with negative indices and refuse others."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from scripts.studies import dense_layers as dl


def test_oracle_keeps_forced_and_heaviest_pages():
    page, T = 4, 32                                     # 8 pages; pos 29 -> 7 flushed pages, page 7 the tail
    logits = np.full((1, 2, T), -5.0, np.float32)
    logits[:, :, 12:16] = 5.0                           # page 3 carries the mass
    logits[:, :, 30:] = -np.inf                         # past pos
    keep = np.asarray(dl.oracle_keep(jnp.asarray(logits), jnp.int32(29), page=page, keep=4, sink=1, recent=2))
    pages = sorted({t // page for t in range(T) if keep[0, t]})
    assert pages == [0, 3, 5, 6, 7]                     # sink, heaviest, the two recent, the tail
    every = np.asarray(dl.oracle_keep(jnp.asarray(logits), jnp.int32(29), page=page, keep=8, sink=1, recent=2))
    assert every.all()


def test_parse_set():
    assert dl.parse_set("none", 24) == () and dl.parse_set("0,1,-1", 24) == (0, 1, 23)
    with pytest.raises(SystemExit, match="layer 24 outside"):
        dl.parse_set("24", 24)


def test_summary_counts_dense_answers_kept():
    def row(prompt, config, acc):
        return {"prompt": prompt, "config": config, "page_size": None if config == "dense" else 16, "budget": None,
                "dense_layers": [], "accuracy": acc, "same_as_dense": False, "read_share": 0.5}
    rows = [row("a", "dense", 1.0), row("b", "dense", 1.0), row("c", "dense", 0.5),
            row("a", "oracle", 1.0), row("b", "oracle", 0.75), row("c", "oracle", 1.0)]
    dense, oracle = dl.summarize(rows)
    assert (dense["fully_right"], dense["kept_of_dense"]) == (2, 2)
    assert (oracle["config"], oracle["fully_right"], oracle["kept_of_dense"]) == ("oracle", 2, 1)  # c is not dense's
    assert oracle["accuracy"] == pytest.approx(2.75 / 3)


@pytest.mark.slow
def test_covering_budget_and_all_dense_decode_dense_tokens(tmp_path):
    assert dl.main(["--tiny", "--page-size", "8", "--budget", "512", "--dense-sets", "none", "0,-1",
                    "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "dense_layers.json").read_text())["runs"][-1]
    assert all(r["same_as_dense"] for r in run["rows"])
    assert (tmp_path / "dense_layers.png").stat().st_size > 0
    assert dl.main(["--tiny", "--page-size", "8", "--budget", "16", "512", "--dense-sets", "0,1",
                    "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "dense_layers.json").read_text())["runs"][-1]
    assert all(r["same_as_dense"] for r in run["rows"])   # tiny has 2 layers: both dense = dense
    assert [s["read_share"] for s in run["summary"]] == [1.0, 1.0, 1.0]
    assert [s["budget"] for s in run["summary"]] == [None, 16, 512] and run["budgets"] == [16, 512]


def test_bad_budget_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--budget 12 must be a positive multiple of --page-size 8"):
        dl.main(["--tiny", "--page-size", "8", "--budget", "16", "12", "--out", str(tmp_path)])
    assert not (tmp_path / "dense_layers.json").exists()


def test_padded_prefill_equals_the_unpadded_forward():
    """The prefill right-pads to the cache length: the prompt's keys, values, last logits and last queries are the
    unpadded forward's (causal attention never sees the padding)."""
    from flax import nnx
    from ulacache_jax import models
    from scripts.studies.selection_recall import dense_forward
    model = models.LlamaModel(models.get_preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    c = model.config
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 256, 37)]
    _, params = nnx.split(model)
    (k, v), last, qw = dl.make_prefill(model, 8)(params, ids, 64)

    def store(cache, q, k, v, layer):
        return cache[0].at[layer].set(k), cache[1].at[layer].set(v), cache[2].at[layer].set(q[0])
    z = jnp.zeros((c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim), jnp.float32)
    qz = jnp.zeros((c.num_layers, len(ids), c.num_heads, c.head_dim), jnp.float32)
    (k0, v0, q0), h = dense_forward(model, ids, (z, z, qz), store)
    np.testing.assert_allclose(np.asarray(qw), np.asarray(q0[:, -8:]), rtol=1e-5, atol=1e-5)   # the last 8 queries
    np.testing.assert_allclose(np.asarray(k[:, :, :len(ids)]), np.asarray(k0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v[:, :, :len(ids)]), np.asarray(v0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(last), np.asarray(model.logits(h[:, -1:])[0, -1]), rtol=1e-4, atol=1e-4)


def test_prompt_anchors_pick_the_questions_pages():
    """The question's queries point at page 2 in layer 0 and page 5 in layer 1: those are the anchors; the sink
    page and pages past the prompt are never anchors; oracle_keep keeps an anchor whatever its step mass."""
    L, T, KV, H, D, page, W = 2, 64, 1, 2, 4, 8, 3
    k = np.zeros((L, 1, T, KV, D), np.float32)
    k[0, 0, 16:24, 0, 0] = 4.0                                  # layer 0: page 2 matches the queries
    k[1, 0, 40:48, 0, 0] = 4.0                                  # layer 1: page 5
    k[:, 0, 0:8, 0, 0] = 9.0                                    # the sink page draws most (excluded)
    k[:, 0, 56:, 0, 0] = 9.0                                    # past the prompt (n = 56): never an anchor
    qw = np.zeros((L, W, H, D), np.float32)
    qw[..., 0] = 1.0
    got = np.asarray(dl.prompt_anchors(jnp.asarray(k), jnp.asarray(qw), jnp.int32(56), page=page, count=1, sink=1))
    assert got.shape == (L, KV, T // page)
    assert [list(np.flatnonzero(got[i, 0])) for i in range(L)] == [[2], [5]]
    logits = np.full((1, 1, T), 5.0, np.float32)
    logits[:, :, 51:] = -np.inf                                 # pos 50: pages 0-5 flushed, 6 the tail
    kept = [sorted({t // page for t in range(T) if m[0, t]}) for m in (
        np.asarray(dl.oracle_keep(jnp.asarray(logits), jnp.int32(50), page=page, keep=2, sink=1, recent=0,
                                  anchor=a)) for a in (jnp.asarray(got[1]), None))]
    assert kept == [[0, 5, 6, 7], [0, 1, 6, 7]]   # sink + anchor 5 (+ the tail), or sink + the first tie


def test_anchors_over_the_budget_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--anchors 6 must be in"):
        dl.main(["--tiny", "--page-size", "8", "--budget", "64", "--anchors", "6", "--out", str(tmp_path)])
