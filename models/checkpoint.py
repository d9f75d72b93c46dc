"""Orbax checkpoints of converted models: `save(model, path)` / `load(path)`, exact round trip.

Layout of `path/`:
    model.json   {"format": 2, "dtype": "bfloat16", "config": ModelConfig.to_dict()}
    params/      orbax StandardCheckpointer tree of the model's params as a pure dict
A pure dict (nested str keys, array leaves) rather than an nnx.State keeps the on-disk tree independent of
flax's Variable classes, so checkpoints move between flax versions. `load(..., shardings=)` restores each param
straight into its Sharding (orbax reads every device's slice from the files), so a model larger than one device is
never held by one (tp.load_model).
Format 2 stores each MLP's gate and up as one gate_up_proj [2, F, E] (llama.MLP); format 1 (gate_proj and up_proj
[F, E] each) still loads, stacked as it is restored.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from .config import ModelConfig
from .llama import LlamaModel
from .weights import CheckpointError, Shardings, fuse_gate_up

META_FILE = "model.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 2
READ_FORMATS = (1, 2)


def _stringify(tree):
    # nnx.List children have int keys; orbax tree paths want strings.
    if isinstance(tree, dict):
        return {str(k): _stringify(v) for k, v in tree.items()}
    return tree


def save(model: LlamaModel, path: str | os.PathLike) -> None:
    """Writes `model` to the folder `path` (created; must not hold a checkpoint already)."""
    folder = pathlib.Path(path).absolute()  # orbax requires absolute paths
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / PARAMS_DIR).exists():
        raise FileExistsError(f"{folder / PARAMS_DIR} already exists")
    params = _stringify(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    meta = {"format": FORMAT_VERSION, "dtype": np.dtype(model.dtype).name, "config": model.config.to_dict()}
    # Written last, so a folder with model.json holds a complete checkpoint.
    (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder written by `save` (its model.json is written last)."""
    return (pathlib.Path(path) / META_FILE).is_file()


def _meta(folder: pathlib.Path) -> tuple[ModelConfig, np.dtype, int]:
    """(config, saved param dtype, format) of the checkpoint in `folder` (_parse_meta's errors)."""
    meta_file = folder / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"no {META_FILE} in {folder}: not a checkpoint written by models.save")
    return _parse_meta(meta_file)


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint written by `save`, without reading its params."""
    return _meta(pathlib.Path(path).absolute())[0]


def load(path: str | os.PathLike, *, dtype=None, shardings: Shardings | None = None) -> LlamaModel:
    """Restores a model written by `save`. `dtype=None` keeps the saved param dtype; otherwise orbax casts.
    `shardings`: a function from each param's state path (e.g. ("layers", 0, "mlp", "gate_up_proj")) to the Sharding
    it is restored into; None restores onto the default device."""
    folder = pathlib.Path(path).absolute()
    config, saved_dtype, fmt = _meta(folder)
    dtype = saved_dtype if dtype is None else jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # ShapeDtypeStruct leaves
    if shardings is not None:
        abstract = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings(tuple(k.key for k in p))),
            abstract)
    if fmt == 1:
        restored = _restore_params(folder, _format1_tree(abstract, shardings))
        _stack_gate_up(restored, (), shardings)
    else:
        restored = _restore_params(folder, abstract)
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, restored)  # maps the str layer keys back to ints
    return nnx.merge(graphdef, state)


def _format1_tree(abstract, shardings: Shardings | None):
    """The param tree a format-1 checkpoint holds: each gate_up_proj [2, F, E] of `abstract` as gate_proj and
    up_proj [F, E], placed as a loader places those tensors."""
    def walk(node, path):
        if not isinstance(node, dict):
            return node
        out = {}
        for key, x in node.items():
            if key != "gate_up_proj":
                out[key] = walk(x, (*path, key))
                continue
            for name in ("gate_proj", "up_proj"):
                where = None if shardings is None else shardings((*path, name))
                out[name] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=where)
        return out
    return walk(abstract, ())


def _stack_gate_up(node, path: tuple, shardings: Shardings | None) -> None:
    """In place over a restored format-1 tree: gate_proj and up_proj -> gate_up_proj (weights.fuse_gate_up)."""
    if not isinstance(node, dict):
        return
    if "gate_proj" in node and "up_proj" in node:
        flat = {(*path, name): node.pop(name) for name in ("gate_proj", "up_proj")}
        fuse_gate_up(flat, None, shardings)
        node.update({p[-1]: x for p, x in flat.items()})
    for key, child in node.items():
        _stack_gate_up(child, (*path, key), shardings)


def _parse_meta(meta_file: pathlib.Path) -> tuple[ModelConfig, np.dtype, int]:
    """model.json -> (config, saved param dtype, format); a CheckpointError naming the file and the key
    otherwise."""
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot parse {meta_file}: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} must hold a JSON object, not {type(meta).__name__}")
    if meta.get("format") not in READ_FORMATS:
        raise CheckpointError(f"{meta_file}: unsupported checkpoint format {meta.get('format')!r} (this version "
                              f"reads formats {READ_FORMATS})")
    for key in ("config", "dtype"):
        if key not in meta:
            raise CheckpointError(f"{meta_file}: missing key {key!r}")
    try:
        config = ModelConfig.from_dict(meta["config"])
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{meta_file}: 'config': {err}") from None
    try:
        dtype = np.dtype(jnp.dtype(meta["dtype"]))
    except TypeError:
        raise CheckpointError(f"{meta_file}: 'dtype' {meta['dtype']!r} is not a dtype") from None
    return config, dtype, meta["format"]


def _restore_params(folder: pathlib.Path, abstract) -> dict:
    """params/ restored into `abstract` (the config's param tree); a CheckpointError when they do not match."""
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(folder / PARAMS_DIR, _stringify(abstract))
        except ValueError as err:
            raise CheckpointError(f"{folder / PARAMS_DIR}: the params do not match the config in "
                                  f"{folder / META_FILE} ({str(err)[:300]})") from None
