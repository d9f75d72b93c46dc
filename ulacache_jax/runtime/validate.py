"""Argument checks at the Python API boundary (`ulacache_jax.generate`, `Engine`): a clear ValueError/TypeError
naming the value and the limit, before anything reaches jax, where a wrong type either fails deep inside a trace
or, worse, is silently coerced (a float id truncated, a flat id list read as one-token prompts, an unknown stop id
never matched).

Each function returns the normalized value (plain Python ints/floats/tuples), so callers use what was checked.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

MAX_SEED = 2**32          # seeds are folded into uint32 PRNG keys (the Engine keeps one per slot)


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def _describe(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def check_prompt(prompt: Any, vocab_size: int, *, name: str = "prompt") -> list[int]:
    """One prompt: a non-empty flat sequence of integer token ids in [0, vocab_size) -> list[int]. Floats (even
    1.0), bools, strings and nested lists are refused, not coerced."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"{name} is a {type(prompt).__name__} ({_describe(prompt)}): pass token ids (tokenize the "
                        "text first, e.g. tokenizer.encode(text))")
    if hasattr(prompt, "dtype") and hasattr(prompt, "shape"):     # numpy / jax arrays
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D token ids, got an array of shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
        ids = [int(t) for t in arr]
    else:
        try:
            items = list(prompt)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids, got {type(prompt).__name__} "
                            f"({_describe(prompt)})") from None
        for j, t in enumerate(items):
            if not _is_int(t):
                what = "a nested sequence" if isinstance(t, (list, tuple, np.ndarray)) else \
                    f"{type(t).__name__} {_describe(t)}"
                raise TypeError(f"{name}[{j}] is {what}: token ids must be ints (not floats or bools)")
        ids = [int(t) for t in items]
    if not ids:
        raise ValueError(f"{name} is empty")
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{j}] = {t} is outside [0, vocab_size = {vocab_size})")
    return ids


def check_prompt_batch(prompt_ids: Any, vocab_size: int) -> list[list[int]]:
    """A batch of prompts, `[[ids...], ...]` (a list of id lists, a 2-D int array, or a list of 1-D arrays) ->
    list[list[int]]. A flat list of ints is refused (it would be read as one-token prompts): wrap it, `[ids]`."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"prompt_ids is a {type(prompt_ids).__name__}: pass token ids, [[id, ...], ...] (tokenize the "
                        "text first)")
    if hasattr(prompt_ids, "dtype") and hasattr(prompt_ids, "shape"):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            raise ValueError(f"prompt_ids is a 1-D array of {arr.shape[0]} ids: that would be {arr.shape[0]} one-token "
                             "prompts; for one prompt pass [ids] (a batch of one), e.g. ids[None]")
        if arr.ndim != 2:
            raise ValueError(f"prompt_ids must be a batch [num_prompts, length], got shape {arr.shape}")
        prompts = list(arr)
    else:
        try:
            prompts = list(prompt_ids)
        except TypeError:
            raise TypeError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids).__name__}") from None
    if not prompts:
        raise ValueError("prompt_ids is empty: give at least one prompt, [[id, ...]]")
    if all(_is_int(p) for p in prompts):
        preview = ", ".join(str(int(p)) for p in prompts[:4]) + (", ..." if len(prompts) > 4 else "")
        raise ValueError(f"prompt_ids is a flat list of {len(prompts)} ints ([{preview}]): that would be "
                         f"{len(prompts)} one-token prompts. For one prompt pass [[{preview}]] (a batch of one)")
    return [check_prompt(p, vocab_size, name=f"prompt_ids[{i}]") for i, p in enumerate(prompts)]


def check_stop_ids(stop_ids: Any, vocab_size: int) -> tuple[int, ...]:
    """Stop token ids: an int or a sequence of ints, each in [0, vocab_size) -> tuple. A string is refused (stop
    ids are token ids; text stops need a tokenizer: `stop=` strings in the CLI's JSONL)."""
    if stop_ids is None:
        return ()
    if isinstance(stop_ids, (str, bytes)):
        raise TypeError(f"stop_ids = {_describe(stop_ids)} is a string: stop_ids are token ids (ints); "
                        "tokenize the stop text, e.g. stop_ids=tokenizer.encode(text, add_special_tokens=False)")
    if _is_int(stop_ids):
        stop_ids = (stop_ids,)
    try:
        items = list(np.asarray(stop_ids).reshape(-1)) if hasattr(stop_ids, "dtype") else list(stop_ids)
    except TypeError:
        raise TypeError(f"stop_ids must be a sequence of ints, got {type(stop_ids).__name__}") from None
    out = []
    for t in items:
        if not _is_int(t):
            raise TypeError(f"stop id {_describe(t)} must be an int")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"stop id {int(t)} is outside [0, vocab_size = {vocab_size}): it could never be "
                             "generated, so it would never stop anything")
        out.append(int(t))
    return tuple(out)


def check_seed(seed: Any) -> int:
    """An int in [0, 2**32). None is refused rather than read as 'random': sampling here is reproducible by
    design, and generate()'s default seed is 0."""
    if seed is None:
        raise TypeError("seed = None: pass an int in [0, 2**32) (the default is 0; the same seed gives the same "
                        "samples)")
    if not _is_int(seed):
        raise TypeError(f"seed = {_describe(seed)} must be an int in [0, 2**32)")
    if not 0 <= int(seed) < MAX_SEED:
        raise ValueError(f"seed = {int(seed)} is outside [0, 2**32)")
    return int(seed)


def check_max_new_tokens(max_new_tokens: Any) -> int:
    if not _is_int(max_new_tokens) or int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens = {_describe(max_new_tokens)} must be an int >= 1")
    return int(max_new_tokens)


def check_sampling_args(temperature: Any, top_p: Any, top_k: Any, vocab_size: int) -> tuple[float, float, int]:
    """-> (temperature, top_p, top_k) as float, float, int: temperature >= 0 (0 = greedy), top_p in (0, 1],
    top_k an int in [0, vocab_size] (0 = off); strings, bools, NaN and infinities refused."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if not _is_real(v):
            raise TypeError(f"{name} = {_describe(v)} must be a number")
        if not math.isfinite(float(v)):
            raise ValueError(f"{name} = {v} must be finite")
    if not _is_int(top_k):
        raise TypeError(f"top_k = {_describe(top_k)} must be an int (0 = off)")
    t, p, k = float(temperature), float(top_p), int(top_k)
    if t < 0:
        raise ValueError(f"temperature = {t} must be >= 0 (0 = greedy)")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p = {p} must be in (0, 1]")
    if not 0 <= k <= vocab_size:
        raise ValueError(f"top_k = {k} must be in [0, vocab_size = {vocab_size}] (0 = off)")
    return t, p, k


def check_generate_args(prompt_ids, vocab_size: int, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0,
                        seed=0, stop_ids=()) -> dict:
    """Every argument of `generate()` at once -> the normalized values, by name (prompts: list[list[int]])."""
    t, p, k = check_sampling_args(temperature, top_p, top_k, vocab_size)
    return {"prompts": check_prompt_batch(prompt_ids, vocab_size),
            "max_new_tokens": check_max_new_tokens(max_new_tokens),
            "temperature": t, "top_p": p, "top_k": k, "seed": check_seed(seed),
            "stop_ids": check_stop_ids(stop_ids, vocab_size)}


def check_model(model: Any, where: str = "generate()") -> None:
    """A model object with a config (models.LlamaModel), not a name or a path: the runtime does not load files
    (models.from_pretrained does, the CLI's --model takes names and paths)."""
    if model is None or isinstance(model, (str, bytes)) or hasattr(model, "__fspath__") or \
            not hasattr(model, "config"):
        hint = (f"; load it first: ulacache_jax.models.from_pretrained({str(model)!r})"
                if isinstance(model, str) or hasattr(model, "__fspath__") else "")
        raise TypeError(f"{where}: model = {_describe(model)} must be a loaded model (ulacache_jax.models."
                        f"LlamaModel){hint}")


def check_tp_count(tp: Any) -> int:
    """tp: an int >= 1 (tensor-parallel ranks)."""
    if not _is_int(tp) or int(tp) < 1:
        raise ValueError(f"tp = {_describe(tp)} must be an int >= 1 (tensor-parallel ranks)")
    return int(tp)


def check_speculative(spec: Any, config_type: type) -> None:
    """speculative: None or a SpecConfig (`config_type`), not its method's name."""
    if spec is not None and not isinstance(spec, config_type):
        raise TypeError(f"speculative = {_describe(spec)} must be None or a SpecConfig (e.g. "
                        f"SpecConfig('ngram', num_tokens=4))")
