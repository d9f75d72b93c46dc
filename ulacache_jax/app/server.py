"""`ulacache serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over one Engine.

Threads: uvicorn's event loop answers HTTP; ONE engine thread (`EngineWorker`) builds the model and the Engine,
runs a warm-up request (so the prefill and decode programs are compiled before /health says ready), then steps
the Engine while it has work and sleeps on its inbox while it has none. Requests cross into the engine thread by
a thread-safe queue (add / abort commands, FIFO, so an abort never overtakes its add); tokens come back to the
event loop by `loop.call_soon_threadsafe`, one `Update` per engine step and request.

Each choice of a request (n choices per prompt) is one engine request. A client that disconnects, streaming or
not, aborts its choices (Engine.abort on the engine thread: their slots and host pages are freed at once). The
queue is bounded: at most max_seqs running + max_queue waiting engine requests; past that a request gets 429.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health (200 once ready, 503
while loading or after the engine failed to load), GET /metrics (Prometheus text; app/metrics.py).
Request bodies are parsed by app/openai_protocol.py (the same parser as `ulacache generate`'s OpenAI batch
lines); a body the parser refuses gets the OpenAI error shape with the field named, and never reaches the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable

from ulacache_jax.app import openai_protocol as proto
from ulacache_jax.app.detokenize import Detokenizer
from ulacache_jax.app.metrics import CONTENT_TYPE, CacheSnapshot, ServingMetrics

# the timeline the engine keeps per step is trimmed past this many entries: a server runs for days, and the
# metrics have read every entry by then (the run report, which reads them all, is for batch runs)
_TIMELINE_KEEP = 256


WARMUPS = ("full", "basic", "off")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the server needs besides the engine: names, limits, defaults, and the warm-up before /health says
    ready: "full" compiles every decode-chunk length (the powers of two up to page_size: a request's last chunk
    runs only the steps it needs), "basic" one short prompt and one whole chunk, "off" nothing (tests)."""
    model_name: str
    max_queue: int = 256
    defaults: proto.Defaults = proto.Defaults()
    warmup: str = "full"


@dataclasses.dataclass(frozen=True)
class Built:
    """What the engine thread's build function returns: the Engine, its tokenizer (or None) and the context
    limit a prompt + its first token must fit."""
    engine: Any
    tokenizer: Any
    max_context: int


@dataclasses.dataclass(frozen=True)
class Update:
    """One engine step's news for one choice: new tokens (and their logprobs where asked), and at the end why it
    finished, its final text (cut before a stop string) and whether it was ever admitted (an error before that
    is the request's fault: 400; after it, the server's: 500)."""
    tokens: tuple[int, ...]
    logprobs: tuple = ()
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None
    admitted: bool = True
    completion_tokens: int = 0


class Choice:
    """One engine request seen from the event loop: its updates arrive on the request's queue as (index, Update)."""

    def __init__(self, index: int, prompt_ids: list[int], sampling, sink: asyncio.Queue, on_done: Callable):
        self.index = index
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.sink = sink
        self.on_done = on_done
        self.finished = False
        self.t_submit = time.perf_counter()
        self.rid: int | None = None              # the engine's request id (set on the engine thread)
        self.aborted = False
        self.t_last: float | None = None         # its last delivery (engine thread: metrics)

    def push(self, upd: Update) -> None:        # on the event loop
        if self.finished:
            return
        if upd.finished:
            self.finished = True
            self.on_done()
        self.sink.put_nowait((self.index, upd))


class EngineWorker:
    """The engine thread: builds the Engine (build() -> Built), warms it up, then serves the inbox."""

    def __init__(self, build: Callable[[], Built], metrics: ServingMetrics, *, warmup: str = "full",
                 on_fatal: Callable[[str], None] | None = None, expected: tuple[type, ...] = ()):
        self.build = build
        self.expected = expected                 # build errors reported by their message alone (bad options)
        self.failed_expected = False
        self.metrics = metrics
        self.warmup = warmup
        self.on_fatal = on_fatal
        self.inbox: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.failed: str | None = None
        self.built: Built | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.active: dict[int, Choice] = {}
        self.thread = threading.Thread(target=self._main, name="ulacache-engine", daemon=True)
        self._seen = 0                           # timeline entries already counted into the snapshot
        self._snap = CacheSnapshot()
        self._written_pages = 0                  # pages completed by finished requests, per (layer, group)

    # ---- the event loop's side ---------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def submit(self, choice: Choice) -> None:
        self.inbox.put(("add", choice))

    def abort(self, choice: Choice) -> None:
        choice.aborted = True
        self.inbox.put(("abort", choice))

    def stop(self) -> None:
        self.inbox.put(("stop", None))

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.built = self.build()
            if self.warmup != "off":
                self._warm_up(full=self.warmup == "full")
            self._update_snapshot()
        except BaseException as e:   # noqa: BLE001 - a failed load is reported by /health and ends the server
            self.failed_expected = isinstance(e, self.expected)
            self.failed = str(e) if self.failed_expected else f"{type(e).__name__}: {e}"
            if not self.failed_expected:
                traceback.print_exc()
            if self.on_fatal is not None:
                self.on_fatal(self.failed)
            return
        self.metrics.ready.set(1)
        self.ready.set()
        try:
            self._serve()
        except BaseException as e:   # noqa: BLE001 - the loop itself failed: fail every request, stop serving
            self.failed = f"engine thread failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            for choice in list(self.active.values()):
                self._send(choice, Update((), finished=True, finish_reason="error", error=self.failed))
            self.ready.clear()
            if self.on_fatal is not None:
                self.on_fatal(self.failed)

    def _warm_up(self, full: bool) -> None:
        """Requests that compile what serving runs before any client pays for it: a short prompt's prefill and
        the whole decode chunk (page_size steps); with `full`, one request per shorter chunk length too (a
        request's last chunk runs the next power of two >= the tokens it still needs), one at a time, since
        requests decoding together run one chunk length."""
        from ulacache_jax.runtime.requests import SamplingParams
        eng = self.built.engine
        tok = self.built.tokenizer
        prompt = list(tok.encode("Hello")) if tok is not None else [1, 2, 3, 4]
        room = self.built.max_context - len(prompt)
        lengths = [eng.config.page_size]
        while full and lengths[-1] > 1:
            lengths.append(lengths[-1] // 2)
        for steps in lengths:
            rid = eng.add_request(prompt, SamplingParams(max_new_tokens=max(1, min(steps + 1, room)), stop_ids=()))
            while not eng.get(rid).finished:
                eng.step()
            req = eng.pop(rid)
            if req.finish_reason == "error":
                raise RuntimeError(f"the warm-up request failed: {req.error}")

    def _serve(self) -> None:
        eng = self.built.engine
        while True:
            cmds = [self.inbox.get()] if not eng.has_unfinished() else []
            while True:
                try:
                    cmds.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, choice in cmds:
                if kind == "stop":
                    return
                if kind == "add":
                    if choice.aborted:      # gone before it reached the engine
                        self._send(choice, Update((), finished=True, finish_reason="stop"))
                        continue
                    choice.rid = eng.add_request(choice.prompt_ids, choice.sampling)
                    self.active[choice.rid] = choice
                elif kind == "abort" and choice.rid is not None:
                    req = eng.requests.get(choice.rid)
                    if req is not None and not req.finished:
                        eng.abort(choice.rid)
            if not eng.has_unfinished():
                continue
            try:
                outs = eng.step()
            except Exception as e:   # noqa: BLE001 - the engine finished the requests it lost; report them
                print(f"ulacache serve: engine step failed: {type(e).__name__}: {e}", file=sys.stderr)
                outs = []
                for rid in list(self.active):
                    req = eng.requests.get(rid)
                    if req is not None and req.finished:
                        self._dispatch_end(rid)
            for ev in outs:
                self._dispatch(ev)
            self._update_snapshot()

    def _dispatch(self, ev) -> None:
        eng = self.built.engine
        choice = self.active.get(ev.request_id)
        req = eng.requests.get(ev.request_id)
        if choice is None or req is None:
            return
        now = time.perf_counter()
        m = self.metrics
        if ev.new_tokens:
            m.generated_tokens.inc(len(ev.new_tokens))
            if choice.t_last is None:
                m.ttft.observe(now - choice.t_submit)
                m.prompt_tokens.inc(len(req.prompt_ids))
            else:
                gap = (now - choice.t_last) / len(ev.new_tokens)
                for _ in ev.new_tokens:
                    m.itl.observe(gap)
            choice.t_last = now
        if ev.finished:
            self._dispatch_end(ev.request_id, ev)
        else:
            self._send(choice, Update(tuple(ev.new_tokens), tuple(getattr(ev, "new_logprobs", ()) or ())))

    def _dispatch_end(self, rid: int, ev=None) -> None:
        eng = self.built.engine
        choice = self.active.pop(rid)
        req = eng.pop(rid)
        reason = req.finish_reason or "error"
        self.metrics.requests.labels("abort" if choice.aborted else reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - choice.t_submit)
        if reason != "error":
            c = eng.config
            self._written_pages += c.num_layers * c.num_groups * (
                (len(req.prompt_ids) + max(len(req.tokens) - 1, 0)) // c.page_size)
        toks = tuple(ev.new_tokens) if ev is not None else ()
        lps = tuple(getattr(ev, "new_logprobs", ()) or ()) if ev is not None else ()
        self._send(choice, Update(toks, lps, finished=True, finish_reason=reason, error=req.error,
                                  text=req.text, admitted=req.t_admitted is not None,
                                  completion_tokens=len(req.tokens)))

    def _send(self, choice: Choice, upd: Update) -> None:
        self.loop.call_soon_threadsafe(choice.push, upd)

    def _update_snapshot(self) -> None:
        """The cache figures after a step (metrics.CacheSnapshot), from the timeline entries not yet counted."""
        eng = self.built.engine
        c = eng.config
        s = dataclasses.replace(self._snap)
        tl = eng.timeline
        for rec in tl[self._seen:]:
            s.hits += rec.hits
            s.misses += rec.misses
            s.fetched_pages += rec.fetched
            s.overflow_reads += rec.overflow
            s.decode_steps += rec.decode_steps
        if len(tl) > _TIMELINE_KEEP:
            del tl[:len(tl) - _TIMELINE_KEEP // 2]
        self._seen = len(tl)
        sparse = eng.gen.backend.host_tier
        prefix = eng.prefix_stats()
        s.prefix_hit_tokens = int(prefix.hit_tokens)
        if sparse:
            s.h2d_bytes = s.fetched_pages * c.page_bytes * 2
            attached = c.num_layers * c.num_groups * (s.prefix_hit_tokens // c.page_size)
            s.d2h_bytes = max(s.d2h_bytes, (self._written_pages - attached) * c.page_bytes * 2)
        occ = eng.occupancy()
        for k in ("slots_used", "slots_total", "host_pages_used", "host_pages_total", "host_pages_of_requests",
                  "hbm_frames_used", "hbm_frames_total", "spec_proposed", "spec_accepted"):
            setattr(s, k, occ[k])
        self._snap = s
        self.metrics.set_snapshot(s)
        self.metrics.running.set(eng.num_running)
        self.metrics.queued.set(eng.num_queued)


# ---- HTTP ------------------------------------------------------------------------------------------------------
class Server:
    """The Starlette app over an EngineWorker. `outstanding` (event loop only) counts engine requests accepted
    and not finished: at most max_seqs + max_queue."""

    def __init__(self, config: ServeConfig, worker: EngineWorker, metrics: ServingMetrics):
        self.config = config
        self.worker = worker
        self.metrics = metrics
        self.outstanding = 0
        self.created = int(time.time())

    # helpers
    def _error(self, e: proto.ApiError):
        from starlette.responses import JSONResponse
        self.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    def _unavailable(self) -> proto.ApiError:
        if self.worker.failed:
            return proto.ApiError(f"the engine failed: {self.worker.failed}", status=503, type="server_error",
                                  code="engine_failed")
        return proto.ApiError("the model is loading (the serving programs are being compiled); retry shortly",
                              status=503, type="server_error", code="loading")

    def _encode(self, api: proto.ApiRequest, prompt) -> list[int]:
        """A parsed prompt -> token ids, within the vocabulary and the context (400 naming the field)."""
        built = self.worker.built
        tok = built.tokenizer
        field = "messages" if api.kind == proto.CHAT else "prompt"
        if isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], dict)):
            ids = list(prompt)
        else:
            if tok is None:
                raise proto.ApiError(f"this model has no tokenizer: give '{field}' as token ids", param=field)
            try:
                ids = (list(tok.apply_chat_template(prompt, add_generation_prompt=True)) if api.kind == proto.CHAT
                       else list(tok.encode(prompt)))
            except Exception as e:   # noqa: BLE001 - a template or tokenizer failure is this request's
                raise proto.ApiError(f"cannot tokenize '{field}': {type(e).__name__}: {e}", param=field) from None
        vocab = built.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise proto.ApiError(f"token id {bad} in '{field}' is outside the vocabulary [0, {vocab})", param=field)
        if not ids:
            raise proto.ApiError(f"'{field}' is empty", param=field)
        limit = built.max_context
        if len(ids) + 1 > limit:
            raise proto.ApiError(f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                                 "tokens (with room for one generated token)", param=field,
                                 code="context_length_exceeded")
        return ids

    def _accept(self, api: proto.ApiRequest, prompts: list[list[int]]):
        """Queue the request's choices (prompts: its prompts' token ids) -> (choices, sink), or ApiError (429)."""
        cfg = self.config
        k = len(prompts) * api.n
        eng = self.worker.built.engine
        cap = eng.config.max_seqs + cfg.max_queue
        if self.outstanding + k > cap:
            raise proto.ApiError(f"the server's queue is full ({self.outstanding} requests running or waiting, at "
                                 f"most {cap} = max_seqs {eng.config.max_seqs} + max_queue {cfg.max_queue}); retry "
                                 "later", status=429, type="rate_limit_error", code="queue_full")
        sink: asyncio.Queue = asyncio.Queue()
        choices = []

        def done():
            self.outstanding -= 1

        for p, ids in enumerate(prompts):
            for j in range(api.n):
                idx = p * api.n + j
                choices.append(Choice(idx, ids, api.choice_sampling(j), sink, done))
        self.outstanding += k
        for c in choices:
            self.worker.submit(c)
        return choices, sink

    def _abort_unfinished(self, choices) -> None:
        for c in choices:
            if not c.finished and not c.aborted:
                self.worker.abort(c)

    def _logprob_entries(self, lps) -> list:
        tok = self.worker.built.tokenizer

        def text(t):
            return tok.decode([int(t)]) if tok is not None else str(int(t))

        return [(text(lp.token_id), float(lp.logprob), [(text(a), float(alp)) for a, alp in lp.top]) for lp in lps]

    # endpoints
    async def health(self, request):
        from starlette.responses import JSONResponse
        if self.worker.ready.is_set():
            return JSONResponse({"status": "ok"})
        return self._error(self._unavailable())

    async def models(self, request):
        from starlette.responses import JSONResponse
        card = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "ulacache"}
        if self.worker.built is not None:
            card["max_model_len"] = self.worker.built.max_context
        if "model" in request.path_params:
            if request.path_params["model"] != self.config.model_name:
                return self._error(proto.ApiError(f"the model {request.path_params['model']!r} does not exist",
                                                  status=404, param="model", code="model_not_found"))
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_endpoint(self, request):
        from starlette.responses import Response
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def chat(self, request):
        return await self._completions(request, proto.CHAT)

    async def completions(self, request):
        return await self._completions(request, proto.COMPLETION)

    async def _completions(self, request, kind: str):
        from starlette.responses import JSONResponse, StreamingResponse
        try:
            if not self.worker.ready.is_set():
                raise self._unavailable()
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise proto.ApiError(f"the body is not valid JSON ({e})") from None
            api = proto.parse_body(body, kind, self.config.defaults, vocab_size=self.worker.built.engine.vocab_size)
            if api.model is not None and api.model != self.config.model_name:
                raise proto.ApiError(f"the model {api.model!r} does not exist; this server serves "
                                     f"{self.config.model_name!r}", status=404, param="model", code="model_not_found")
            # tokenizing (a chat template, a long document) off the event loop, so other streams keep flowing
            prompts = await asyncio.to_thread(lambda: [self._encode(api, p) for p in api.prompts])
            rid = ("chatcmpl-" if kind == proto.CHAT else "cmpl-") + uuid.uuid4().hex
            choices, sink = self._accept(api, prompts)
            prompt_lens = [len(ids) for ids in prompts]
        except proto.ApiError as e:
            return self._error(e)
        created = int(time.time())
        if api.stream:
            return StreamingResponse(self._sse(api, rid, created, choices, sink, prompt_lens),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(api, choices, sink))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():
                self._abort_unfinished(choices)
                collect.cancel()
            gone.cancel()
        if not collect.done() or collect.cancelled():
            from starlette.responses import Response
            return Response(status_code=499)      # nobody is listening
        results = collect.result()
        failed = [r for r in results if r["finish_reason"] == "error"]
        if failed:
            admitted = all(r["admitted"] for r in failed)
            return self._error(proto.ApiError(failed[0]["error"] or "the request failed",
                                              status=500 if admitted else 400,
                                              type="server_error" if admitted else "invalid_request_error"))
        use = proto.usage(sum(prompt_lens), sum(r["completion_tokens"] for r in results))
        shaped = proto.chat_response if kind == proto.CHAT else proto.completion_response
        model = self.config.model_name
        return JSONResponse(shaped(rid, created, model, results, use))

    async def _collect(self, api: proto.ApiRequest, choices, sink) -> list[dict]:
        """Every choice's updates until all finish -> [{"index", "text", "finish_reason", "logprobs", ...}]."""
        toks: dict[int, list] = {c.index: [] for c in choices}
        lps: dict[int, list] = {c.index: [] for c in choices}
        final: dict[int, Update] = {}
        while len(final) < len(choices):
            idx, upd = await sink.get()
            toks[idx].extend(upd.tokens)
            lps[idx].extend(upd.logprobs)
            if upd.finished:
                final[idx] = upd
        out = []
        for c in choices:
            u = final[c.index]
            text = u.text if u.text is not None else _ids_text(toks[c.index])
            lp = None
            if api.logprobs is not None and u.finish_reason != "error":
                entries = self._logprob_entries(lps[c.index])
                lp = proto.logprobs_chat(entries) if api.kind == proto.CHAT else proto.logprobs_completion(entries)
            out.append({"index": c.index, "text": text, "finish_reason": u.finish_reason, "logprobs": lp,
                        "error": u.error, "admitted": u.admitted, "completion_tokens": u.completion_tokens})
        return out

    async def _sse(self, api: proto.ApiRequest, rid: str, created: int, choices, sink, prompt_lens):
        """Server-sent events: one chunk per choice and engine step with new text, a last chunk per choice with
        its finish_reason, the usage chunk when asked, then [DONE]. Leaving early (the client went away) aborts
        the choices still running."""
        model = self.config.model_name
        chat = api.kind == proto.CHAT
        tok = self.worker.built.tokenizer
        detok = {c.index: Detokenizer(tok, c.sampling.stop) if tok is not None else None for c in choices}
        offsets = {c.index: 0 for c in choices}
        completion_tokens_of = {c.index: 0 for c in choices}
        completion_tokens = 0
        left = len(choices)
        usage_field = api.include_usage
        try:
            if chat:
                for c in choices:
                    yield _event(proto.chat_chunk(rid, created, model, c.index, role=True, content="",
                                                  with_usage=usage_field))
            while left:
                idx, upd = await sink.get()
                d = detok[idx]
                if d is not None:
                    # the last update's tokens may complete a stop string: the Engine's final text says what stays
                    text = (d.finish(upd.text, upd.tokens) if upd.finished and upd.finish_reason != "error"
                            else d.push(upd.tokens))
                else:
                    text = _ids_text(upd.tokens, lead=completion_tokens_of[idx] > 0)
                completion_tokens_of[idx] += len(upd.tokens)
                lp = None
                if api.logprobs is not None and upd.logprobs:
                    entries = self._logprob_entries(upd.logprobs)
                    lp = (proto.logprobs_chat(entries) if chat
                          else proto.logprobs_completion(entries, offsets[idx]))
                offsets[idx] += len(text)
                if text or lp is not None:
                    yield _event(proto.chat_chunk(rid, created, model, idx, content=text, logprobs=lp,
                                                  with_usage=usage_field) if chat
                                 else proto.completion_chunk(rid, created, model, idx, text=text, logprobs=lp,
                                                             with_usage=usage_field))
                if upd.finished:
                    left -= 1
                    completion_tokens += upd.completion_tokens
                    if upd.finish_reason == "error":
                        err = proto.ApiError(upd.error or "the request failed",
                                             status=500 if upd.admitted else 400,
                                             type="server_error" if upd.admitted else "invalid_request_error")
                        yield _event(err.body())
                    yield _event(proto.chat_chunk(rid, created, model, idx, finish_reason=upd.finish_reason,
                                                  with_usage=usage_field) if chat
                                 else proto.completion_chunk(rid, created, model, idx,
                                                             finish_reason=upd.finish_reason,
                                                             with_usage=usage_field))
            if usage_field:
                yield _event(proto.usage_chunk(rid, created, model, api.kind,
                                               proto.usage(sum(prompt_lens), completion_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished(choices)

    def app(self):
        from contextlib import asynccontextmanager

        from starlette.applications import Starlette
        from starlette.routing import Route

        @asynccontextmanager
        async def lifespan(app):
            self.worker.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                self.worker.stop()

        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.models, methods=["GET"]),
                  Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"])]
        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
            404: self._not_found, 405: self._not_allowed, 500: self._internal})

    async def _not_found(self, request, exc):
        return self._error(proto.ApiError(f"no route {request.url.path}", status=404, code="not_found"))

    async def _not_allowed(self, request, exc):
        return self._error(proto.ApiError(f"{request.method} is not allowed on {request.url.path}", status=405,
                                          code="method_not_allowed"))

    async def _internal(self, request, exc):
        return self._error(proto.ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                          type="server_error"))


def _ids_text(ids, lead: bool = False) -> str:
    """A model without a tokenizer answers its token ids as text, space-separated (lead: a space before, for a
    stream's later pieces)."""
    text = " ".join(str(int(t)) for t in ids)
    return (" " + text) if lead and text else text


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body has been read, so the next ASGI message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def serve(build: Callable[[], Built], config: ServeConfig, *, host: str, port: int, log_level: str = "info",
          expected: tuple[type, ...] = ()) -> int:
    """Run the server until SIGINT / SIGTERM (uvicorn handles both) -> exit code: 0; 2 if the build raised one of
    `expected` (bad options: its message is printed, no traceback); 1 if the engine failed otherwise."""
    import uvicorn

    metrics = ServingMetrics()
    box: dict = {}

    def fatal(msg: str) -> None:
        print(f"ulacache serve: {msg}; stopping", file=sys.stderr)
        srv = box.get("server")
        if srv is not None:
            srv.should_exit = True

    worker = EngineWorker(build, metrics, warmup=config.warmup, on_fatal=fatal, expected=expected)
    server = Server(config, worker, metrics)
    uv = uvicorn.Server(uvicorn.Config(server.app(), host=host, port=port, log_level=log_level,
                                       timeout_graceful_shutdown=5))
    box["server"] = uv
    uv.run()
    if worker.failed:
        return 2 if worker.failed_expected else 1
    return 0
