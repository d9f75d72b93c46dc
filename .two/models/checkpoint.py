"""Orbax checkpoints of converted models: `save(model, path)` / `load(path)`, exact round trip.

Layout of `path/`:
    model.json   {"format": 1, "dtype": "bfloat16", "config": ModelConfig.to_dict()}
    params/      orbax StandardCheckpointer tree of the model's params as a pure dict
A pure dict (nested str keys, array leaves) rather than an nnx.State keeps the on-disk tree independent of
flax's Variable classes, so checkpoints move between flax versions. `load(..., shardings=)` restores each param
straight into its Sharding (orbax reads every device's slice from the files), so a model larger than one device is
never held by one (tp.load_model).
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
from .hf_loader import CheckpointError, Shardings
from .llama import LlamaModel

META_FILE = "model.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


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


def _meta(folder: pathlib.Path) -> tuple[ModelConfig, np.dtype]:
    """(config, saved param dtype) of the checkpoint in `folder` (_parse_meta's errors)."""
    meta_file = folder / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"no {META_FILE} in {folder}: not a checkpoint written by models.save")
    return _parse_meta(meta_file)


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint written by `save`, without reading its params."""
    return _meta(pathlib.Path(path).absolute())[0]


def load(path: str | os.PathLike, *, dtype=None, shardings: Shardings | None = None) -> LlamaModel:
    """Restores a model written by `save`. `dtype=None` keeps the saved param dtype; otherwise orbax casts.
    `shardings`: a function from each param's state path (e.g. ("layers", 0, "mlp", "up_proj")) to the Sharding
    it is restored into; None restores onto the default device."""
    folder = pathlib.Path(path).absolute()
    config, saved_dtype = _meta(folder)
    dtype = saved_dtype if dtype is None else jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # ShapeDtypeStruct leaves
    if shardings is not None:
        abstract = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings(tuple(k.key for k in p))),
            abstract)
    restored = _restore_params(folder, abstract)
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, restored)  # maps the str layer keys back to ints
    return nnx.merge(graphdef, state)


def _parse_meta(meta_file: pathlib.Path) -> tuple[ModelConfig, np.dtype]:
    """model.json -> (config, saved param dtype); a CheckpointError naming the file and the key otherwise."""
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot parse {meta_file}: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} must hold a JSON object, not {type(meta).__name__}")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file}: unsupported checkpoint format {meta.get('format')!r} (this version "
                              f"reads format {FORMAT_VERSION})")
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
    return config, dtype


def _restore_params(folder: pathlib.Path, abstract) -> dict:
    """params/ restored into `abstract` (the config's param tree); a CheckpointError when they do not match."""
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(folder / PARAMS_DIR, _stringify(abstract))
        except ValueError as err:
            raise CheckpointError(f"{folder / PARAMS_DIR}: the params do not match the config in "
                                  f"{folder / META_FILE} ({str(err)[:300]})") from None
