"""scripts/studies/residual_mass.py's attention rules against dense attention (issue 48's residual-mass study)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts.studies import residual_mass as rm
from ulacache_jax.models.attention import dense_attention


def _inputs(T=128, N=8, H=4, KV=2, D=16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (N, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (T, KV, D), jnp.float32)
    v = jax.random.normal(ks[2], (T, KV, D), jnp.float32)
    qpos = jnp.arange(T - N, T, dtype=jnp.int32)
    return q, k, v, qpos


def _dense(q, k, v, qpos):
    T = k.shape[0]
    return dense_attention(q[None], k[None], v[None], qpos[None], jnp.arange(T)[None])[0]


@pytest.mark.parametrize("rule", rm.RULES)
def test_a_budget_covering_every_page_is_dense(rule):
    """Nothing unselected: every rule is exact attention (the residual terms add nothing)."""
    q, k, v, qpos = _inputs()
    got = rm.attend(q, k, v, qpos, page=16, budget=128, rule=rule, channels=8)
    np.testing.assert_allclose(got, _dense(q, k, v, qpos), rtol=1e-5, atol=1e-5)


def test_residual_at_exact_mass_with_uniform_pages_is_dense():
    """res_exact replaces an unselected page by its exact mass and mean value: exact when every key of a page is
    the same (the page's tokens then share one weight), whatever the budget."""
    q, k, v, qpos = _inputs()
    k = jnp.repeat(k[::16], 16, axis=0)          # one key a page of 16
    got = rm.attend(q, k, v, qpos, page=16, budget=32, rule="res_exact")
    np.testing.assert_allclose(got, _dense(q, k, v, qpos), rtol=1e-5, atol=1e-5)
    topk = rm.attend(q, k, v, qpos, page=16, budget=32, rule="topk")
    assert not np.allclose(topk, got, atol=1e-3)   # the budget drops pages: top-k alone is not exact here


@pytest.mark.parametrize("rule", ["topk_vnorm", "topk_pvnorm", "topk_out"])
def test_value_aware_rules_skip_a_page_of_zero_values(rule):
    """Two candidate pages of equal mass (every key zero: every logit equal), the first with zero values: at a
    budget of one page the value-aware rules take the second, so the output is the mean over it and the query's
    own page (plain top-k, ranking by mass alone, may take either)."""
    T, page, D = 48, 16, 8
    q = jnp.ones((1, 2, D), jnp.float32)
    k = jnp.zeros((T, 1, D), jnp.float32)
    v = jnp.concatenate([jnp.zeros((16, 1, D)), jnp.ones((16, 1, D)), jnp.full((16, 1, D), 3.0)]).astype(jnp.float32)
    got = rm.attend(q, k, v, jnp.array([T - 1], jnp.int32), page=page, budget=page, rule=rule)
    np.testing.assert_allclose(got, jnp.full((1, 2, D), (16 * 1.0 + 16 * 3.0) / 32), rtol=1e-6)


def test_unknown_rule_is_refused():
    q, k, v, qpos = _inputs()
    with pytest.raises(ValueError, match="rule"):
        rm.attend(q, k, v, qpos, page=16, budget=32, rule="nope")


@pytest.mark.slow
def test_driver_writes_a_row_per_rule_and_budget(tmp_path):
    """The study's driver end to end (tiny random model, byte tokenizer, pydoc text): a dense row and one row per
    rule and budget over every scored position of every window, in the JSON; a budget covering the window is dense
    (ppl ratio 0, full top-1 agreement) for the top-k rules."""
    import json
    rows = rm.main(["--tiny", "--text", "pydoc", "--window", "128", "--prefix", "96", "--windows", "2", "--page",
                    "16", "--budgets", "32,128", "--rules", "topk,topk_meanq,res_exact", "--out", str(tmp_path),
                    "--commit", "t"])
    by = {r["rule"]: r for r in rows}
    assert set(by) == {"dense"} | {f"{r} b{b}" for r in ("topk", "topk_meanq", "res_exact") for b in (32, 128)}
    assert all(r["positions"] == 2 * (128 - 1 - 96) for r in rows)
    for r in ("topk", "topk_meanq"):
        assert by[f"{r} b128"]["ppl_vs_dense"] == pytest.approx(0.0, abs=1e-5) and by[f"{r} b128"]["top1"] == 1.0
    data = json.loads((tmp_path / "residual_mass.json").read_text())
    assert data["meta"]["commit"] == "t" and data["meta"]["model"].startswith("tiny") and len(data["rows"]) == 7
