"""Head-sharded tensor parallelism (DESIGN.md section 6): the cache and the model split by KV-head groups over a
mesh axis `tp`, every step under `jax.shard_map`.

What is sharded, and how
- Cache. Every per-rank array of `CacheState` already carries a leading rank axis R = config.tp; TP is that axis
  sharded over `tp` (`P("tp")`): rank r holds the vTLB slice, PB-LRU, frame pool + tail ring, page summaries and
  host pool of its `groups_per_rank` groups (global groups [r*G, (r+1)*G)) and nothing else. The sequence table
  and the clock are replicated (`P()`): every rank runs the same admission. LIDs keep the global group id
  (`attend_layer(..., rank=axis_index("tp"))`), so all ranks share one address space, but a rank's PB-LRU only
  ever sees LIDs of its own groups. Each rank allocates only for the pages its own heads select.
- Weights (Megatron-style). q/k/v projections and their biases are column-parallel by heads (q_proj [H, D, E]
  and k/v_proj [K, D, E] split on the head axis: rank r gets query heads [r*H/R, ..) and KV heads [r*K/R, ..),
  so the GQA pairing stays rank-local); o_proj [E, H, D] is row-parallel (split on H) and its partial sums are
  `psum`med over `tp` before the o bias and the residual; MLP gate/up [F, E] are column-parallel on F and down
  [E, F] row-parallel + `psum`. Embedding, norms and the LM head are replicated (every rank computes the full
  logits: no gather, and sampling is identical on every rank).
- Collectives. Exactly two `psum`s per layer (after the attention output projection and after the MLP), in
  prefill and decode alike; nothing touches the cache (tests/test_tp.py checks the compiled HLO).

How the step is wrapped. There is no TP driver: the one program (program.py) is TP over a mesh of
`cache_config.tp` devices, a single device being a mesh of one. Each jitted entry point is
`jax.jit(jax.shard_map(f, mesh, in_specs, out_specs))` (`per_rank`), where `f` sees one rank's view (leading axis
1) with the cache's static config swapped for the one-rank config (`local_config`: tp=1, num_kv_heads/R), which
is exactly the single-device code path of `decode_layer`/`sequences`; the rank (`axis_index("tp")`) is the global
group offset `attend_layer` gives its LIDs. The model's row-parallel layers are `RowParallelAttention` /
`RowParallelMLP` (subclasses that end in a `psum`), swapped into the graphdef that `nnx.merge` rebuilds inside
the map (`tp_graphdef`). `check_vma=False`: outputs declared replicated (tokens, logits, lengths) are computed
identically on every rank from psummed activations. This module holds only these sharding rules and puts models
into them without ever holding one whole on a device: `init_model` (random weights made in their shards) and
`load_model` (a checkpoint read tensor by tensor into its shards: `param_shardings` is the loaders' placement).

More ranks than KV heads. When tp > num_kv_heads and tp % num_kv_heads == 0, `replicate_kv_heads` repeats each KV
head's k/v projections tp/K times (k_proj [K, D, E] -> [K*rep, D, E], copies adjacent): query head h then uses
copy h // (H/(K*rep)), which holds the same weights as its original head h // (H/K), so the model computes the
same function with K*rep KV heads, one (or more) per rank. Each copy is cached, selected and evicted on its own
rank: selection scores a copy over only that rank's query heads, which is finer than the unreplicated group (the
same as TP=1 while every page is selected, i.e. context within the token budget; it may pick different pages
beyond it). tp must divide num_heads and intermediate_size.

Known limits: the LM head is replicated (vocab-parallel LM head + all-gather is not done). Where TP has run on
GPUs and how fast: docs/BENCHMARKS.md.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ulacache_jax.cache import state as cache_state_mod
from ulacache_jax.cache.state import CacheState, HostPool, host_memory_kind
from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.models import checkpoint as model_checkpoint, gguf_loader, hf_loader
from ulacache_jax.models.llama import MLP, Attention, LlamaModel
from ulacache_jax.models.pretrained import resolve_model_path

TP_AXIS = "tp"


# ---- mesh and config ---------------------------------------------------------------------------------------------
def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh of `tp` devices named "tp". Default devices: this process's first `tp` (TP stays within a host;
    across hosts replicas are data-parallel, see distributed.py)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp = {tp!r} must be an int >= 1")
    if tp > len(devices):
        raise ValueError(f"tp = {tp} needs {tp} devices but only {len(devices)} are available "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def check_tp(config: CacheConfig, tp: int | None = None) -> None:
    """The clear error for a cache that cannot be head-sharded `tp` ways (CacheConfig checks it too)."""
    tp = config.tp if tp is None else tp
    if config.num_groups % tp:
        raise ValueError(
            f"head-sharded TP needs num_groups % tp == 0, but num_groups = {config.num_groups} (num_kv_heads = "
            f"{config.num_kv_heads} / kv_heads_per_group = {config.kv_heads_per_group}) and tp = {tp}: "
            + ("lower kv_heads_per_group" if config.num_kv_heads % tp == 0 else
               "replicate KV heads first (tp.replicate_kv_heads / tp.prepare_model)" if tp % config.num_kv_heads == 0
               else "tp must divide num_kv_heads or be a multiple of it"))


def local_config(config: CacheConfig, rank: int = 0) -> CacheConfig:
    """One rank's view of a TP cache: tp = 1 with that rank's KV heads (and their rows of a label channel table,
    which only a fresh cache's state reads: `init_sharded` builds each rank from its own). Every per-rank size
    (groups_per_rank, frames, tail ring, host pages) is unchanged, so single-device code runs on one shard as is."""
    check_tp(config)
    kv = config.num_kv_heads // config.tp
    table = config.channel_table
    if table is not None:
        table = tuple(layer[rank * kv:(rank + 1) * kv] for layer in table)
    return dataclasses.replace(config, tp=1, num_kv_heads=kv, channel_table=table)


def state_specs(state: CacheState) -> CacheState:
    """PartitionSpecs of a CacheState: the leading rank axis of every per-rank array over "tp", the sequence
    table and the clock replicated."""
    specs = jax.tree.map(lambda _: P(TP_AXIS), state)
    return dataclasses.replace(specs, seqs=jax.tree.map(lambda _: P(), state.seqs), clock=P())


def host_specs(config: CacheConfig) -> HostPool:
    """PartitionSpecs of the host pool: every array (pages, and a scaled codec's scales) by rank over "tp"."""
    r = P(TP_AXIS)
    return HostPool(r, r, r, r) if config.codec.scaled else HostPool(r, r)


def init_sharded(config: CacheConfig, mesh: Mesh, *, check: bool = True) -> tuple[CacheState, HostPool]:
    """A fresh TP cache: each rank's shard is built on its own device by the single-device `cache_state.init`
    (one-rank config), then the shards are joined into global arrays sharded over "tp" (nothing is built for
    all ranks on one device)."""
    check_tp(config)
    devices = list(mesh.devices.flat)
    if len(devices) != config.tp:
        raise ValueError(f"mesh has {len(devices)} devices but cache_config.tp = {config.tp}")
    parts = []
    for rank, d in enumerate(devices):
        with jax.default_device(d):
            s, h = cache_state_mod.init(local_config(config, rank), device=d, check=check)
        parts.append((dataclasses.replace(s, config=config), h))   # one static config, so the trees join
    specs = state_specs(parts[0][0])
    kind = host_memory_kind(devices[0])

    def join(spec, *xs, memory_kind=None):
        sh = NamedSharding(mesh, spec, memory_kind=memory_kind)
        shape = xs[0].shape if spec == P() else (config.tp,) + xs[0].shape[1:]
        return jax.make_array_from_single_device_arrays(shape, sh, list(xs))

    state = jax.tree.map(join, specs, *[p[0] for p in parts])
    host = jax.tree.map(lambda spec, *xs: join(spec, *xs, memory_kind=kind), host_specs(config), *[p[1] for p in parts])
    return state, host


def shard_cache(state: CacheState, host: HostPool, mesh: Mesh) -> tuple[CacheState, HostPool]:
    """Spread an existing cache (e.g. from `cache_state.init(config)` with config.tp = R, all on one device) over
    the mesh: rank r's slice of the leading axis goes to device r."""
    kind = host_memory_kind(mesh.devices.flat[0])
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state)))
    host = jax.device_put(host, jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=kind),
                                            host_specs(state.config)))
    return state, host


# ---- model ------------------------------------------------------------------------------------------------------
class RowParallelAttention(Attention):
    """Attention whose o_proj holds this rank's heads only: partial sums, psum over tp, then the bias."""

    def out(self, attn_out):  # [B, T, Hr, D] -> [B, T, E]
        y = jnp.einsum("BTHD,EHD->BTE", attn_out.astype(self.o_proj.dtype), self.o_proj[...])
        y = jax.lax.psum(y, TP_AXIS)
        return y if self.o_bias is None else y + self.o_bias[...]


class RowParallelMLP(MLP):
    """SwiGLU over this rank's slice of F (gate/up column-parallel, down row-parallel), psum over tp."""

    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        return jax.lax.psum(super().__call__(x), TP_AXIS)


def tp_graphdef(model) -> nnx.GraphDef:
    """The model's graphdef with the row-parallel module classes: `nnx.merge(graphdef, local_params)` inside
    shard_map then runs one rank's share of every layer, psums included. The weights are not copied."""
    graphdef, params = nnx.split(model)
    shell = nnx.merge(graphdef, params)          # new module objects over the same arrays
    for layer in shell.layers:
        if type(layer.self_attn) is Attention:
            layer.self_attn.__class__ = RowParallelAttention
        if type(layer.mlp) is MLP:
            layer.mlp.__class__ = RowParallelMLP
    return nnx.split(shell)[0]


# gate_proj / up_proj: the checkpoint tensors as a loader places them, before fuse_gate_up stacks them into
# gate_up_proj [2, F, E] (F on axis 1)
_COLUMN = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "q_bias": 0, "k_bias": 0, "v_bias": 0, "gate_proj": 0,
           "up_proj": 0, "gate_up_proj": 1}
_ROW = {"o_proj": 1, "down_proj": 1}
_KV = ("k_proj", "v_proj", "k_bias", "v_bias")


def _param_name(path) -> str:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(names[-1]) if names else ""


def param_spec(name: str) -> P:
    """The PartitionSpec of a param by its name (the last step of its state path): column-parallel
    q/k/v and their biases, gate_up (F on axis 1; gate/up as a loader places them), row-parallel o/down,
    everything else replicated."""
    axis = {**_COLUMN, **_ROW}.get(name)
    return P() if axis is None else P(*([None] * axis + [TP_AXIS]))


def param_specs(params):
    """PartitionSpecs for the model's params (an nnx.State or a pure dict), per `param_spec`."""
    return jax.tree_util.tree_map_with_path(lambda path, x: param_spec(_param_name(path)), params)


def shard_params(params, mesh: Mesh):
    """Place the params on the mesh per `param_specs` (checks that every split axis divides by tp)."""
    tp = mesh.shape[TP_AXIS]
    specs = param_specs(params)

    def check(path, x, s):
        for ax, name in enumerate(s):
            if name == TP_AXIS and x.shape[ax] % tp:
                raise ValueError(f"param {jax.tree_util.keystr(path)} of shape {x.shape}: axis {ax} "
                                 f"({x.shape[ax]}) does not divide by tp = {tp}")
    jax.tree_util.tree_map_with_path(check, params, specs)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def shard_bytes(params, tp: int) -> int:
    """Bytes one rank holds of `params` (arrays or ShapeDtypeStructs, e.g. from nnx.eval_shape) placed per
    `param_specs` over tp ranks: what a model costs each device before anything is allocated."""
    specs = param_specs(params)

    def one(x, s):
        n = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        return n // tp if TP_AXIS in tuple(s) else n
    return int(sum(jax.tree.leaves(jax.tree.map(one, params, specs))))


def init_model(config, mesh: Mesh, *, dtype=jnp.bfloat16, seed: int = 0):
    """A LlamaModel with random weights made directly in its TP sharding over `mesh`: one jitted init whose
    outputs carry the params' shardings, so each device computes and holds only its own shards and a model
    larger than one device never lands on one. The values equal an unsharded `LlamaModel(config, dtype=dtype,
    rngs=nnx.Rngs(seed))` (JAX's partitionable threefry draws the same bits however the output is split).
    config.num_kv_heads, num_heads and intermediate_size must divide by the mesh's tp."""
    tp = mesh.shape[TP_AXIS]
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        n = getattr(config, name)
        if n % tp:
            raise ValueError(f"init_model: tp = {tp} must divide {name} = {n}")

    def make():
        return nnx.split(LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(seed)))[1]
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(seed))))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(abstract))
    return nnx.merge(graphdef, jax.jit(make, out_shardings=shardings)())


def param_shardings(mesh: Mesh, num_kv_heads: int | None = None):
    """The loaders' placement for TP over `mesh`: a function from a param's state path (("layers", 0,
    "self_attn", "q_proj")) to its NamedSharding, per `param_spec`. With `num_kv_heads` that tp does not divide
    (more ranks than KV heads) the k/v projections stay replicated, for `prepare_model` to repeat them."""
    tp = mesh.shape[TP_AXIS]
    kv_whole = num_kv_heads is not None and num_kv_heads % tp != 0

    def sharding(path) -> NamedSharding:
        name = str(path[-1])
        return NamedSharding(mesh, P() if kv_whole and name in _KV else param_spec(name))
    return sharding


def load_model(path, mesh: Mesh, *, dtype=jnp.bfloat16):
    """A trained model loaded directly into its TP sharding over `mesh`: an orbax checkpoint written by
    models.save (models.load), or a Hugging Face folder, a GGUF or a pretrained preset name
    (models.from_pretrained). Each tensor is placed into its shards as it is read (`param_shardings`: one slice
    per device), so no device ever holds the whole model. The model is checked to split (`check_model_tp`) from
    its config before any tensor is read; with more ranks than KV heads the k/v projections load replicated and
    come back repeated (`prepare_model`)."""
    tp = mesh.shape[TP_AXIS]
    if model_checkpoint.is_checkpoint(path):
        config = model_checkpoint.read_config(path)
    else:
        path = resolve_model_path(path)
        gguf_file = gguf_loader.find_gguf(path)
        config = (gguf_loader.gguf_config(gguf_loader.open_gguf(gguf_file)) if gguf_file is not None
                  else hf_loader.read_hf_config(path))
    check_model_tp(config, tp)
    shardings = param_shardings(mesh, config.num_kv_heads)
    if model_checkpoint.is_checkpoint(path):
        model = model_checkpoint.load(path, dtype=dtype, shardings=shardings)
    else:
        model = hf_loader.from_pretrained(path, dtype, shardings=shardings)
    return prepare_model(model, tp)


def check_model_tp(config, tp: int) -> None:
    """The clear error for a model that does not split `tp` ways: tp must divide num_heads and intermediate_size,
    and divide num_kv_heads or be a multiple of it (then KV heads are replicated)."""
    for name in ("num_heads", "intermediate_size"):
        n = getattr(config, name)
        if n % tp:
            raise ValueError(f"tp = {tp} must divide the model's {name} = {n}")
    k = config.num_kv_heads
    if k % tp and tp % k:
        raise ValueError(f"tp = {tp} must divide num_kv_heads = {k} or be a multiple of it (then KV heads are "
                         "replicated)")


def device_bytes(params, mesh: Mesh) -> dict:
    """Bytes each device of `mesh` holds of `params` (arrays or ShapeDtypeStructs, e.g. from nnx.eval_shape) placed
    by `param_shardings`: device id -> bytes, from each sharding's own per-device index map."""
    sharding = param_shardings(mesh)
    out = {d.id: 0 for d in mesh.devices.flat}

    def add(path, x):
        sh = sharding((_param_name(path),))
        item = jnp.dtype(x.dtype).itemsize
        for d, idx in sh.devices_indices_map(tuple(x.shape)).items():
            out[d.id] += math.prod(len(range(*i.indices(n))) for i, n in zip(idx, x.shape)) * item
    jax.tree_util.tree_map_with_path(add, params)
    return out


def replicate_kv_heads(model, factor: int):
    """A model computing the same function with each KV head repeated `factor` times (adjacent copies), so that
    tp = num_kv_heads * factor ranks each own whole KV heads. Weights other than k/v are shared, not copied."""
    mc = model.config
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"factor = {factor!r} must be an int >= 1")
    if factor == 1:
        return model
    if mc.num_heads % (mc.num_kv_heads * factor):
        raise ValueError(f"cannot replicate {mc.num_kv_heads} KV heads {factor}x: num_heads = {mc.num_heads} is "
                         f"not a multiple of {mc.num_kv_heads * factor}")
    graphdef, params = nnx.split(model)
    new = nnx.merge(graphdef, params)
    for layer in new.layers:
        a = layer.self_attn
        for name in ("k_proj", "v_proj", "k_bias", "v_bias"):
            var = getattr(a, name)
            if var is not None:
                setattr(a, name, nnx.Param(jnp.repeat(var[...], factor, axis=0)))
    new.config = mc.replace(num_kv_heads=mc.num_kv_heads * factor)
    return new


def prepare_model(model, tp: int):
    """Check that the model splits `tp` ways (heads, KV heads, MLP width) and replicate KV heads when tp exceeds
    them. Returns the model to shard (the same object when nothing needs replicating)."""
    check_model_tp(model.config, tp)
    k = model.config.num_kv_heads
    return model if k % tp == 0 else replicate_kv_heads(model, tp // k)


# ---- the shard_map wrapper ----------------------------------------------------------------------------------------
def per_rank(fn, mesh: Mesh, config: CacheConfig, in_specs, out_specs):
    """`jax.shard_map(fn)` over "tp" where every CacheState argument and result carries the one-rank config
    (`local_config`) inside the map and the global one outside, so `fn` is single-device cache code."""
    local = local_config(config)

    def swap(tree, c):
        return jax.tree.map(lambda x: dataclasses.replace(x, config=c) if isinstance(x, CacheState) else x, tree,
                            is_leaf=lambda x: isinstance(x, CacheState))

    def body(*args):
        return swap(fn(*swap(args, local)), config)
    body.__name__ = f"tp_{getattr(fn, '__name__', 'fn')}"
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
