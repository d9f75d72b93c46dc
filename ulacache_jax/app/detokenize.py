"""Streaming text out of a growing list of token ids: never half a UTF-8 character, never text a stop string
will remove.

A token can end in the middle of a character (byte-level BPE splits multi-byte characters over tokens), and a
tokenizer may render a token differently once the next one is known (leading-space rules). So each delta is
decoded over a window that starts at the last point the text was known to be stable (the method of Hugging
Face's text-generation-inference): `prefix_offset..read_offset` decoded is what was already emitted from that
window, `prefix_offset..len(tokens)` decoded is the candidate, and only a candidate that does not end in U+FFFD
(an incomplete character) moves the window on.

Stop strings: the Engine ends a request at the token that completes a stop string and cuts its text before it.
Text that could still be the start of a stop string (the longest suffix of the text that is a proper prefix of
one) is held back until the next token shows it is not, and nothing is sent from a whole stop string on. The
last delivery can complete a stop string at once, so its tokens go to `finish(final_text, tokens)`, which emits
the rest of the Engine's own final text: the concatenated deltas equal the non-streaming answer.
"""
from __future__ import annotations

from typing import Sequence

from ulacache_jax.runtime.text import find_stop

_INCOMPLETE = "\ufffd"


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (0 without stops)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Detokenizer:
    """One choice's text, as deltas: `push(tokens)` -> text safe to send now; `finish(final_text)` -> the rest.
    tokenizer: has decode(ids) -> str (special tokens skipped)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""            # stable text decoded so far (character-complete)
        self.sent = 0             # characters of self.text already emitted

    def push(self, new_tokens: Sequence[int]) -> str:
        self.tokens.extend(int(t) for t in new_tokens)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE) and full.startswith(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        safe = len(self.text) - held_suffix(self.text, self.stops)
        hit = find_stop(self.text, self.stops) if self.stops else None
        if hit is not None:              # never past a whole stop string (the Engine ends the request there)
            safe = min(safe, hit[0])
        if safe <= self.sent:
            return ""
        out = self.text[self.sent:safe]
        self.sent = safe
        return out

    def finish(self, final_text: str | None, new_tokens: Sequence[int] = ()) -> str:
        """The rest of the answer once the request has ended: `new_tokens` are its last ones (not pushed: the
        Engine's text decides what they add), `final_text` the Engine's whole text (cut before a stop string);
        None (no text known) flushes what decoding the tokens gives."""
        self.tokens.extend(int(t) for t in new_tokens)
        if final_text is None:
            final_text = self.tokenizer.decode(self.tokens)
        emitted = self.text[:self.sent]
        if not final_text.startswith(emitted):
            # the whole decode renders the start differently from the windows (a tokenizer's clean-up rules):
            # what was sent stands, the rest comes from the windows' text
            final_text = self.text if self.text.startswith(emitted) else emitted
        self.sent = len(final_text)
        self.text = final_text
        return final_text[len(emitted):]
