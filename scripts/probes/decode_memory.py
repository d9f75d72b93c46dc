"""Where does a decode program allocate a second cache? Compile-only probe (nothing cache-sized is allocated).

On the H200 the dense decode program at 128K x 7 sequences asked for 56.1 GiB more
(= one whole K cache) and the sparse decode program at 128K x 4 for 64 GiB more host memory (= the host pool),
while on CPU `memory_analysis` shows both caches aliased input -> output with small temps. This script lowers and
compiles the Generator's decode program (`program.program`, built from the backend's own ops and specs exactly as
`Generator.__init__` builds it, so it is the same Program object a Generator of that shape gets) from abstract
arguments (ShapeDtypeStruct with the real shardings and memory kinds) at any size, prints argument / output /
alias / temp bytes against the cache bytes, and lists the largest `copy`, `transpose` and custom-call buffers
of the optimized HLO, so the culprit shows in one call.
Found with it (docs/BENCHMARKS.md): the dense cache as one [L, S, T, KV, D] array made every layer's token write a
new whole-cache value (560 GiB before rematerialisation at 128K x 7); one array per layer: temp 0.01 GiB
(docs/benchmarks/decode_memory.json). The sparse host pool was twice the KV (pages rounded to a power of two).

Run (GPU):  python3 scripts/probes/decode_memory.py --context 131072 --batch 7 [--out DIR]
Smallest (CPU, a check that it runs): python3 scripts/probes/decode_memory.py --preset tiny --context 256 --batch 2
  --layers 2 --budget 64 --chunks 1
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import re

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from scripts.bench_meta import add_common_args, run_meta, write_json

SIZES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def big_buffers(hlo: str, min_bytes: int, top: int = 12):
    """(bytes, line) of HLO instructions whose result is at least min_bytes: copies, transposes, custom calls."""
    out = []
    pat = re.compile(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}(?:\s*S\(\d+\))?\s+(copy|transpose|custom-call|copy-start|fusion)")
    for line in hlo.splitlines():
        m = pat.search(line)
        if not m:
            continue
        dt, dims, op = m.groups()
        n = int(np.prod([int(d) for d in dims.split(",") if d])) * SIZES.get(dt, 4)
        if n >= min_bytes:
            out.append((n, op, line.strip()[:220]))
    return sorted(out, reverse=True)[:top]


def abstract_program(model, cfg, attention: str, options, mesh):
    """-> (Program, abstract params, abstract cache, abstract host): the decode program a
    `Generator(model, cfg, attention=attention, options=options, mesh=mesh)` would get, built without allocating
    the cache or the weights (`model` may be an `nnx.eval_shape` model). The backend's own `specs`/`view_specs`
    are called on stand-ins holding only the abstract cache's specs, so their logic is not copied here."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ulacache_jax.runtime import backends
    from ulacache_jax.cache import state as cache_state
    from ulacache_jax.runtime import tp
    from ulacache_jax.cache.kernel_choice import Platform
    from ulacache_jax.runtime.program import layer_graphdef, program

    graphdef = tp.tp_graphdef(model)
    params = nnx.split(model)[1]
    specs = tp.param_specs(params)
    shard = lambda x, spec, kind=None: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=NamedSharding(mesh, spec, memory_kind=kind))
    params = jax.tree.map(shard, params, specs)
    ops = backends.backend_class(attention).ops_class.build(   # the kernels make_backend would resolve
        options, cfg, Platform.of(mesh.devices.flat[0]), query_dtype=model.dtype,
        query_heads_per_kv=model.config.num_queries_per_kv)
    if attention == "sparse":
        state, host = jax.eval_shape(lambda: cache_state.init(tp.local_config(cfg), check=False))
        R = cfg.tp            # cache_state.init of one rank: the rank axis made global, as tp.init_sharded does
        state = dataclasses.replace(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct((R,) + x.shape[1:] if s != P() else x.shape, x.dtype), state,
            tp.state_specs(state)), config=cfg)
        host = jax.tree.map(lambda x: jax.ShapeDtypeStruct((R,) + x.shape[1:], x.dtype), host)
        kind = cache_state.host_memory_kind(mesh.devices.flat[0])
        host_sh = jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=kind), tp.host_specs(cfg),
                               is_leaf=lambda x: isinstance(x, P))
        stand_in = object.__new__(backends.SparseBackend)
        stand_in.config, stand_in.ops = cfg, ops
        stand_in.manager = type("Manager", (), dict(specs=tp.state_specs(state), host_shardings=lambda self: host_sh))()
        cache = jax.tree.map(shard, state, stand_in.manager.specs)
        host = jax.tree.map(lambda x, s: shard(x, s, kind), host, tp.host_specs(cfg))
    elif attention == "dense":
        stand_in = object.__new__(backends.DenseBackend)
        stand_in.config, stand_in.ops = cfg, ops
        shape = (cfg.max_seqs, cfg.max_context, cfg.num_kv_heads, cfg.head_dim)
        kv = tuple(jax.ShapeDtypeStruct(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
        cache = jax.tree.map(shard, (backends.DenseCache(kv, kv), jax.ShapeDtypeStruct((cfg.max_seqs,), jnp.int32)),
                             stand_in.specs()[0])
        host = ()
    else:
        raise ValueError(f"attention = {attention!r} must be 'sparse' or 'dense'")
    cache_spec, host_spec, host_sh = stand_in.specs()
    view_spec, view_sh = stand_in.view_specs()
    prog = program(graphdef, layer_graphdef(graphdef, params), stand_in.ops, cfg, mesh, specs, specs["layers"][0],
                   cache_spec, host_spec, host_sh, view_spec, view_sh)
    return prog, params, cache, host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--preset", default="llama-3.1-8b", help="model shape (ulacache_jax.models presets; 'tiny' on CPU)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--sides", nargs="+", default=["dense", "sparse"])
    p.add_argument("--kv-fraction", type=float, default=0.25, help="sparse HBM frame pool, as in bench_decode")
    p.add_argument("--chunks", type=int, default=3, help="decode chunks the cache has room for, as in bench_decode")
    # no default folder: a probe run to read on the console writes nothing
    return add_common_args(p, out_default=None, out_default_help="none (print only)",
                           files="decode_memory.json, decode_memory_SIDE.hlo.txt")


def main(argv=None):
    a = build_parser().parse_args(argv)
    from ulacache_jax.cache.decode_layer import DecodeOptions
    from ulacache_jax.runtime.tp import make_mesh
    from scripts.bench_decode import bench_config
    from ulacache_jax.models import LlamaModel, get_preset
    from ulacache_jax.runtime.sampling import SamplingArrays, row_keys

    mc = dataclasses.replace(get_preset(a.preset), num_layers=a.layers)
    model = nnx.eval_shape(lambda: LlamaModel(mc, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    mesh = make_mesh(1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    S = a.batch
    # the per-slot inputs, replicated on the mesh as Generator.decode_chunk places them
    small = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                         (jnp.zeros(S, jnp.int32), jnp.ones(S, bool), jnp.zeros(S, jnp.int32),
                          row_keys(jnp.zeros(S, jnp.uint32), jnp.zeros(S, jnp.uint32)), SamplingArrays.fill(S),
                          jnp.asarray([-1], jnp.int32)))
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    report = {}
    for side in a.sides:
        # the cache bench_decode.py builds for this row (sparse pool: --kv-fraction of the KV)
        cfg = bench_config(mc, side, S, a.context, a, a.kv_fraction)
        prog, params, cache, host = abstract_program(model, cfg, side, DecodeOptions(), mesh)
        args = (params, cache, host)
        cache_bytes = {"state": nbytes(cache), "host": nbytes(host)} if side == "sparse" else {"k+v": nbytes(cache[0])}
        comp = prog.decode.lower(*args, *small).compile()
        mem = comp.memory_analysis()
        rec = dict(cache_bytes=cache_bytes, argument=mem.argument_size_in_bytes, output=mem.output_size_in_bytes,
                   alias=mem.alias_size_in_bytes, temp=mem.temp_size_in_bytes,
                   host_argument=getattr(mem, "host_argument_size_in_bytes", None),
                   host_output=getattr(mem, "host_output_size_in_bytes", None),
                   host_alias=getattr(mem, "host_alias_size_in_bytes", None),
                   host_temp=getattr(mem, "host_temp_size_in_bytes", None))
        hlo = comp.as_text()
        biggest = max(cache_bytes.values())
        rec["big_buffers"] = [dict(bytes=n, op=op, hlo=line) for n, op, line in big_buffers(hlo, biggest // 64)]
        rec["entry_alias"] = hlo.splitlines()[0][:600]
        report[side] = rec
        print(f"== {side}: " + " ".join(f"{k}={v / 2**30:.2f}GiB" if isinstance(v, int) else f"{k}={v}"
                                         for k, v in rec.items() if k not in ("big_buffers", "entry_alias")))
        for b in rec["big_buffers"]:
            print(f"   {b['bytes'] / 2**30:8.2f} GiB {b['op']:12s} {b['hlo'][:160]}")
        if a.out:   # after every side: a side that fails to compile keeps the ones before it
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"decode_memory_{side}.hlo.txt"), "w") as f:
                f.write(hlo)
            write_json(os.path.join(a.out, "decode_memory.json"), dict(report, meta=run_meta(a.commit)))
    return report


if __name__ == "__main__":
    main()
