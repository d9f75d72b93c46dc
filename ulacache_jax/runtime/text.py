"""Text at the library's edges: prompts as text or chat messages through a tokenizer, and stop strings.

A prompt is token ids (a sequence of ints), text (a str, encoded with the tokenizer's specials, e.g. BOS) or
chat messages (a list of {"role", "content"} dicts, rendered by the tokenizer's chat template with the
generation prompt). Stop strings end a request once its decoded text holds one; the tokens kept are the fewest
whose text holds it, the text is cut before it.
"""
from __future__ import annotations

from typing import Any, Sequence


def is_messages(prompt: Any) -> bool:
    """A chat: a non-empty list of {"role": ..., "content": ...} dicts."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt))


def is_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or is_messages(prompt)


def encode_prompt(prompt: Any, tokenizer) -> list[int] | Any:
    """Text -> tokenizer.encode(text); chat messages -> tokenizer.apply_chat_template(messages,
    add_generation_prompt=True); token ids are returned as they are. Text without a tokenizer is a ValueError."""
    if not is_text(prompt):
        return prompt
    if tokenizer is None:
        raise ValueError("a text or chat prompt needs a tokenizer (pass tokenizer=...), or give token ids")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template: give text or token ids")
    return list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True))


def check_stop_strings(stop) -> tuple[str, ...]:
    """A str or a sequence of non-empty str -> tuple; a clear error otherwise."""
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop string {s!r} must be a non-empty str")
    return items


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` -> (its index, the string), or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def apply_stop(tokens: list[int], tokenizer, stops: Sequence[str]) -> tuple[str | None, list[int], str | None]:
    """-> (text cut before the first stop string, the tokens up to the one that completed it, the stop string);
    with no stop string in the text: (the whole text, all tokens, None); without a tokenizer: (None, tokens,
    None)."""
    if tokenizer is None:
        return None, tokens, None
    text = tokenizer.decode(tokens)
    hit = find_stop(text, stops) if stops else None
    if hit is None:
        return text, tokens, None
    lo, hi = 1, len(tokens)          # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(tokenizer.decode(tokens[:mid]), stops) is not None:
            hi = mid
        else:
            lo = mid + 1
    return text[:hit[0]], tokens[:lo], hit[1]
