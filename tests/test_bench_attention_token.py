"""bench_attention's token section on CPU: the workload reads the same tokens three ways, every variant is checked
against its reference before it is timed (the Triton kernels in interpret mode), a wrong output is an error row
that is never timed, `--only token` runs the ceiling first, and a partial run keeps the other sections of an
existing attention.json with their own meta."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import bench_attention as ba
from ulacache_jax.pallas_kernels import sparse_decode_attention as sda
from ulacache_jax.pallas_kernels import token_decode_attention as tda

TINY = dict(heads=8, kv=2, d=32, page=16)   # B = 2, G = 2 lists of 32 tokens + the tail, context 128


@pytest.fixture(scope="module")
def work():
    return ba.make_token_workload(2, 32, 128, pool_gb=0, seed=1, **TINY)


def listed(frame, row, pos):
    """{(b, group, frame, row): pos} of a token list's used entries."""
    f, r, p = (np.asarray(x) for x in (frame, row, pos))
    return {(b, g, int(f[b, g, i]), int(r[b, g, i])): int(p[b, g, i]) for b, g, i in zip(*np.nonzero(p >= 0))}


def test_workload_lists_the_budget_and_the_tail_and_poisons_the_rest(work):
    """Both token lists hold N + tail tokens a (b, group) (bytes counted from them); the contiguous list is every
    written row of the page list's pages; both share the tail rows; every row outside the listed tokens and the
    listed pages is NaN."""
    b, g, n = 2, 2, 32
    seq_len = int(work.seq_len[0])                         # 128 - 16 - 1 = 111: the last page holds 15 rows
    tail = seq_len - 5 * 16                                # 2 tail pages: 16 + 15 rows
    assert work.tokens == b * g * (n + tail) and work.bytes == work.tokens * 32 * 2 * 2
    sc, ct = listed(*work.scattered), listed(*work.contiguous)
    assert len(sc) == len(ct) == work.tokens               # distinct (frame, row) per list, no row twice
    frames, starts = (np.asarray(x) for x in work.pages)   # [B, G, N/t + 2]
    pages = {(bi, gi, int(f), int(s) + r): None for bi in range(b) for gi in range(g)
             for f, s in zip(frames[bi, gi], starts[bi, gi]) for r in range(16) if s + r < seq_len}
    assert {(k[0], k[1], k[2], v) for k, v in ct.items()} == \
        {(k[0], k[1], k[2], k[3]) for k in pages}            # contiguous = the pages' rows, positions start + row
    tail_sc = {k: v for k, v in sc.items() if v >= 5 * 16}
    assert len(tail_sc) == b * g * tail and tail_sc.items() <= ct.items()
    assert all(v < 5 * 16 for k, v in sc.items() if k not in tail_sc)   # scattered tokens lie before the tail
    named = np.zeros(work.pool_k.shape[:2], bool)
    named[frames.reshape(-1)] = True                        # whole pages: the page kernel reads every row
    for _, _, f, r in sc:
        named[f, r] = True
    pk = np.asarray(work.pool_k.astype(jnp.float32))[:, :, 0, 0]
    assert np.isfinite(pk[named]).all() and np.isnan(pk[~named]).all()


def test_the_three_variants_attend_the_same_function_of_the_same_set(work):
    """The contiguous token list and the page list name the same tokens: their references agree."""
    args = (work.q, work.pool_k, work.pool_v)
    a = jax.jit(tda.ref_token_decode_attention)(*args, *work.contiguous, work.seq_len)
    b = jax.jit(sda.ref_sparse_decode_attention)(*args, *work.pages, work.seq_len)
    assert ba.check_output(a, b)["ok"] and ba.rel_err(a, b) < 1e-2


def test_rows_are_checked_then_timed_interpret_mode(work):
    """impl='pallas' (interpret mode on CPU): each variant's output passes the check, then the timer runs it; us,
    TB/s over the attended bytes and the fraction of the ceiling follow from the timer's seconds."""
    timed = []

    def timer(step, *args):   # the harness's time_chain signature: one call instead of a chain, 1 ms
        jax.block_until_ready(step(*args))
        timed.append(step)
        return 1e-3, None

    rows = list(ba.token_rows(work, impl="pallas", ceiling_tbs=2.0, timer=timer))
    assert [r["variant"] for r in rows] == ["scattered", "contiguous", "page"] and len(timed) == 3
    for r in rows:
        assert "error" not in r, r
        assert r["max_abs_err"] < 2e-2 and r["rel_err"] < 2e-2 and r["page"] == 16
        assert r["us"] == pytest.approx(1e3) and r["tbs"] == pytest.approx(work.bytes / 1e-3 / 1e12)
        assert r["frac_ceiling"] == pytest.approx(r["tbs"] / 2.0)
        assert json.loads(r["tuning"])["num_splits"] >= 1
    assert rows[0]["entries"] == 32 + 32 and rows[2]["entries"] == 2 + 2


def test_a_wrong_output_is_an_error_row_and_never_timed(work):
    """The reference against itself passes; scaled by 1.1, or with the tail pages dropped, it fails the check and the
    row carries `error` and no time; a kernel that raises is an error row too."""
    def timer(*_):
        raise AssertionError("a row that failed its check was timed")

    args = (work.q, work.pool_k, work.pool_v, *work.scattered, work.seq_len)
    ref = tda.ref_token_decode_attention
    ok = ba.measure_variant(ref, ref, args, work.bytes, timer=lambda *_: (1e-3, None))
    assert "error" not in ok and ok["max_abs_err"] == 0.0

    def no_tail(q, pk, pv, f, r, p, sl):
        return ref(q, pk, pv, f, r, jnp.where(p >= 5 * 16, -1, p), sl)

    def boom(*_):
        raise RuntimeError("lowering failed")

    for wrong in (lambda *a: ref(*a) * 1.1, no_tail):
        row = ba.measure_variant(wrong, ref, args, work.bytes, timer=timer)
        assert row["error"].startswith("check failed") and "us" not in row and row["max_abs_err"] > 0
    row = ba.measure_variant(boom, ref, args, work.bytes, timer=timer)
    assert "lowering failed" in row["error"] and "us" not in row


def test_check_output_scales_atol_by_the_output():
    """Attention outputs near 0.02: an all-zero output fails, a bf16 rounding passes, a NaN fails."""
    ref = jnp.asarray(np.random.default_rng(0).normal(0, 0.02, (4, 64)), jnp.float32)
    assert ba.check_output(ref.astype(jnp.bfloat16), ref)["ok"]
    assert not ba.check_output(jnp.zeros_like(ref), ref)["ok"]
    assert not ba.check_output(ref.at[0, 0].set(jnp.nan), ref)["ok"]


def test_only_token_runs_the_ceiling_first():
    run = lambda *argv: ba.sections_to_run(ba.parse(list(argv)))
    assert run("--only", "token") == ["ceiling", "token"]
    assert run("--only", "token", "ceiling") == ["ceiling", "token"]
    assert run("--only", "token", "--skip", "ceiling") == ["token"]
    assert run("--only", "kernel") == ["kernel"]
    assert run()[0] == "ceiling" and run()[-1] == "token"


def test_a_partial_run_keeps_the_other_sections_with_their_meta(tmp_path, monkeypatch):
    """`--only token` into a folder whose attention.json holds other sections: they stay, each with the meta of
    the run that measured it (kept twice: its first meta); the token rows are this run's; --fresh drops the rest."""
    def fake_token(ctx):
        ctx.add("token", dict(variant="scattered", batch=3, budget=2048, us=10.0, tbs=1.0, max_abs_err=1e-3,
                              frac_ceiling=None))

    monkeypatch.setattr(ba, "section_token", fake_token)
    old = dict(device="gpu NVIDIA H200", jax="0.11.2", commit="aaaa", date="d0", command="old run",
               ceiling=dict(xla_elementwise_tbs=2.7),
               kernel=[dict(impl="pallas", batch=8, budget=1024, context=32768, us=38.0, tbs=1.0, rel_err=1e-3)],
               token=[dict(variant="page", batch=8, budget=2048, us=1.0, tbs=1.0, max_abs_err=0.0)],
               sweep=[dict(batch=32, budget=4096, us=1.0, tbs=1.0, tuning="{}")],
               section_seconds=dict(kernel=108.1, ceiling=5.5),
               kept_sections=dict(sweep=dict(commit="older", date="d-1")))
    (tmp_path / "attention.json").write_text(json.dumps(old))
    res = ba.main(["--only", "token", "--skip", "ceiling", "--out", str(tmp_path), "--commit", "new"])
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["commit"] == "new" and data["token"] == res["token"] and len(data["token"]) == 1
    assert data["token"][0]["batch"] == 3                                # the old token rows are replaced
    assert data["kernel"] == old["kernel"] and data["ceiling"] == old["ceiling"] and data["sweep"] == old["sweep"]
    kept = data["kept_sections"]
    assert set(kept) == {"ceiling", "kernel", "sweep"}
    assert kept["kernel"]["commit"] == "aaaa" and kept["kernel"]["command"] == "old run"
    assert kept["kernel"]["seconds"] == 108.1 and kept["sweep"] == dict(commit="older", date="d-1")
    assert "kernel" not in data["section_seconds"]
    ba.main(["--only", "token", "--skip", "ceiling", "--out", str(tmp_path), "--commit", "newer", "--fresh"])
    data = json.loads((tmp_path / "attention.json").read_text())
    assert "kernel" not in data and "kept_sections" not in data and data["commit"] == "newer"


def test_plot_draws_the_token_section_beside_kept_sections(tmp_path):
    """A run of the token section alone, merged with kept kernel / miss sections, draws three panels; a run with
    neither token rows nor kept sections draws the two it always drew."""
    from scripts import bench_attention as ba
    kernel = [dict(batch=8, budget=1024, context=32768, impl=impl, tbs=t) for impl, t in (("pallas", 1.0),
                                                                                        ("mosaic", 1.3))]
    token = [dict(variant=v, batch=3, budget=4096, tbs=t) for v, t in (("scattered", 0.76), ("contiguous", 0.93),
                                                                       ("page", 0.69))]
    merged = dict(device="NVIDIA H100", ceiling={"read_tbs": 3.0}, token=token, kernel=kernel,
                  kept_sections={"kernel": {"device": "gpu NVIDIA H200"}})
    ba.plot(merged, str(tmp_path / "a.png"))
    ba.plot(dict(device="NVIDIA H200", ceiling={"read_tbs": 3.0}, kernel=kernel), str(tmp_path / "b.png"))
    import matplotlib.image as mpimg
    wide, narrow = (mpimg.imread(str(tmp_path / n)).shape[1] for n in ("a.png", "b.png"))
    assert wide > narrow * 1.3
