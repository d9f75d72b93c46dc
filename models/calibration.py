"""Offline label-channel tables shipped with the package, found by the model file's digest.

scripts/calibrate_labels.py writes `calibration/<digest16>.json` (digest: the sha256 of the model file, a GGUF):
per layer and KV head the rotary pairs that carry the most of q.k on shipped text, for several channel counts C.
`CacheConfig.channel_table` takes `channels[str(C)]`. A pretrained preset names its file's sha256, so its table is
found without hashing the file; any other file is hashed once (about 1 s per GB).
"""
from __future__ import annotations

import json
import os
import pathlib

from .fetch import sha256_file as file_digest
from .pretrained import PRETRAINED, resolve_model_path

FOLDER = pathlib.Path(__file__).resolve().parent / "calibration"


def model_digest(model: str | os.PathLike) -> str | None:
    """The digest a model's table is filed under: a preset's pinned sha256, else the sha256 of the model file (a
    GGUF file, or the one GGUF in a folder); None for anything else (a Hugging Face folder has no table yet)."""
    if isinstance(model, str) and model in PRETRAINED and getattr(PRETRAINED[model], "sha256", None):
        return PRETRAINED[model].sha256
    p = resolve_model_path(model)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        p = ggufs[0] if len(ggufs) == 1 else None
    if p is None or not p.is_file() or p.suffix != ".gguf":
        return None
    return file_digest(p)


def table_path(digest: str, folder: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the table of the model with this digest is filed (it may not exist)."""
    return pathlib.Path(folder or FOLDER) / f"{digest[:16]}.json"


def channel_table(model: str | os.PathLike, num_channels: int, folder: str | os.PathLike | None = None,
                  digest: str | None = None):
    """The shipped table [L][KV][C] for `model` at C = num_channels, or None when there is none (the labels then
    calibrate online from each sequence's first prefill block). C = the head dim (every channel) is the identity
    table, from the file's per-channel scores' shape. ValueError when the model has a table but not for this C (names
    the Cs it has). digest: the model's `model_digest`, if the caller has it (a GGUF file is hashed
    once, not once a lookup)."""
    digest = digest or model_digest(model)
    if digest is None:
        return None
    path = table_path(digest, folder)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("model_digest") != digest:
        raise ValueError(f"{path}: model_digest {data.get('model_digest')!r} is not the model's {digest!r}")
    tables = data["channels"]
    score = data.get("score")                                    # [L][KV][D] each channel's share of q.k
    if str(num_channels) not in tables and score and num_channels == len(score[0][0]):
        # every channel: the table is the identity for every layer and head, whatever the calibration measured
        return [[list(range(num_channels)) for _ in layer] for layer in score]
    if str(num_channels) not in tables:
        raise ValueError(f"{path} has label-channel tables for C = {sorted(map(int, tables))}, not {num_channels}: "
                         f"run `python -m scripts.calibrate_labels --channels {num_channels}`")
    return tables[str(num_channels)]


def fit_heads(table, num_kv_heads: int):
    """A table [L][KV][C] for a model whose KV heads were replicated for more ranks than heads (tp.prepare_model:
    each head's adjacent copies): each head's row repeated as its head is; as is where the counts match, None where
    they cannot (a table of another model)."""
    kv = len(table[0])
    if kv == num_kv_heads:
        return table
    if num_kv_heads % kv:
        return None
    rep = num_kv_heads // kv
    return [[row for row in layer for _ in range(rep)] for layer in table]

