"""What the weight loaders share (Hugging Face folders, GGUF files, orbax checkpoints): the error they raise,
where a param goes (one device or its tensor-parallel Sharding), and how loaded tensors become a LlamaModel.
Below hf_loader, gguf_loader and checkpoint so that none of them imports another for these."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .llama import LlamaModel


class CheckpointError(ValueError):
    """A model folder that cannot be loaded: missing/corrupt files, missing or misshapen tensors."""


StatePath = tuple[str | int, ...]  # a param's place in the model state, e.g. ("layers", 0, "mlp", "up_proj")
Shardings = Callable[[StatePath], jax.sharding.Sharding]


def placement(device, shardings: Shardings | None, path: StatePath):
    """Where the param at `path` goes: `shardings(path)` when given (then `device` must be None), else `device`."""
    if shardings is None:
        return device
    if device is not None:
        raise ValueError("pass device or shardings, not both")
    return shardings(path)


def fuse_gate_up(params: dict, device=None, shardings: Shardings | None = None) -> None:
    """In place: each MLP's loaded gate_proj and up_proj [F, E] -> its gate_up_proj [2, F, E] (llama.MLP reads
    both with one matmul), placed where `gate_up_proj` goes (`placement`: with `shardings`, straight into its
    Sharding). A gate_proj without its up_proj is left alone (the caller's missing-tensor error names it)."""
    for path in [p for p in params if p[-1] == "gate_proj" and (*p[:-1], "up_proj") in params]:
        where = placement(device, shardings, (*path[:-1], "gate_up_proj"))
        sharded = where if isinstance(where, jax.sharding.Sharding) else None   # a Device: already there
        stack = jax.jit(_stack_pair, out_shardings=sharded)  # one compile for all layers: same function and shapes
        params[(*path[:-1], "gate_up_proj")] = stack(params.pop(path), params.pop((*path[:-1], "up_proj")))


def _stack_pair(a, b):  # [F, E] x 2 -> [2, F, E]
    return jnp.stack([a, b])


def assemble(config: ModelConfig, dtype, params: dict, *, where, unexpected, missing, source: str, device=None,
             shardings: Shardings | None = None) -> LlamaModel:
    """The loaded params (flat state path -> array) as a LlamaModel: unexpected or missing checkpoint tensors are
    a CheckpointError naming them (up to 8) and `where`; gate and up are stacked (`fuse_gate_up`, placed per
    `device` / `shardings` as the loader placed the rest); an abstract model (shapes only, nothing allocated) then
    gets its params replaced by the loaded ones. Shared by the Hugging Face and GGUF loaders."""
    def named(xs):
        return ", ".join(sorted(xs)[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")

    if unexpected:
        raise CheckpointError(f"unexpected tensors in {where} for {config.architecture}: {named(unexpected)}")
    if missing:
        raise CheckpointError(f"missing tensors in {where}: {named(missing)}")
    fuse_gate_up(params, device, shardings)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(0))))
    model_shapes = {path: tuple(var.shape) for path, var in nnx.to_flat_state(state)}
    loaded_shapes = {path: tuple(x.shape) for path, x in params.items()}
    if model_shapes != loaded_shapes:  # the tensor map disagrees with LlamaModel: a bug here, not bad input
        raise AssertionError(f"{source} does not match LlamaModel params: {model_shapes} vs {loaded_shapes}")
    nnx.replace_by_pure_dict(state, _nest(params))
    return nnx.merge(graphdef, state)


def _nest(flat: dict[tuple[str | int, ...], jax.Array]) -> dict:
    """{("layers", 0, "mlp", "up_proj"): x} -> {"layers": {0: {"mlp": {"up_proj": x}}}} (nnx pure-dict form)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for step in path[:-1]:
            node = node.setdefault(step, {})
        node[path[-1]] = value
    return out
