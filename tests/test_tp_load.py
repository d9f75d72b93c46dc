"""Checkpoint loading directly into the TP sharding (tp.load_model; the loaders' `shardings`), on CPU with forced
host devices.

As in tests/test_tp.py, the main pytest process has started jax with one CPU device, so the checks run this file as
a script in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 and report JSON. Checks, for a Hugging
Face folder (sharded safetensors), a GGUF and an orbax checkpoint of small models: loaded at TP = 2 every param
equals the unsharded load's, carries its TP sharding (tp.param_spec) with one shard per device of the split shape,
the logits equal; every tensor the file loaders place goes straight to a mesh sharding (never one device). The
Llama-3.1-70B shape, abstractly: what each of 8 devices holds under the loaders' shardings.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

from device_env import forced_devices

NUM_DEVICES = 8
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


# ---- the subprocess side ---------------------------------------------------------------------------------------
def run_checks() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from ulacache_jax.runtime import tp as tp_mod
    from ulacache_jax.models import LlamaModel, from_pretrained, get_preset, load, save
    from checkpoint_v1 import save_format1

    out = {"devices": jax.device_count()}
    tmp = pathlib.Path(tempfile.mkdtemp())
    save(from_pretrained(FIXTURES / "tiny_llama", jnp.float32), tmp / "ck")
    save_format1(from_pretrained(FIXTURES / "tiny_llama", jnp.float32), tmp / "ck1")   # gate / up stored apart
    sources = {"hf": (FIXTURES / "tiny_llama", lambda p: from_pretrained(p, jnp.float32)),
               "gguf": (FIXTURES / "tiny_gguf" / "qwen2.gguf", lambda p: from_pretrained(p, jnp.float32)),
               "orbax": (tmp / "ck", lambda p: load(p)), "orbax_format1": (tmp / "ck1", lambda p: load(p))}
    puts = []
    real_put = jax.device_put

    def spy(x, device=None, *args, **kw):       # every placement the file loaders make
        puts.append(isinstance(device, NamedSharding) and device.mesh.size == 2)
        return real_put(x, device, *args, **kw)

    tp = 2
    mesh = tp_mod.make_mesh(tp)
    ids = jnp.asarray([[1, 5, 9, 3, 7, 2]], jnp.int32)
    for name, (path, unsharded) in sources.items():
        ref = unsharded(path)
        puts.clear()
        jax.device_put = spy
        try:
            model = tp_mod.load_model(path, mesh, dtype=jnp.float32)
        finally:
            jax.device_put = real_put
        flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        flat_ref = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
        bad_sharding, bad_shards = [], []
        for p, var in flat.items():
            x = var[...]
            want = NamedSharding(mesh, tp_mod.param_spec(str(p[-1])))
            if not x.sharding.is_equivalent_to(want, x.ndim):
                bad_sharding.append(".".join(map(str, p)))
            if sorted({s.data.shape for s in x.addressable_shards}) != [want.shard_shape(x.shape)] or \
                    len(x.addressable_shards) != tp:
                bad_shards.append(".".join(map(str, p)))
        q = model.layers[0].self_attn.q_proj[...]
        out[name] = {
            "same_paths": sorted(map(str, flat)) == sorted(map(str, flat_ref)),
            "equal": all(np.array_equal(np.asarray(flat[p][...]), np.asarray(flat_ref[p][...])) for p in flat_ref),
            "bad_sharding": bad_sharding, "bad_shards": bad_shards,
            "q_heads": [q.shape[0], sorted({s.data.shape[0] for s in q.addressable_shards})],
            "logits_close": bool(np.allclose(np.asarray(jax.jit(lambda m, x: m(x))(model, ids)),
                                             np.asarray(jax.jit(lambda m, x: m(x))(ref, ids)), atol=1e-5)),
            "puts": len(puts), "puts_to_mesh": all(puts),
            "dtype": str(q.dtype),
        }
    # 2 KV heads over 4 ranks: k/v load replicated and come back repeated (prepare_model), the same function
    ref = from_pretrained(FIXTURES / "tiny_llama", jnp.float32)
    rep = tp_mod.load_model(FIXTURES / "tiny_llama", tp_mod.make_mesh(4), dtype=jnp.float32)
    q = rep.layers[0].self_attn.q_proj[...]
    out["tp4"] = {"kv_heads": rep.config.num_kv_heads,
                  "q_shards": sorted({s.data.shape[0] for s in q.addressable_shards}),
                  "logits_close": bool(np.allclose(np.asarray(jax.jit(lambda m, x: m(x))(rep, ids)),
                                                   np.asarray(jax.jit(lambda m, x: m(x))(ref, ids)), atol=1e-5))}
    try:        # 3 ranks do not split 4 heads: a clear error before any tensor is read
        tp_mod.load_model(FIXTURES / "tiny_llama", tp_mod.make_mesh(3), dtype=jnp.float32)
        out["tp3_error"] = None
    except ValueError as e:
        out["tp3_error"] = str(e)

    # the Llama-3.1-70B shape, abstractly: what each device of TP = 8 holds under the loaders' shardings
    mc = get_preset("llama-3.1-70b")
    params = nnx.split(nnx.eval_shape(lambda: LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))[1]
    per = tp_mod.device_bytes(params, tp_mod.make_mesh(8))
    out["70b"] = {"per_device": list(per.values()), "shard_bytes": tp_mod.shard_bytes(params, 8),
                  "total": tp_mod.shard_bytes(params, 1)}
    return out


# ---- the pytest side -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checks():
    env = forced_devices(NUM_DEVICES)
    p = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("source", ["hf", "gguf", "orbax", "orbax_format1"])
def test_loaded_into_tp_sharding_equals_unsharded_load(checks, source):
    r = checks[source]
    assert checks["devices"] == NUM_DEVICES
    assert r["same_paths"] and r["equal"] and r["logits_close"] and r["dtype"] == "float32"
    assert r["bad_sharding"] == [] and r["bad_shards"] == []
    heads, shard_heads = r["q_heads"]
    assert shard_heads == [heads // 2]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_file_loaders_place_every_tensor_into_its_shards(checks, source):
    r = checks[source]
    assert r["puts"] > 0 and r["puts_to_mesh"]


def test_more_ranks_than_kv_heads_load_replicated_and_repeat(checks):
    r = checks["tp4"]
    assert r["kv_heads"] == 4 and r["q_shards"] == [1] and r["logits_close"]


def test_a_model_that_does_not_split_is_a_clear_error(checks):
    assert "tp = 3 must divide the model's num_heads = 4" in checks["tp3_error"]


def test_70b_shape_per_device_bytes_under_the_loaders_shardings(checks):
    r = checks["70b"]
    assert len(r["per_device"]) == 8 and len(set(r["per_device"])) == 1
    assert r["per_device"][0] == r["shard_bytes"]
    assert 139e9 < r["total"] < 143e9 and r["total"] / 8 < r["per_device"][0] < 24e9


def test_placement_takes_a_device_or_shardings():
    import jax
    from ulacache_jax.models.hf_loader import placement
    d = jax.devices()[0]
    assert placement(d, None, ("norm", "weight")) is d
    assert placement(None, lambda p: p, ("norm", "weight")) == ("norm", "weight")
    with pytest.raises(ValueError, match="not both"):
        placement(d, lambda p: p, ("norm", "weight"))


if __name__ == "__main__":
    print(json.dumps(run_checks()))
