import json
import re

import numpy as np
import pytest

from scripts.studies import oracle_ppl


@pytest.mark.slow
def test_every_page_is_dense_and_a_small_budget_is_not(tmp_path):
    """The oracle with every page kept scores exactly what the dense pass scores; a budget of 4 pages of 16 does not;
    runs append to the JSON."""
    args = ["--tiny", "--window", "256", "--prefix", "192", "--windows", "2", "--page-size", "16",
            "--budget", "64", "1024", "--out", str(tmp_path)]
    assert oracle_ppl.main(args) == 0
    assert oracle_ppl.main(args + ["--run", "again"]) == 0
    data = json.load(open(tmp_path / "oracle_ppl.json"))
    assert [r["run"] for r in data["runs"]] == ["", "again"]
    s = {x["config"]: x for x in data["runs"][0]["summary"]}
    dense, every, few = s["dense"], s["oracle, budget 1024, page 16"], s["oracle, budget 64, page 16"]
    assert dense["n"] == every["n"] == few["n"] == 2 * (256 - 1 - 192)
    assert every["ppl"] == pytest.approx(dense["ppl"], rel=1e-5) and every["top1_agreement"] == 1.0
    assert every["kl"] == pytest.approx(0.0, abs=1e-6)
    assert few["kl"] > 1e-4 and few["top1_agreement"] < 1.0
    assert (tmp_path / "oracle_ppl.png").stat().st_size > 0


def test_summary_pools_windows_by_their_positions():
    """ppl over every scored position (not a mean of the windows' ppl), ratios to the dense row, top-1 and KL per
    position."""
    rows = [{"window": w, "config": c, "page_size": p, "budget": b, "budget_ratio": r, "n": n, "nll_sum": s,
             "top1_same": t, "kl_sum": k}
            for w, n in ((0, 10), (1, 30))
            for c, p, b, r, s, t, k in (("dense", None, None, 1.0, 1.0 * n, n, 0.0),
                                        ("oracle, budget 64, page 16", 16, 64, 0.25, (1.0 if w == 0 else 2.0) * n,
                                         n // 2, 0.1 * n))]
    dense, sparse = oracle_ppl.summarize(rows)
    assert dense["n"] == sparse["n"] == 40 and dense["ppl"] == pytest.approx(np.e) and dense["ppl_ratio"] == 1.0
    assert sparse["ppl"] == pytest.approx(np.exp((10 + 60) / 40))
    assert sparse["ppl_ratio"] == pytest.approx(np.exp((10 + 60) / 40 - 1))
    assert sparse["top1_agreement"] == pytest.approx(20 / 40) and sparse["kl"] == pytest.approx(0.1)


@pytest.mark.parametrize("bad, needle", [(["--prefix", "300"], "--prefix 300"),
                                         (["--budget", "40"], "--budget 40"),
                                         (["--budget", "48"], "more than --sink 1 + --recent 2"),
                                         (["--windows", "0"], "--windows 0"),
                                         (["--shortlist", "-1"], "--shortlist -1"),
                                         (["--shortlist", "2", "--fetch", "2"], "--fetch 2"),
                                         (["--label-channels", "3"], "--label-channels 3"),
                                         (["--label-channels", "-2"], "--label-channels -2"),
                                         (["--label-channels", "32"], "head_dim 16")])
def test_bad_values_name_the_option(tmp_path, bad, needle):
    with pytest.raises(SystemExit, match=re.escape(needle)):
        oracle_ppl.main(["--tiny", "--window", "256", "--prefix", "192", "--out", str(tmp_path), *bad])
    assert not (tmp_path / "oracle_ppl.json").exists()


@pytest.mark.parametrize("content", ["not json", '{"rows": []}', None])
def test_a_foreign_results_file_stops_the_run_by_name_and_is_kept(tmp_path, content):
    """An oracle_ppl.json this study did not write (not JSON, another script's, a folder) stops the run before the
    model loads, naming it, and is left as it was."""
    target = tmp_path / "oracle_ppl.json"
    if content is None:
        target.mkdir()
    else:
        target.write_text(content)
    with pytest.raises(SystemExit, match=re.escape(repr(str(target)))):
        oracle_ppl.main(["--tiny", "--window", "256", "--prefix", "192", "--out", str(tmp_path)])
    assert target.is_dir() if content is None else target.read_text() == content


def test_label_logits_with_every_channel_exact_are_the_logits_and_quantised_ones_are_close():
    """All D channels at bits 0 give the true logits; 8 bits stay close; C channels use whole rotary pairs (the
    other channels contribute nothing)."""
    import jax.numpy as jnp
    from scripts.studies.dense_layers import label_logits
    rng = np.random.default_rng(0)
    T, KV, g, D = 64, 2, 3, 16
    scales = np.ones(D)
    scales[[D // 2 - 1, D - 1]] = 4.0                     # the pair of largest energy by far
    K = jnp.asarray(rng.normal(size=(T, KV, D)) * scales, jnp.float32)
    q = jnp.asarray(rng.normal(size=(KV, g, D)), jnp.float32)
    true = np.einsum("kgd,tkd->kgt", np.asarray(q), np.asarray(K)) / np.sqrt(D)
    exact = label_logits(q, K, jnp.int32(T - 1), channels=D, bits=0)
    np.testing.assert_allclose(np.asarray(exact), true, rtol=1e-5, atol=1e-5)
    eight = np.asarray(label_logits(q, K, jnp.int32(T - 1), channels=D, bits=8))
    assert np.abs(eight - true).max() < 0.05 * np.abs(true).max()
    # 2 channels: the pair (D/2 - 1, D - 1) of the scales above
    two = np.asarray(label_logits(q, K, jnp.int32(T - 1), channels=2, bits=0))
    pair = [D // 2 - 1, D - 1]
    want = np.einsum("kgd,tkd->kgt", np.asarray(q)[..., pair], np.asarray(K)[..., pair]) / np.sqrt(D)
    np.testing.assert_allclose(two, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_labels_over_every_channel_rank_as_the_oracle(tmp_path):
    """--label-channels D (16) at --label-bits 0 ranks pages by the true logits: the oracle's scores exactly; the
    labels' configurations are named and carry their channels."""
    args = ["--tiny", "--window", "256", "--prefix", "192", "--windows", "1", "--page-size", "16", "--budget", "64",
            "--label-bits", "0", "--out", str(tmp_path)]
    assert oracle_ppl.main(args + ["--label-channels", "0", "16"]) == 0      # the tiny model: D = 16
    s = {x["config"]: x for x in json.load(open(tmp_path / "oracle_ppl.json"))["runs"][0]["summary"]}
    oracle, labels = s["oracle, budget 64, page 16"], s["labels 16 @ 0, budget 64, page 16"]
    assert labels["label_channels"] == 16 and oracle["label_channels"] == 0
    assert labels["ppl"] == pytest.approx(oracle["ppl"], rel=1e-5)
    assert labels["top1_agreement"] == oracle["top1_agreement"]


def test_label_logits_quantise_as_the_library_does():
    """At 4 and 8 bits the estimate is the chosen channels' values as labels.quantize / dequantize store them, one
    scale per 16 tokens and channel, times the queries' same channels; keys past pos take no part in a scale."""
    import jax.numpy as jnp
    from scripts.studies.dense_layers import label_logits
    from ulacache_jax.cache.select.labels import dequantize, pick_pairs, quantize
    rng = np.random.default_rng(1)
    T, KV, g, D, C, pos = 64, 2, 3, 16, 4, 40
    K = rng.normal(size=(T, KV, D)).astype(np.float32)
    K[pos + 1:] *= 100.0                                  # unwritten positions: large, must not widen a scale
    q = rng.normal(size=(KV, g, D)).astype(np.float32)
    for bits in (4, 8):
        got = np.asarray(label_logits(jnp.asarray(q), jnp.asarray(K), jnp.int32(pos), channels=C, bits=bits))
        seen = np.where(np.arange(T)[:, None, None] <= pos, K, 0.0)
        chans = np.asarray(pick_pairs(jnp.asarray(K), jnp.arange(T) < pos + 1, C))          # [KV, C]
        kc = np.take_along_axis(seen, chans[None], axis=-1).reshape(T // 16, 16, KV, C)
        codes, scale = quantize(jnp.asarray(kc), bits)
        vals = np.asarray(dequantize(codes, scale, bits)).reshape(T, KV, C)
        qc = np.take_along_axis(q, chans[:, None, :], axis=-1)
        want = np.einsum("kgc,tkc->kgt", qc, vals) / np.sqrt(D)
        np.testing.assert_allclose(got[..., :pos + 1], want[..., :pos + 1], rtol=1e-5, atol=1e-5)


def test_token_keep_fills_the_budget_with_the_heaviest_tokens():
    """Sink, recent and tail pages whole; the rest of the budget the flushed tokens of largest mass; a shortlist
    keeps tokens of the heaviest pages only; a budget past the flushed tokens keeps every one."""
    import jax.numpy as jnp
    from scripts.studies.dense_layers import token_keep
    page, T, pos = 4, 64, 45                               # flushed pages 0..10, the tail page 11 (44..47)
    s = np.full((1, 2, T), -5.0, np.float32)
    s[:, :, pos + 1:] = -np.inf
    s[:, :, [9, 21, 22, 30]] = 3.0                          # heavy tokens in pages 2, 5 and 7
    s[:, :, 13] = 2.0                                       # page 3: one token, less heavy
    # a budget of 17 tokens: 12 forced (sink page 0, recent pages 9 and 10) and the 5 heaviest others
    keep = np.asarray(token_keep(jnp.asarray(s), jnp.int32(pos), page=page, budget=17, sink=1, recent=2))[0]
    forced = set(range(0, 4)) | set(range(36, 44))
    tail = set(range(44, 64))
    assert set(np.flatnonzero(keep)) == forced | tail | {9, 21, 22, 30, 13}
    # a shortlist of 1 x 17 // 4 = 4 pages: the 3 forced and page 5 (two heavy tokens), so the tokens kept are
    # those of pages 0, 5, 9 and 10, the 16 candidates under the budget of 17
    short = np.asarray(token_keep(jnp.asarray(s), jnp.int32(pos), page=page, budget=17, sink=1, recent=2,
                                  shortlist=1))[0]
    assert set(np.flatnonzero(short)) == forced | tail | set(range(20, 24))
    every = np.asarray(token_keep(jnp.asarray(s), jnp.int32(pos), page=page, budget=T, sink=1, recent=2))[0]
    assert every.all()
    # fetch 1 of a 3x shortlist reads the 4 pages holding the most chosen mass (the 3 forced and page 5), and
    # chooses again among their 16 tokens; fetch 2 reads every page holding a chosen token (7 of its 8) and
    # keeps the whole first choice
    def fetched(f):
        return set(np.flatnonzero(np.asarray(token_keep(jnp.asarray(s), jnp.int32(pos), page=page, budget=17,
                                                        sink=1, recent=2, shortlist=3, fetch=f))[0]))
    assert fetched(1) == forced | tail | set(range(20, 24))
    assert fetched(2) == forced | tail | {9, 21, 22, 30, 13}


@pytest.mark.slow
def test_tokens_over_every_flushed_token_are_dense_and_named(tmp_path):
    """--select tokens with a budget past the context attends every key (dense's scores exactly); the shortlisted
    configuration is named by its multiple and a small budget is not dense."""
    args = ["--tiny", "--window", "256", "--prefix", "192", "--windows", "1", "--page-size", "16",
            "--budget", "64", "1024", "--select", "tokens", "--shortlist", "0", "2", "--fetch", "0", "1",
            "--out", str(tmp_path)]
    assert oracle_ppl.main(args) == 0
    s = {x["config"]: x for x in json.load(open(tmp_path / "oracle_ppl.json"))["runs"][0]["summary"]}
    every = s["oracle, budget 1024, tokens (pages of 16 framing)"]
    assert every["ppl"] == pytest.approx(s["dense"]["ppl"], rel=1e-5) and every["select"] == "tokens"
    few = s["oracle, budget 64, tokens in 2x the budget's pages of 16"]
    assert few["shortlist"] == 2 and few["kl"] > 1e-5
    read = s["oracle, budget 64, tokens in 2x the budget's pages of 16, 1x read"]
    assert read["fetch"] == 1 and read["kl"] > 1e-5
