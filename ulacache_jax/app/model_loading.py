"""The model a command runs: a preset (random weights), a packaged pretrained model, a GGUF file or a Hugging Face /
orbax folder, in the run's dtype, with its tokenizer; with --tp, loaded into its shards. Errors name the option
and what was wrong (UsageError)."""
from __future__ import annotations

import dataclasses
import pathlib

from ulacache_jax.app.errors import UsageError

DEFAULT_MODEL = "smollm2-135m"   # trained, answers in words; the random presets are for tests and speed runs


@dataclasses.dataclass
class LoadedModel:
    model: object
    tokenizer: object | None
    label: str
    random_weights: bool


def resolve_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    import jax
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def model_error(spec: str, e: BaseException) -> UsageError:
    """A clear message for a model folder the loaders in models/ could not read."""
    if isinstance(e, KeyError):
        return UsageError(f"--model {spec!r}: the model's config lacks the field {e.args[0]!r} (config.json of a "
                          "Hugging Face folder, or 'config' in model.json of a ulacache_jax checkpoint)")
    return UsageError(f"--model {spec!r}: cannot load it ({type(e).__name__}: {e})")


def load_model(spec: str | None, dtype: str, seed: int, tp_mod=None, tp: int = 1) -> LoadedModel:
    """The model `spec` names; with tp > 1 (tp_mod: ulacache_jax.runtime.tp) made or loaded directly into its TP sharding
    over tp devices (tp.init_model, tp.load_model), so no device ever holds the whole model."""
    import jax.numpy as jnp
    from flax import nnx
    from ulacache_jax import models

    jdt = jnp.dtype(resolve_dtype(dtype))
    try:
        mesh = tp_mod.make_mesh(tp) if tp_mod is not None and tp > 1 else None
    except ValueError as e:        # fewer devices than --tp
        raise UsageError(f"--tp {tp}: {e}") from None
    name = spec or DEFAULT_MODEL
    path = pathlib.Path(name)
    if name in models.PRETRAINED and not path.exists():     # a trained model shipped in a package (SmolLM2)
        try:
            model = (models.from_pretrained(name, dtype=jdt) if mesh is None
                     else tp_mod.load_model(name, mesh, dtype=jdt))
            tok = models.load_tokenizer(name)
        except FileNotFoundError as e:
            hint = "" if spec else " (the default model; --model tiny runs the tiny preset with RANDOM weights)"
            raise UsageError(f"--model {name!r}{hint}: {e}") from None
        return LoadedModel(model, tok, f"{name} ({models.resolve_pretrained(name).name})", False)
    if name in models.PRESETS and not path.exists():
        mc = models.get_preset(name)
        if mesh is not None and not any(n % tp for n in (mc.num_heads, mc.num_kv_heads, mc.intermediate_size)):
            model = tp_mod.init_model(mc, mesh, dtype=jdt, seed=seed)     # the same weights, made in their shards
        else:
            model = models.LlamaModel(mc, dtype=jdt, rngs=nnx.Rngs(seed))
        tok = models.ByteTokenizer() if mc.vocab_size == models.BYTE_VOCAB_SIZE else None
        return LoadedModel(model, tok, f"{name} preset, RANDOM weights (seed {seed})", True)
    if not path.exists():
        raise UsageError(f"--model {spec!r}: no such folder, and not a preset (presets: {', '.join(models.PRESETS)})")
    try:
        if mesh is not None:
            model = tp_mod.load_model(path, mesh, dtype=jdt)
        elif path.is_dir() and (path / "model.json").is_file():
            model = models.load(path, dtype=jdt)
        else:
            model = models.from_pretrained(path, dtype=jdt)
    except KeyboardInterrupt:
        raise
    except Exception as e:   # noqa: BLE001 - the loaders raise KeyError/TypeError on incomplete configs
        raise model_error(spec, e) from None
    tok = None
    gguf = path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))
    if (path.is_dir() and (path / "tokenizer.json").is_file()) or gguf:
        try:
            tok = models.load_tokenizer(path)
        except KeyboardInterrupt:
            raise
        except Exception as e:   # noqa: BLE001 - tokenizers raises a bare Exception on a corrupt file
            where = path / "tokenizer.json" if path.is_dir() and not gguf else path
            raise UsageError(f"--model {spec!r}: cannot read the tokenizer {where} ({type(e).__name__}: "
                             f"{str(e)[:300]})") from None
    elif model.config.vocab_size == models.BYTE_VOCAB_SIZE:
        tok = models.ByteTokenizer()
    return LoadedModel(model, tok, f"{path.name} ({path})", False)
