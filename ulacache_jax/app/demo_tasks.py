"""The demo's tasks for a trained chat model: short chat questions, a question answered from a long real document,
and a passkey hidden in real filler text. Every long text ships with the operating system or with Python (nothing
here is written to pad a prompt): the document is Debian's copy of the Apache License 2.0 when the machine has
one (/usr/share/common-licenses, Debian and Ubuntu), else a chapter of the Python Language Reference that every
CPython carries (`pydoc_data.topics`); the passkey's filler is the Zen of Python (the `this` module's text).

Each task is a chat conversation plus the word a right answer contains, so a reader (and the test) can tell a
right answer from a wrong one at a glance. Lengths are cut in tokens of the model's own tokenizer, so the same
task builder serves SmolLM2 and the byte-level tiny preset.
"""
from __future__ import annotations

import codecs
import dataclasses
import importlib.util
import pathlib
import re
from typing import Sequence

APACHE_LICENSE = pathlib.Path("/usr/share/common-licenses/Apache-2.0")

CHAT_QUESTIONS = (
    ("What is the capital of France?", "Paris"),
    ("Who wrote the play Romeo and Juliet?", "Shakespeare"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
)


@dataclasses.dataclass(frozen=True)
class Document:
    """A long real text and a question whose answer is stated in it."""
    source: str        # what the text is and where it was read from
    text: str
    question: str
    expected: str      # a right answer contains this (case-insensitive)


@dataclasses.dataclass(frozen=True)
class Task:
    """One request of the demo: chat messages for the model's template and the word a right answer contains."""
    kind: str          # "chat", "document" or "passkey"
    title: str         # one line for the table
    messages: tuple    # ({"role": "user", "content": ...},)
    expected: str
    source: str = ""   # where a long text came from ("" for chat)


def _squeeze(text: str) -> str:
    """Strip each line's indentation and collapse blank runs: the license is laid out for a terminal, and its
    leading spaces cost tokens without carrying anything."""
    lines = [ln.strip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def apache_license(path: pathlib.Path = APACHE_LICENSE) -> Document | None:
    """Sections 1-9 of the Apache License 2.0 from Debian's common-licenses (the appendix on applying the
    license is dropped), or None when the file is missing or not the license."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    if "Apache License" not in text or "END OF TERMS AND CONDITIONS" not in text:
        return None
    text = _squeeze(text.split("END OF TERMS AND CONDITIONS")[0])
    return Document(source=f"the Apache License 2.0, sections 1-9 ({path}, shipped by Debian)", text=text,
                    question="According to the license above, what text file must a Derivative Work include "
                             "if the Work includes one?",
                    expected="NOTICE")


def python_reference() -> Document:
    """The Language Reference's chapter on mapping types (dict), as CPython ships it for `help()`."""
    from pydoc_data.topics import topics
    origin = importlib.util.find_spec("pydoc_data.topics").origin
    return Document(source=f"the Python Language Reference, 'Mapping Types - dict' ({origin}, shipped by Python)",
                    text=_squeeze(topics["typesmapping"]),
                    question="According to the text above, which dictionary method removes and returns a "
                             "(key, value) pair in LIFO order?",
                    expected="popitem")


def document() -> Document:
    """The document task's text: the Apache License when the machine ships it, else the Python reference."""
    return apache_license() or python_reference()


def zen_of_python() -> str:
    """The Zen of Python, decoded from the `this` module's source without importing it (importing prints it)."""
    src = pathlib.Path(importlib.util.find_spec("this").origin).read_text(encoding="utf-8")
    encoded = src.split('"""', 2)[1]
    return codecs.decode(encoded, "rot13").strip()


def truncate_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut to at most `max_tokens` tokens of `tokenizer`, at a line break where one is near the end."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens} must be >= 1")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    cut = tokenizer.decode(ids[:max_tokens])
    nl = cut.rfind("\n")
    return cut[:nl] if nl > len(cut) * 0.9 else cut


def document_task(tokenizer, max_tokens: int, doc: Document | None = None) -> Task:
    doc = doc or document()
    text = truncate_tokens(tokenizer, doc.text, max_tokens)
    content = f"Read the text and answer the question.\n\n{text}\n\nQuestion: {doc.question}"
    return Task("document", doc.question, ({"role": "user", "content": content},), doc.expected, doc.source)


def passkey_task(tokenizer, max_tokens: int, passkey: int = 68142, depth: float = 0.5) -> Task:
    """A passkey sentence at `depth` (0 = start, 1 = end) of about `max_tokens` tokens of the Zen of Python,
    repeated: the classic long-context retrieval test, with real prose as the haystack."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth = {depth} must be in [0, 1]")
    zen = zen_of_python()
    n_zen = len(tokenizer.encode(zen + "\n\n", add_special_tokens=False))
    filler = truncate_tokens(tokenizer, "\n\n".join([zen] * (max_tokens // max(n_zen, 1) + 1)), max_tokens)
    lines = filler.split("\n")
    at = round(depth * len(lines))
    needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    haystack = "\n".join(lines[:at] + [needle] + lines[at:])
    content = ("There is a pass key hidden in the text below. Find it and remember it.\n\n"
               f"{haystack}\n\nWhat is the pass key?")
    return Task("passkey", f"pass key at depth {depth:.0%} of the Zen of Python, repeated",
                ({"role": "user", "content": content},), str(passkey),
                f"the Zen of Python ({importlib.util.find_spec('this').origin}, shipped by Python)")


def chat_tasks(questions: Sequence[tuple[str, str]] = CHAT_QUESTIONS) -> list[Task]:
    return [Task("chat", q, ({"role": "user", "content": q},), a) for q, a in questions]


def demo_tasks(tokenizer, *, doc_tokens: int, passkey_tokens: int, num_chat: int = 2) -> list[Task]:
    """The demo's requests: `num_chat` chat questions, the document question over about `doc_tokens` tokens of
    text, and the passkey in about `passkey_tokens` tokens of filler."""
    return [*chat_tasks(CHAT_QUESTIONS[:num_chat]), document_task(tokenizer, doc_tokens),
            passkey_task(tokenizer, passkey_tokens)]


def is_right(task: Task, answer: str) -> bool:
    return task.expected.lower() in answer.lower()
