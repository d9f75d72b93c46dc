"""Chat templates: a model's jinja2 template rendered the way transformers renders it.

transformers compiles a template in an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `tojson` filter that keeps non-ASCII characters, and the globals `raise_exception`
and `strftime_now`; it renders with `messages`, `add_generation_prompt`, `tools`, `documents` and the special
token strings (`bos_token`, `eos_token`, ...). Matching that keeps our prompts token-for-token equal to theirs.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Sequence

# A minimal template for tokenizers that ship none (the byte-level tiny presets): ChatML-like plain text.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template that does not compile or that raised (its `raise_exception`), or messages it cannot take."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` must be a non-empty list of dicts, each with a str `role` and a str `content` (other keys,
    such as `tool_calls`, pass through to the template). Returns plain dict copies."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"chat messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ChatTemplateError("chat messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        for key in ("role", "content"):
            if key not in m:
                raise ChatTemplateError(f"chat message {i} has no {key!r}: {dict(m)!r:.120}")
            if not isinstance(m[key], str):
                raise ChatTemplateError(
                    f"chat message {i} {key!r} must be a str, got {type(m[key]).__name__}: {m[key]!r:.80}"
                )
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """A jinja2 Template compiled in transformers' environment (cached by source text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"chat template does not compile: {err}") from err


def render_chat_template(
    source: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> str:
    """Renders `source` for `messages` (validated by `validate_messages`). `special_tokens`: template variables
    such as bos_token / eos_token; `kwargs`: further variables (tools, documents, ...)."""
    import jinja2

    messages = validate_messages(messages)
    template = compile_template(source)
    variables = {"tools": None, "documents": None, **dict(special_tokens or {}), **kwargs}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"chat template raised: {err}") from err
