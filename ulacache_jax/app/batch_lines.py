"""JSONL lines <-> engine requests for batch files: the library's own line format and the OpenAI Batch API's.

`parse_input` turns an input file's lines into Records (prompt ids + SamplingParams) and InputErrors (a line that
fails alone, by line number); `result_line` turns a finished request back into its output line. The formats are
described in app/cli.py's docstring (the `generate` command's input and output); request bodies of OpenAI batch
lines are parsed by app/openai_protocol.py exactly as the server parses them. Kept apart from the CLI so a
server or a script reuses one parser. The engine and validation modules are imported inside the functions that
use them: the CLI imports this module at start-up, before JAX is needed (a fast `--help`).
"""
from __future__ import annotations

import dataclasses
import json
import time

from ulacache_jax.app import jsonl_io

# the fields of a line in the library's format
SAMPLING_FIELDS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_ids")
# the per-request fields shared with the server (openai_protocol.extra_sampling parses them)
CONTRACT_FIELDS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "token_budget",
                   "attention")
# OpenAI body fields that change nothing in a line: model and user any value, stream only false, n only 1
HARMLESS_FIELDS = ("model", "user", "stream", "n")
KNOWN_FIELDS = ("id", "messages", "prompt", "prompt_ids") + SAMPLING_FIELDS + CONTRACT_FIELDS + HARMLESS_FIELDS
# an OpenAI Batch API input line (https://platform.openai.com/docs/guides/batch): its fields and urls
BATCH_FIELDS = ("custom_id", "method", "url", "body")
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
OVERRIDES = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")   # taken as given


@dataclasses.dataclass
class Record:
    line: int
    id: object                 # the line's "id" (the library's format) or "custom_id" (an OpenAI batch line)
    prompt_ids: list[int]
    sampling: object           # engine.SamplingParams
    capped_from: int | None = None
    api_kind: str | None = None     # an OpenAI batch line's endpoint ("chat" / "completion"); None: own format
    logprobs: int | None = None     # top-k alternatives asked per token (None: no logprobs)
    choices: int = 1                # an OpenAI batch body's n: one engine request a choice, one output line

    def choice_sampling(self, j: int):
        """SamplingParams of choice j: choice 0 is `sampling`, the others get seeds derived from its seed, as the
        server derives them (openai_protocol.choice_sampling)."""
        from ulacache_jax.app import openai_protocol
        return openai_protocol.choice_sampling(self.sampling, j)

    def unit_key(self, j: int) -> str:
        """The key of choice j in a checkpoint's request map: the line's id key alone when it has one choice (so
        checkpoints of one-choice lines keep their format), else the id with the choice index."""
        return id_key(self.id) if self.choices == 1 else id_key({"id": self.id, "choice": j})


@dataclasses.dataclass
class InputError:
    line: int
    id: object
    error: str
    batch: bool = False        # the input is an OpenAI batch file: the record is in its output format

    def as_output(self) -> dict:
        if self.batch:
            return {"id": _batch_id("batch_req"), "custom_id": self.id, "response": None,
                    "error": {"code": "invalid_request", "message": self.error}, "line": self.line}
        return {"id": self.id, "line": self.line, "finish_reason": "error", "error": self.error}


def _batch_id(prefix: str) -> str:
    import uuid
    return f"{prefix}_{uuid.uuid4().hex}"


def id_key(x) -> str:
    return json.dumps(x, sort_keys=True)


@dataclasses.dataclass
class ResumeState:
    done_ids: set = dataclasses.field(default_factory=set)       # ids with a result (not an error)
    reported: set = dataclasses.field(default_factory=set)       # (line, id) of lines already reported as errors


def resume_state(records: list[dict]) -> ResumeState:
    """Records of either output format (jsonl_io.record_id / record_ok) -> what --resume skips."""
    st = ResumeState()
    for obj in records:
        if "id" not in obj and not jsonl_io.is_batch_record(obj):
            continue
        rid = jsonl_io.record_id(obj)     # None: a line that was not even JSON (reported by its line number)
        if not jsonl_io.record_ok(obj):
            st.reported.add((obj.get("line"), id_key(rid)))
        else:
            st.done_ids.add(id_key(rid))
    return st


def parse_input(lines, *, tokenizer, vocab_size: int, limit: int, defaults, resume: ResumeState | None = None,
                default_stop: tuple[str, ...] = ()):
    """-> (records, errors, skipped, skipped_errors). `lines`: InputLines (or str, numbered from 1), all in the
    library's format or all OpenAI batch lines (is_batch_input: decided by the file's first JSON object); `defaults`:
    engine.SamplingParams from the command line. With `resume`: ids that already have a result are skipped; a
    line that fails again as already reported in the output is not reported twice (counted in skipped_errors)."""
    from ulacache_jax.runtime.engine import RequestError

    resume = resume or ResumeState()
    lines = list(lines)
    batch = is_batch_input(lines)
    parse = parse_batch_line if batch else parse_line
    records: list[Record] = []
    errors: list[InputError] = []
    seen: dict[str, int] = {}
    skipped = skipped_errors = 0
    for i, item in enumerate(lines, start=1):
        line = item if isinstance(item, jsonl_io.InputLine) else jsonl_io.InputLine(i, item)
        n = line.number
        if line.text is not None and not line.text.strip():
            continue
        rid = None
        try:
            if line.error is not None:
                raise RequestError(line.error, None)
            rec = parse(line.text, n, seen, resume.done_ids, tokenizer=tokenizer, vocab_size=vocab_size,
                        limit=limit, defaults=defaults, default_stop=default_stop)
        except RequestError as e:
            rid = e.args[1] if len(e.args) > 1 else None
            if (n, id_key(rid)) in resume.reported:
                skipped_errors += 1
            else:
                errors.append(InputError(n, rid, e.args[0], batch))
            continue
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return records, errors, skipped, skipped_errors


def _text_field(obj, name, fail) -> str:
    v = obj[name]
    if not isinstance(v, str):
        fail(f"'{name}' must be a string, got {type(v).__name__}")
    bad = jsonl_io.lone_surrogate(v)
    if bad:
        fail(f"'{name}' holds a {bad}")
    return v


def _stop_strings(v, fail) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        fail("'stop' must be a string or a list of strings")
    for s in items:
        if not s:
            fail("'stop' holds an empty string")
        bad = jsonl_io.lone_surrogate(s)
        if bad:
            fail(f"'stop' holds a {bad}")
    return tuple(items)


def _chat_ids(messages, tokenizer, fail) -> list[int]:
    if not isinstance(messages, list) or not messages:
        fail("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            fail(f"messages[{j}] must be an object with string 'role' and 'content'")
        for k in ("role", "content"):
            bad = jsonl_io.lone_surrogate(m[k])
            if bad:
                fail(f"messages[{j}].{k} holds a {bad}")
    if tokenizer is None:
        fail("this model has no tokenizer (no tokenizer.json): give 'prompt_ids'")
    if not hasattr(tokenizer, "apply_chat_template"):
        fail(f"this model's tokenizer ({type(tokenizer).__name__}) has no chat template: give 'prompt' or "
             "'prompt_ids'")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:   # noqa: BLE001 - a template error (jinja2, no template) fails this line only
        fail(f"chat template failed: {type(e).__name__}: {e}")
    return list(ids)


def _json_object(raw: str, fail) -> dict:
    """One input line's JSON object (either format); `fail` on bad JSON or another JSON value."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        fail(f"malformed JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _done_before(rid, n: int, seen: dict, done_ids: set, field: str, fail) -> bool:
    """Records line n's `field` value (id or custom_id) as seen, failing on a duplicate -> whether --resume found
    a result for it already."""
    key = id_key(rid)
    if key in seen:
        fail(f"duplicate {field} (first on line {seen[key]})")
    seen[key] = n
    return key in done_ids


def _encode_prompt(text: str, tokenizer, without: str, fail) -> list[int]:
    """A line's text prompt as token ids; `without` says what to give instead when the model has no tokenizer."""
    if tokenizer is None:
        fail(f"this model has no tokenizer (no tokenizer.json): {without}")
    try:
        return tokenizer.encode(text)
    except Exception as e:   # noqa: BLE001 - a tokenizer failure fails this line only
        fail(f"tokenizer failed on 'prompt': {type(e).__name__}: {e}")


def parse_line(raw: str, n: int, seen: dict, done_ids: set, *, tokenizer, vocab_size: int, limit: int, defaults,
                default_stop: tuple[str, ...] = ()):
    """One input line -> Record, or None if its id already has a result. Raises RequestError(message, id)."""
    from ulacache_jax.runtime import validate
    from ulacache_jax.runtime.engine import RequestError

    rid = None

    def fail(msg):
        raise RequestError(msg, rid)

    obj = _json_object(raw, fail)
    if "custom_id" in obj:
        fail("an OpenAI batch line (custom_id) in a file whose first line is in the library's format: one format "
             "a file")
    rid = obj.get("id")
    if isinstance(rid, str) and jsonl_io.lone_surrogate(rid):
        rid = None
        fail("'id' holds a " + jsonl_io.lone_surrogate(obj["id"]))
    unknown = sorted(set(obj) - set(KNOWN_FIELDS))
    if unknown:
        fail(f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(KNOWN_FIELDS)})")
    obj = {k: v for k, v in obj.items() if v is not None or k == "id"}    # OpenAI's null: the default
    if obj.get("stream", False) is not False:
        fail(f"'stream' = {obj['stream']!r}: a line's result is written whole (false or null only)")
    if obj.get("n", 1) != 1 or isinstance(obj.get("n"), bool):
        fail(f"'n' = {obj['n']!r}: one answer a line (1 or null only; repeat the line with other ids for more)")
    from ulacache_jax.app import openai_protocol
    try:
        extra, logprobs = openai_protocol.extra_sampling(obj, openai_protocol.LINE)
    except openai_protocol.ApiError as e:
        fail(e.message)
    if "id" not in obj:
        fail("missing field 'id'")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        fail(f"id must be a string or an int, got {json.dumps(rid)}")
    if _done_before(rid, n, seen, done_ids, "id", fail):
        return None
    given = [k for k in ("messages", "prompt", "prompt_ids") if k in obj]
    if len(given) != 1:
        fail("give exactly one of 'messages' (chat), 'prompt' (text) and 'prompt_ids' (token ids)"
             + (f"; got {', '.join(given)}" if given else ""))
    if "messages" in obj:
        ids, name = _chat_ids(obj["messages"], tokenizer, fail), "prompt (the chat template's tokens)"
    elif "prompt" in obj:
        text = _text_field(obj, "prompt", fail)
        if not text.strip():
            fail("empty prompt" + (" (only whitespace)" if text else ""))
        ids, name = _encode_prompt(text, tokenizer, "give 'prompt_ids'", fail), "prompt (as tokens)"
    else:
        ids, name = obj["prompt_ids"], "prompt_ids"
        if not isinstance(ids, list):      # JSON: a list, not a string or an object (which would iterate)
            fail("'prompt_ids' must be a list of ints")
    try:                                   # the prompt check of generate() and the Engine (runtime/validate.py)
        ids = validate.check_prompt(ids, vocab_size, name=name)
    except TypeError as e:
        fail(f"'{name}' must be a list of ints: {e}" if name == "prompt_ids" else str(e))
    except ValueError as e:
        fail(str(e))
    over = {k: obj[k] for k in OVERRIDES if k in obj}
    if "max_tokens" in obj:
        if "max_new_tokens" in obj and obj["max_new_tokens"] != obj["max_tokens"]:
            fail(f"max_tokens = {obj['max_tokens']!r} and max_new_tokens = {obj['max_new_tokens']!r} disagree "
                 "(they are one setting: give one)")
        over["max_new_tokens"] = obj["max_tokens"]
    if "stop_ids" in obj:
        if not isinstance(obj["stop_ids"], list):
            fail("'stop_ids' must be a list of ints")
        over["stop_ids"] = tuple(obj["stop_ids"])
    stop = _stop_strings(obj["stop"], fail) if "stop" in obj else default_stop
    sp = dataclasses.replace(defaults, stop=stop, **over, **extra)   # the Engine ends a request at its stop strings
    return _record(n, rid, ids, sp, vocab_size=vocab_size, limit=limit, fail=fail, logprobs=logprobs)


def _record(n: int, rid, ids: list[int], sp, *, vocab_size: int, limit: int, fail, api_kind: str | None = None,
            logprobs: int | None = None, choices: int = 1) -> Record:
    """A parsed line's Record: its sampling checked, a prompt past the context refused, max_new_tokens capped to
    the room left."""
    try:
        sp.check(vocab_size)
    except ValueError as e:
        fail(str(e))
    if len(ids) + 1 > limit:
        fail(f"prompt of {len(ids)} tokens is longer than the context limit of {limit} tokens (with room for one "
             "generated token; --max-context)")
    rec = Record(n, rid, [int(t) for t in ids], sp, api_kind=api_kind, logprobs=logprobs, choices=choices)
    if len(ids) + sp.max_new_tokens > limit:
        rec.capped_from = sp.max_new_tokens
        rec.sampling = dataclasses.replace(sp, max_new_tokens=limit - len(ids))
    return rec


def is_batch_input(lines) -> bool:
    """Whether an input file is in the OpenAI Batch API format: its first line that is a JSON object has a
    "custom_id" (the library's own lines have an "id")."""
    for item in lines:
        text = item.text if isinstance(item, jsonl_io.InputLine) else item
        if text is None or not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return "custom_id" in obj
    return False


def parse_batch_line(raw: str, n: int, seen: dict, done_ids: set, *, tokenizer, vocab_size: int, limit: int,
                      defaults, default_stop: tuple[str, ...] = ()):
    """One OpenAI batch line ({"custom_id", "method": "POST", "url", "body"}) -> Record, or None if its custom_id
    already has a result. The body is parsed as the server parses it (openai_protocol.parse_body; its model name
    is not checked: a file written for another server runs unchanged); the command line's sampling options are
    the defaults where the body is silent. Raises RequestError(message, custom_id)."""
    from ulacache_jax.app import openai_protocol as proto
    from ulacache_jax.runtime import validate
    from ulacache_jax.runtime.engine import RequestError

    rid = None

    def fail(msg):
        raise RequestError(msg, rid)

    obj = _json_object(raw, fail)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or jsonl_io.lone_surrogate(cid):
        fail(f"'custom_id' = {json.dumps(cid) if isinstance(cid, (str, int, type(None))) else '...'} must be a "
             "non-empty string (every line of an OpenAI batch file has one)")
    rid = cid
    unknown = sorted(set(obj) - set(BATCH_FIELDS))
    if unknown:
        fail(f"unknown field(s) {', '.join(map(repr, unknown))} (a batch line has {', '.join(BATCH_FIELDS)})")
    if obj.get("method") != "POST":
        fail(f"'method' = {json.dumps(obj.get('method'))} must be \"POST\"")
    kind = BATCH_URLS.get(obj.get("url"))
    if kind is None:
        fail(f"'url' = {json.dumps(obj.get('url'))} must be one of {', '.join(BATCH_URLS)}")
    if _done_before(rid, n, seen, done_ids, "custom_id", fail):
        return None
    base = dataclasses.replace(defaults, stop=default_stop)
    try:
        api = proto.parse_body(obj.get("body"), kind, proto.Defaults(base=base), vocab_size=vocab_size)
    except proto.ApiError as e:
        fail(f"body: {e.message}")
    if len(api.prompts) != 1:
        fail(f"body: 'prompt' holds {len(api.prompts)} prompts: one a line in a batch file")
    if api.stream:
        fail("body: 'stream' must be false in a batch file")
    prompt = api.prompts[0]
    if kind == "chat":
        ids, name = _chat_ids(prompt, tokenizer, fail), "prompt (the chat template's tokens)"
    elif isinstance(prompt, str):
        ids, name = _encode_prompt(prompt, tokenizer, "give 'prompt' as token ids", fail), "prompt (as tokens)"
    else:
        ids, name = prompt, "prompt"
    try:
        ids = validate.check_prompt(ids, vocab_size, name=name)
    except (TypeError, ValueError) as e:
        fail(str(e))
    return _record(n, rid, ids, api.sampling, vocab_size=vocab_size, limit=limit, fail=fail, api_kind=kind,
                   logprobs=api.logprobs,
                   choices=api.n)


def result_line(rec: Record, reqs: list, *, model: str = "", tokenizer=None) -> dict:
    """A finished line's output line from its requests (one a choice, in choice order; the own format has one): the
    Engine has cut their tokens and text at a stop string (stop_reason). model, tokenizer: an OpenAI batch line's
    answer names the model and spells its logprobs' tokens."""
    if len(reqs) != rec.choices:
        raise ValueError(f"line {rec.line}: {len(reqs)} finished requests for its {rec.choices} choices")
    if rec.api_kind is not None:
        return _batch_result_line(rec, reqs, model, tokenizer)
    req = reqs[0]
    if req.finish_reason == "error":
        return {"id": rec.id, "line": rec.line, "finish_reason": "error", "error": req.error}
    out = {"id": rec.id, "line": rec.line, "text": req.text, "token_ids": list(req.tokens),
           "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
           "completion_tokens": len(req.tokens)}
    if req.stop_reason is not None:
        out["stop_reason"] = req.stop_reason
    if req.sampling.logprobs is not None:
        out["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob, "top": [list(a) for a in t.top]}
                           for t in req.logprobs]
    if rec.capped_from is not None or req.capped:
        out["max_new_tokens_capped_to"] = req.max_new_tokens
    return out


def _batch_result_line(rec: Record, reqs: list, model: str, tokenizer) -> dict:
    """The finished choices of an OpenAI batch line -> its Batch API output line: {"id", "custom_id", "response":
    {"status_code", "request_id", "body"}, "error"}; the body is what the server answers (a chat.completion or
    text_completion with a choice per request and usage counting the prompt once, or, if any choice failed, the
    error object: status 400 for a request the engine refused before running it, 500 for one that failed while
    running). "line" (and the run's "settings") are the library's additions, for --resume."""
    from ulacache_jax.app import openai_protocol as proto
    rid = _batch_id("req")
    failed = [r for r in reqs if r.finish_reason == "error"]
    if failed:
        req = failed[0]
        status = 500 if req.t_admitted is not None else 400
        what = req.error or "the request failed"
        if len(reqs) > 1:
            what = f"choice {reqs.index(req)} of {len(reqs)}: {what}"
        body = proto.ApiError(what, status=status,
                              type="server_error" if status == 500 else "invalid_request_error").body()
    else:
        choices = []
        for j, req in enumerate(reqs):
            lp = None
            if rec.logprobs is not None:
                entries = [(_token_text(tokenizer, t.token_id), float(t.logprob),
                            [(_token_text(tokenizer, a), float(alp)) for a, alp in t.top])
                           for t in getattr(req, "logprobs", ())]
                lp = proto.logprobs_chat(entries) if rec.api_kind == "chat" else proto.logprobs_completion(entries)
            choices.append({"index": j, "text": req.text or "", "finish_reason": req.finish_reason, "logprobs": lp})
        shaped = proto.chat_response if rec.api_kind == "chat" else proto.completion_response
        body = shaped(("chatcmpl-" if rec.api_kind == "chat" else "cmpl-") + rid.removeprefix("req_"),
                      int(time.time()), model, choices,
                      proto.usage(len(reqs[0].prompt_ids), sum(len(r.tokens) for r in reqs)))
        status = 200
    return {"id": _batch_id("batch_req"), "custom_id": rec.id,
            "response": {"status_code": status, "request_id": rid, "body": body}, "error": None, "line": rec.line}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([int(token_id)]) if tokenizer is not None else str(int(token_id))
