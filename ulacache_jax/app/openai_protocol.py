"""The OpenAI API's request bodies and responses, as plain data: no server, no engine.

Parsing: a /v1/chat/completions or /v1/completions body (a dict from JSON) -> an `ApiRequest` (the prompt as
chat messages, text or token ids; `SamplingParams`; n, streaming and usage options), or an `ApiError` naming the
field and why. The server and `ulacache generate`'s OpenAI batch lines both parse through here, so a body means
the same thing in both.

OpenAI `null` means "the default" for every optional field. Fields OpenAI defines that change nothing here
(`user`, `store`, `metadata`, ...) are accepted; fields that would change the answer and are not implemented
(`tools`, `logit_bias`, `echo`, ...) are refused unless they hold their no-op value, so a client never gets an
answer that silently ignored what it asked for. Unknown fields are refused by name.

SamplingParams fields are passed only where the running engine's SamplingParams has them (the per-request
sampling fields arrive in another change): a field it lacks is refused with "'min_p' is not supported by this
engine" unless the body gives its default, so this module works before and after that change.

Responses: `chat_response` / `completion_response` (whole), `chat_chunk` / `completion_chunk` (server-sent
events), `usage`, `logprobs_*` and `ApiError.body()` (`{"error": {"message", "type", "param", "code"}}`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ulacache_jax.runtime.requests import RequestError, SamplingParams

CHAT, COMPLETION = "chat", "completion"
LINE = "line"                   # a `ulacache generate` JSONL line in the library's own format
MAX_N = 128                     # choices per request: each is an engine request (vLLM has no cap; 128 bounds abuse)
MAX_TOP_LOGPROBS_CHAT = 20      # OpenAI's limits
MAX_LOGPROBS_COMPLETION = 5
MAX_STOP = 4                    # OpenAI: up to 4 stop sequences

# the sampling fields agreed between this module and runtime/requests.SamplingParams (body name -> default);
# a field the engine's SamplingParams lacks is refused unless the body gives this default
CONTRACT_DEFAULTS: dict[str, Any] = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                     "repetition_penalty": 1.0, "logprobs": None, "token_budget": None,
                                     "attention": None}

# fields that change nothing here: accepted with any value
_HARMLESS = {"model", "user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"}
_CONTROL = {"stream", "stream_options", "n", "seed"}
# fields accepted only at their no-op value (None always counts as it): name -> (is no-op, what it would need)
_NOOP = {
    "logit_bias": (lambda v: v == {}, "logit biases"),
    "tools": (lambda v: v == [], "tool calls"),
    "tool_choice": (lambda v: v == "none", "tool calls"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "tool calls"),
    "functions": (lambda v: v == [], "function calls"),
    "function_call": (lambda v: v == "none", "function calls"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text", "structured output"),
    "audio": (lambda v: False, "audio output"),
    "best_of": (lambda v: v == 1, "best_of > 1"),
    "echo": (lambda v: v is False, "echo"),
    "suffix": (lambda v: v == "", "suffix (insertion)"),
}
_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
             "attention", "token_budget", "ignore_eos"}
CHAT_FIELDS = frozenset({"messages"} | _HARMLESS | _CONTROL | set(_NOOP) | _SAMPLING) - {"best_of", "echo", "suffix"}
COMPLETION_FIELDS = frozenset({"prompt"} | _HARMLESS | _CONTROL | set(_NOOP) | _SAMPLING) - {"max_completion_tokens"}


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and an OpenAI-shaped error body. `param` names the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """One parsed body. prompts: one entry per prompt (chat: one list of {"role", "content"} messages;
    completions: text or token ids, a list of them for a batched prompt); each prompt gets `n` choices, each an
    engine request with `samplings[i]` (its seed derived from the body's seed and i, so choices differ)."""
    kind: str                                   # CHAT | COMPLETION
    prompts: tuple                              # [P] messages list | str | list[int]
    sampling: SamplingParams                    # before seeds are derived per choice
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None                 # None = off, else top-k alternatives per token (0 allowed)
    model: str | None = None

    def choice_sampling(self, index: int) -> SamplingParams:
        """SamplingParams of choice `index` (0..n-1 for each prompt): choice 0 keeps the body's seed, so n = 1
        answers as before; the others get a seed derived from it (None stays None: the engine derives one from
        its own seed and the request id, distinct per request)."""
        return choice_sampling(self.sampling, index)


def choice_sampling(sp: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request sampled with `sp`: index 0 is `sp`; the others differ only by a seed derived from
    sp's (derive_seed; None stays None). Shared by the server and the batch file's lines with n > 1."""
    if index == 0 or sp.seed is None:
        return sp
    return dataclasses.replace(sp, seed=derive_seed(int(sp.seed), index))


def derive_seed(seed: int, index: int) -> int:
    """A seed for choice `index` of a request seeded `seed`: distinct per index, in [0, 2**32) (splitmix-style
    mixing, so seeds 1 and 2 do not share choices)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 29)) & (2**32 - 1)


def engine_sampling_fields() -> frozenset[str]:
    """The fields the running engine's SamplingParams has."""
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


# ---- field readers: each raises ApiError naming the field ----------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ApiError(f"'{name}' = {v!r} must be an integer{rng}", param=name)
    return v


def _num(body: dict, name: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    ok = _is_num(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    if not ok:
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        cond = " and ".join(s for s in (lo_s, hi_s) if s)
        raise ApiError(f"'{name}' = {v!r} must be a number{' ' + cond if cond else ''}", param=name)
    return float(v)


def _bool(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' = {v!r} must be true or false", param=name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("'stop' must be a string or a list of strings", param="stop")
    if len(items) > MAX_STOP:
        raise ApiError(f"'stop' holds {len(items)} strings; at most {MAX_STOP}", param="stop")
    if any(not s for s in items):
        raise ApiError("'stop' holds an empty string", param="stop")
    bad = next((s for s in items if _lone_surrogate(s)), None)
    if bad is not None:
        raise ApiError("'stop' holds a lone surrogate (not valid Unicode)", param="stop")
    return tuple(items)


def _lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_fields(body: dict, allowed: frozenset[str]) -> None:
    """Unknown fields and non-default unimplemented ones -> ApiError naming the first (sorted)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unknown field {unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1
                                                           else ""), param=unknown[0])
    for name in sorted(set(body) & set(_NOOP)):
        v = body[name]
        ok, what = _NOOP[name]
        if v is not None and not ok(v):
            raise ApiError(f"'{name}' = {_short(v)}: {what} are not supported by this server", param=name)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


# ---- prompts -------------------------------------------------------------------------------------------------
def parse_messages(v) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content": str}]; content parts of type "text" are joined, other parts
    (images, audio) refused; a null content (an assistant turn with tool calls elsewhere) is ""."""
    if not isinstance(v, list) or not v:
        raise ApiError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                       param="messages")
    out = []
    for j, m in enumerate(v):
        where = f"messages[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"{where} must be an object with a string 'role'", param=where)
        role = m["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(f"{where}.role = {role!r} must be system, developer, user, assistant or tool",
                           param=f"{where}.role")
        c = m.get("content")
        if c is None:
            c = ""
        elif isinstance(c, list):
            parts = []
            for k, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(f"{where}.content[{k}]: only text parts are supported (got {kind!r})",
                                   param=f"{where}.content")
                parts.append(part["text"])
            c = "".join(parts)
        elif not isinstance(c, str):
            raise ApiError(f"{where}.content must be a string, a list of text parts or null",
                           param=f"{where}.content")
        if _lone_surrogate(c):
            raise ApiError(f"{where}.content holds a lone surrogate (not valid Unicode)", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": c})
    return out


def parse_completion_prompt(v) -> tuple:
    """OpenAI's completions prompt: a string, a list of strings, a list of token ids or a list of such lists ->
    a tuple of prompts (str or list[int])."""
    def ids_ok(x):
        return isinstance(x, list) and x and all(_is_int(t) and t >= 0 for t in x)

    if isinstance(v, str):
        prompts: tuple = (v,)
    elif ids_ok(v):
        prompts = (list(v),)
    elif isinstance(v, list) and v and all(isinstance(x, str) or ids_ok(x) for x in v):
        prompts = tuple(x if isinstance(x, str) else list(x) for x in v)
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a non-empty list of token ids (ints >= 0) or "
                       "a list of such lists", param="prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise ApiError("'prompt' holds an empty string", param="prompt")
        if isinstance(p, str) and _lone_surrogate(p):
            raise ApiError("'prompt' holds a lone surrogate (not valid Unicode)", param="prompt")
    return prompts


# ---- the body ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Defaults:
    """What the server (or a batch run) fills in where a body is silent: `base` holds every sampling default
    (max_new_tokens, temperature, ..., stop ids: None = the engine's end-of-turn ids, stop strings), and
    `max_token_budget` caps a request's token_budget (None: no cap known here)."""
    base: SamplingParams = SamplingParams(max_new_tokens=256)
    max_token_budget: int | None = None


def parse_body(body, kind: str, defaults: Defaults = Defaults(), *, vocab_size: int | None = None) -> ApiRequest:
    """A request body -> ApiRequest, or ApiError naming the field (module docstring)."""
    if not isinstance(body, dict):
        raise ApiError(f"the body must be a JSON object, got {type(body).__name__}")
    check_fields(body, CHAT_FIELDS if kind == CHAT else COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' = {_short(model)} must be a string", param="model")
    if kind == CHAT:
        if "messages" not in body or body["messages"] is None:
            raise ApiError("missing field 'messages'", param="messages")
        prompts: tuple = (parse_messages(body["messages"]),)
    else:
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError("missing field 'prompt'", param="prompt")
        prompts = parse_completion_prompt(body["prompt"])
    n = _int(body, "n", 1, MAX_N) or 1
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
        include_usage = bool(_bool(opts, "include_usage"))
    sampling, logprobs = _sampling(body, kind, defaults, vocab_size)
    return ApiRequest(kind, prompts, sampling, n=n, stream=stream, include_usage=include_usage, logprobs=logprobs,
                      model=model)


def _sampling(body: dict, kind: str, defaults: Defaults, vocab_size: int | None):
    """The body's sampling fields -> (SamplingParams, logprobs top-k or None)."""
    mt = _int(body, "max_tokens", 1)
    mct = _int(body, "max_completion_tokens", 1) if kind == CHAT else None
    if mt is not None and mct is not None and mt != mct:
        raise ApiError(f"'max_tokens' = {mt} and 'max_completion_tokens' = {mct} disagree (one setting: give one)",
                       param="max_completion_tokens")
    kw: dict[str, Any] = {"max_new_tokens": mct or mt or defaults.base.max_new_tokens}
    temperature = _num(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        kw["temperature"] = temperature
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        kw["top_p"] = top_p
    top_k = body.get("top_k")
    if top_k is not None:
        # vLLM's -1 and 0 both mean off
        if not _is_int(top_k) or top_k < -1 or (vocab_size is not None and top_k > vocab_size):
            lim = f" <= vocab size {vocab_size}" if vocab_size is not None else ""
            raise ApiError(f"'top_k' = {top_k!r} must be an integer >= -1{lim} (0 or -1 = off)", param="top_k")
        kw["top_k"] = max(0, top_k)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise ApiError(f"'seed' = {seed!r} must be an integer", param="seed")
        kw["seed"] = seed % 2**32        # OpenAI takes any int64; the engine keys on 32 bits
    if body.get("stop") is not None:
        kw["stop"] = _stop(body)
    if _bool(body, "ignore_eos"):
        kw["stop_ids"] = ()
    extra, logprobs = extra_sampling(body, kind, defaults.max_token_budget)
    kw.update(extra)
    sp = dataclasses.replace(defaults.base, **kw)
    if vocab_size is not None:
        try:
            sp.check(vocab_size)
        except RequestError as e:
            msg = str(e)
            name = msg.split(" ", 1)[0]
            raise ApiError(msg, param=name if name in body else None) from None
    return sp, logprobs


def extra_sampling(body: dict, kind: str, max_token_budget: int | None = None) -> tuple[dict[str, Any], int | None]:
    """The contract's sampling fields of a body (min_p, penalties, logprobs, attention, token_budget) -> (those to
    pass to SamplingParams: only fields the engine has, defaults left out; the logprobs top-k or None). A field
    the engine lacks at a value other than its default is refused naming it. kind: CHAT (logprobs: bool +
    top_logprobs), COMPLETION (logprobs: 0..5) or LINE (a `ulacache generate` JSONL line: logprobs 0..20)."""
    extra: dict[str, Any] = {}
    v = _num(body, "min_p", 0.0, 1.0)
    if v is not None:
        extra["min_p"] = v
    for name in ("presence_penalty", "frequency_penalty"):
        v = _num(body, name, -2.0, 2.0)
        if v is not None:
            extra[name] = v
    v = _num(body, "repetition_penalty", 0.0, lo_open=True)
    if v is not None:
        extra["repetition_penalty"] = v
    logprobs = _logprobs(body, kind)
    if logprobs is not None:
        extra["logprobs"] = logprobs
    v = body.get("attention")
    if v is not None:
        if v not in ("sparse", "dense"):
            raise ApiError(f"'attention' = {_short(v)} must be \"sparse\", \"dense\" or null", param="attention")
        extra["attention"] = v
    v = _int(body, "token_budget", 1, max_token_budget)
    if v is not None:
        extra["token_budget"] = v
    have = engine_sampling_fields()
    out = {}
    for name, value in extra.items():
        if name in have:
            out[name] = value
        elif value != CONTRACT_DEFAULTS[name]:
            raise ApiError(f"'{name}' is not supported by this engine", param=name)
    return out, logprobs


def _logprobs(body: dict, kind: str) -> int | None:
    """Chat: logprobs (bool) + top_logprobs (0..20, needs logprobs); completions: logprobs (0..5 or null)."""
    if kind == CHAT:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)
        if top is not None and not on:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if on else None
    if body.get("top_logprobs") is not None:
        raise ApiError("'top_logprobs' is a chat field; completions take 'logprobs': k", param="top_logprobs")
    return _int(body, "logprobs", 0, MAX_LOGPROBS_COMPLETION if kind == COMPLETION else MAX_TOP_LOGPROBS_CHAT)


# ---- responses -----------------------------------------------------------------------------------------------
FINISH = {"stop": "stop", "length": "length", "error": "error"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def logprobs_chat(entries) -> dict:
    """[(token text, logprob, [(alt text, alt logprob), ...])] -> a chat choice's "logprobs" object."""
    return {"content": [{"token": t, "logprob": lp, "bytes": _token_bytes(t),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": _token_bytes(a)} for a, alp in top]}
                        for t, lp, top in entries], "refusal": None}


def logprobs_completion(entries, text_offset: int = 0) -> dict:
    """[(token text, logprob, [(alt text, alt logprob), ...])] -> a completion choice's "logprobs" object; offsets
    count characters from `text_offset` (where this piece starts in the choice's text)."""
    offsets, pos = [], text_offset
    for t, _, _ in entries:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{a: alp for a, alp in top} for _, _, top in entries], "text_offset": offsets}


def chat_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """choices: [{"index", "text", "finish_reason", "logprobs" (or None)}]."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices],
            "usage": use, "system_fingerprint": None}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                         "finish_reason": c["finish_reason"]} for c in choices],
            "usage": use, "system_fingerprint": None}


def chat_chunk(rid: str, created: int, model: str, index: int, *, role: bool = False, content: str | None = None,
               finish_reason: str | None = None, logprobs: dict | None = None, with_usage: bool = False) -> dict:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def completion_chunk(rid: str, created: int, model: str, index: int, *, text: str = "",
                     finish_reason: str | None = None, logprobs: dict | None = None, with_usage: bool = False) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, created: int, model: str, kind: str, use: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the request's usage."""
    return {"id": rid, "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use}
