"""A format-1 orbax checkpoint written by hand (models/checkpoint.py before gate_up_proj): each MLP's gate_proj and
up_proj [F, E] stored apart. For the tests that load one (test_models, test_tp_load)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


def save_format1(model, folder) -> pathlib.Path:
    """`model`'s params in format 1's tree (str layer keys, gate_up_proj split) + its model.json, under `folder`."""
    folder = pathlib.Path(folder).absolute()
    tree = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    old = {key: x for key, x in tree.items() if key != "layers"}
    old["layers"] = {}
    for i, layer in tree["layers"].items():
        mlp = dict(layer["mlp"])
        gu = mlp.pop("gate_up_proj")
        old["layers"][str(i)] = {**layer, "mlp": {**mlp, "gate_proj": gu[0], "up_proj": gu[1]}}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(folder / "params", old)
        ckptr.wait_until_finished()
    meta = {"format": 1, "dtype": np.dtype(model.dtype).name, "config": model.config.to_dict()}
    (folder / "model.json").write_text(json.dumps(meta))
    return folder
