"""The report's PNG: a Gantt row per request, tokens/s and HBM hit rate over time, compiles hatched, and no line
drawn across an idle gap (`break_gaps`, a pure function, tested directly). Rendered from a real tiny Engine run
(sparse and dense) and from synthetic reports (an idle gap, hundreds of requests, an old report without
per-request timings)."""
import math

import numpy as np
import pytest
from flax import nnx

from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generation import Generator, default_cache_config
from ulacache_jax.models import LlamaModel, get_preset
from ulacache_jax.app.report import break_gaps, build_report, plot_timeline

PNG = b"\x89PNG\r\n\x1a\n"


# ---- break_gaps ------------------------------------------------------------------------------------------------
def _segments(x, y):
    """The runs of non-NaN points, as lists of (x, y)."""
    segs, cur = [], []
    for a, b in zip(x, y):
        if math.isnan(a):
            segs.append(cur)
            cur = []
        else:
            cur.append((a, b))
    return segs + [cur]


def test_break_gaps_by_spacing():
    x = [0.1, 0.2, 0.3, 3.3, 3.4, 3.5, 9.0]      # median spacing 0.1: breaks before 3.3 and 9.0
    y = [1, 2, 3, 4, 5, 6, 7]
    bx, by = break_gaps(x, y)
    assert _segments(bx, by) == [[(0.1, 1), (0.2, 2), (0.3, 3)], [(3.3, 4), (3.4, 5), (3.5, 6)], [(9.0, 7)]]
    assert np.isnan(bx).sum() == np.isnan(by).sum() == 2


def test_break_gaps_by_idle_time():
    # steps of 0.1 s; a long step (a big prefill, 1 s) right after the previous one is not a gap, 2 s idle is
    starts = [0.0, 0.1, 0.2, 1.2, 3.3, 3.4]
    ends = [0.1, 0.2, 1.2, 1.3, 3.4, 3.5]
    bx, by = break_gaps(ends, [1, 2, 3, 4, 5, 6], starts=starts)
    assert [len(s) for s in _segments(bx, by)] == [4, 2]
    bx, _ = break_gaps(ends, [1, 2, 3, 4, 5, 6])   # by spacing alone the 1 s step is a gap too
    assert np.isnan(bx).sum() == 2
    bx, _ = break_gaps(ends, [1, 2, 3, 4, 5, 6], starts=starts, factor=100.0)
    assert not np.isnan(bx).any()


def test_break_gaps_edges():
    for x in ([], [1.0]):
        bx, by = break_gaps(x, x)
        assert list(bx) == x and list(by) == x
    bx, by = break_gaps([1.0, 1.0, 1.0], [0, 1, 2])   # no positive spacing: nothing to measure a gap against
    assert list(bx) == [1.0, 1.0, 1.0]
    bx, by = break_gaps([0, 1, 2, 10], [0.5, np.nan, 0.5, 0.5])   # NaN in y stays, one break
    assert np.isnan(bx).sum() == 1 and np.isnan(by).sum() == 2
    with pytest.raises(ValueError, match="non-decreasing"):
        break_gaps([2.0, 1.0], [0, 0])
    with pytest.raises(ValueError, match="one length"):
        break_gaps([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="starts"):
        break_gaps([1.0, 2.0], [0, 0], starts=[0.0])
    with pytest.raises(ValueError, match="factor"):
        break_gaps([1.0, 2.0], [0, 0], factor=0)


# ---- synthetic reports -----------------------------------------------------------------------------------------
def synthetic_report(num_requests=6, num_steps=40, gap_after=20, gap_s=3.0, attention="sparse"):
    """A report as build_report writes it: steps of 50 ms, a compile at step 0 and an idle gap of `gap_s`."""
    tl, t = [], 0.0
    for i in range(num_steps):
        dur = 1.5 if i == 0 else 0.05
        t += dur + (gap_s if i == gap_after else 0.0)
        tl.append({"step": i, "t_end_s": round(t, 6), "step_s": dur, "tokens": 64, "tokens_per_s": 64 / dur,
                   "cum_tokens_per_s": 64 * (i + 1) / t,
                   "hit_rate": None if attention == "dense" else 0.6 + 0.3 * math.sin(i / 5),
                   "fetched_pages": 3, "prefills": 0, "live_slots": 4, "queued": 0, "running": 4,
                   "compiled": i in (0, 30)})
    end = tl[-1]["t_end_s"]
    rt = []
    for r in range(num_requests):
        add = 0.01 * r
        adm = add + 0.2 * (r % 7) + 0.1
        first = adm + 0.03
        fin = min(first + 0.5 + 0.4 * (r % 5), end)
        rt.append({"id": r, "t_added_s": add, "t_admitted_s": adm, "t_first_token_s": first,
                   "t_finished_s": fin, "prefill_step": 0, "prompt_tokens": 100, "generated_tokens": 40,
                   "finish_reason": "length"})
    rt[-1].update(t_admitted_s=None, t_first_token_s=None, finish_reason="error", t_finished_s=0.2)
    return {"model": "synthetic", "random_weights": True, "attention": attention, "host_tier": attention != "dense",
            "cache_config": {"max_seqs": 4, "page_size": 16, "token_budget": 64},
            "requests": {"total": num_requests, "failed": 1}, "tokens": {"generated": 64 * num_steps},
            "wall_s": end, "engine_s": end, "compile_steps_s": 1.5, "compile_steps": 2,
            "throughput": {"decode_tokens_per_s_steady": 1200.0},
            "cache": {"hbm_hit_rate": None if attention == "dense" else 0.61},
            "timeline": tl, "request_timeline": rt}


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_plot_synthetic_with_gap(tmp_path, attention):
    p = tmp_path / f"{attention}.png"
    plot_timeline(synthetic_report(attention=attention), p)
    assert p.read_bytes()[:8] == PNG


def test_plot_many_requests_caps_the_gantt(tmp_path):
    import time
    rep = synthetic_report(num_requests=500, num_steps=2000, gap_after=1000)
    p = tmp_path / "many.png"
    t0 = time.perf_counter()
    plot_timeline(rep, p, max_gantt_rows=64)
    assert time.perf_counter() - t0 < 20          # seconds on a shared 2-core CI machine; ~1 s alone
    assert p.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="max_gantt_rows"):
        plot_timeline(rep, p, max_gantt_rows=0)


def test_plot_old_report_without_request_timings(tmp_path):
    rep = synthetic_report()
    del rep["request_timeline"], rep["throughput"], rep["cache"]
    p = tmp_path / "old.png"
    plot_timeline(rep, p)
    assert p.read_bytes()[:8] == PNG


# ---- a real tiny Engine run ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_and_config():
    mc = get_preset("tiny")
    model = LlamaModel(mc, rngs=nnx.Rngs(0))
    cfg = default_cache_config(mc, num_seqs=2, max_tokens=160, page_size=16, token_budget=32, host_pages=40)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (40, 70, 20, 50)]
    return model, cfg, prompts


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_plot_from_engine_run(tmp_path, model_and_config, attention):
    model, cfg, prompts = model_and_config
    eng = Engine(generator=Generator(model, cfg, attention=attention))
    # lengths whose chunks all take 16 steps (the last request's 17 end with the third's): one decode program (a
    # shorter last chunk compiles its own)
    reqs = eng.run(prompts + [[]], [SamplingParams(max_new_tokens=n) for n in (30, 12, 20, 17, 5)])
    rep = build_report(eng, reqs, model_label="tiny (random weights)", random_weights=True)
    rt = rep["request_timeline"]
    assert [r["id"] for r in rt] == [r.request_id for r in reqs]
    for r in rt[:-1]:                      # queued <= admitted (prefill starts) <= first token <= finished
        assert 0 <= r["t_added_s"] <= r["t_admitted_s"] <= r["t_first_token_s"] <= r["t_finished_s"]
        assert r["finish_reason"] == "length" and rep["timeline"][r["prefill_step"]]["prefills"] >= 1
    assert rt[-1]["finish_reason"] == "error" and rt[-1]["t_admitted_s"] is None   # the empty prompt
    assert rt[2]["t_admitted_s"] > rt[0]["t_first_token_s"]   # 2 slots: the third request waited in the queue
    p = tmp_path / f"engine_{attention}.png"
    plot_timeline(rep, p)
    assert p.read_bytes()[:8] == PNG
