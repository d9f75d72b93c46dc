"""The sizing rule (runtime/sizing.py): the largest batch is the largest that fits, fp8 pages hold more, the
measured one-H200 facts come out of it, bad values are refused by name, and the CLI's refusal says what fits."""
import argparse

import pytest

from ulacache_jax.cache import state
from ulacache_jax.models import PRESETS
from ulacache_jax.runtime import sizing

GIB = 2**30
MC8 = PRESETS["llama-3.1-8b"]
# the one-GPU H200 machine: 139 GiB of HBM at XLA_PYTHON_CLIENT_MEM_FRACTION 0.95; 128 GiB of RAM, of which
# raise_host_limit pins 0.9 of MemAvailable (~120 GiB)
H200 = sizing.Machine("h200", 1, int(0.95 * 139 * GIB), int(0.9 * 120 * GIB))


def weights(mc):
    return mc.num_params() * 2


@pytest.mark.parametrize("attention,kv,context", [("sparse", "auto", 131072), ("sparse", "float8_e4m3fn", 65536),
                                                  ("dense", "auto", 262144), ("dense", "float8_e4m3fn", 32768)])
def test_largest_batch_is_the_largest_that_fits(attention, kv, context):
    fit = sizing.largest_batch(MC8, context, H200, attention=attention, kv_dtype=kv)
    assert fit.batch >= 1 and fit.limit in ("hbm", "host")

    def need(b):
        return sizing.need(sizing.cache_config(MC8, context, b, kv_dtype=kv), attention, weights(MC8))
    ok, nxt = need(fit.batch), need(fit.batch + 1)
    assert ok.hbm_per_gpu <= H200.hbm_bytes and ok.host <= H200.host_bytes
    assert nxt.hbm_per_gpu > H200.hbm_bytes or nxt.host > H200.host_bytes
    assert nxt == fit.need_next
    assert str(fit.batch + 1) in fit.why(H200) and ("GiB a GPU" if fit.limit == "hbm" else "host") in fit.why(H200)


def test_measured_h200_facts_and_fp8_capacity():
    """256K x 2 of the 8B shape ran sparse on one H200 and 256K x 3 failed at its first ingest (host), and dense
    holds 3 sequences of 256K in HBM; fp8 pages double the sequences either side."""
    sp = sizing.largest_batch(MC8, 262144, H200)
    assert (sp.batch, sp.limit) == (2, "host")
    assert sp.need_next.host_pool == 96 * GIB and sp.need_next.host_transient == 48 * GIB
    roomy = sizing.largest_batch(MC8, 262144, H200, transient=False)    # a pool layout without the transient
    assert (roomy.batch, roomy.need_next.host_transient) == (3, 0)
    de = sizing.largest_batch(MC8, 262144, H200, attention="dense")
    assert (de.batch, de.limit, de.need_next.host) == (3, "hbm", 0)
    sp8 = sizing.largest_batch(MC8, 262144, H200, kv_dtype="float8_e4m3fn")
    de8 = sizing.largest_batch(MC8, 262144, H200, attention="dense", kv_dtype="float8_e4m3fn")
    assert sp8.batch == 2 * sp.batch and de8.batch >= 2 * de.batch
    # tensor parallel over 8 GPUs: every rank's pool on the one host, the weights split
    x8 = sizing.Machine("h200x8", 8, H200.hbm_bytes, int(0.9 * 552 * GIB))
    assert sizing.largest_batch(MC8, 262144, x8).batch > sp.batch


def test_cpu_host_pool_has_no_transient():
    cfg = sizing.cache_config(MC8, 4096, 2)
    pool, transient = state.host_need(cfg, pinned=False)
    assert transient == 0 and pool == 2 * cfg.host_pages * cfg.page_bytes
    assert state.host_need(cfg, pinned=True) == (pool, pool // 2)


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="gpus = 0"):
        sizing.Machine("m", 0, GIB, GIB)
    with pytest.raises(ValueError, match="hbm_bytes = 1.5"):
        sizing.Machine("m", 1, 1.5, GIB)
    with pytest.raises(ValueError, match="tp = 2 must be in \\[1, 1\\]"):
        sizing.largest_batch(MC8, 4096, H200, tp=2)
    with pytest.raises(ValueError, match="context = 0"):
        sizing.largest_batch(MC8, 0, H200)
    with pytest.raises(ValueError, match="attention = 'fast'"):
        sizing.largest_batch(MC8, 4096, H200, attention="fast")
    tiny = sizing.Machine("small", 1, GIB, GIB)
    none = sizing.largest_batch(MC8, 4096, tiny)           # 15 GiB of weights: not one sequence
    assert none.batch == 0 and none.limit == "hbm" and "1 x 4096 tokens" in none.why(tiny)


def test_cli_refusal_says_how_many_fit():
    from ulacache_jax.app import cli
    mc = PRESETS["tiny"]
    args = argparse.Namespace(attention="dense", hbm_pages=None, tp=1)

    def build(b):
        return sizing.cache_config(mc, 4096, b, dtype="float32")
    cfg = build(64)
    one = sizing.need(build(1), "dense", 0).hbm_per_gpu
    limit = 10 * one + one // 2                               # room for 10 sequences
    with pytest.raises(cli.UsageError) as e:
        cli.check_device_memory(args, cfg, 0, limit, "the test's memory", attention="dense", rebuild=build)
    assert "at most 10 sequences of 4096 tokens fit here, 64 were asked" in str(e.value)
    assert "lower --max-seqs" in str(e.value)
    cli.check_device_memory(args, build(10), 0, limit, "the test's memory", attention="dense", rebuild=build)


def test_a_batch_the_cache_cannot_shape_does_not_fit():
    """A build that raises ValueError (CacheConfig refuses the shapes) stops the search there: limit "config"."""
    def build(b):
        if b > 5:
            raise ValueError(f"max_seqs = {b} exceeds 5")
        return sizing.cache_config(MC8, 4096, b)
    fit = sizing.largest_batch_for(build, H200, context=4096, attention="sparse", weight_bytes=0, cap=64)
    assert (fit.batch, fit.limit, fit.need_next) == (5, "config", None)
    assert "beyond the cache's shapes" in fit.why(H200)


def test_cli_prints_how_many_fit(capsys):
    from ulacache_jax.app import cli
    mc = PRESETS["tiny"]
    args = argparse.Namespace(attention="dense", hbm_pages=None, tp=1)

    def build(b):
        return sizing.cache_config(mc, 4096, b, dtype="float32")
    one = sizing.need(build(1), "dense", 0).hbm_per_gpu
    cli.check_device_memory(args, build(4), 0, 10 * one + one // 2, "the test's memory", attention="dense",
                            rebuild=build)
    err = capsys.readouterr().err
    assert "memory: 4 sequences of 4096 tokens; at most 10 fit (the test's memory: 11 x 4096 tokens" in err, err
