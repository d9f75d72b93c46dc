"""`ulacache serve` as a user runs it: a subprocess on a free loopback port (one per module: compiling is most of
the CPU time), driven by the official `openai` package (sync and async, streaming and not, chat and completions)
and by raw HTTP for what that client cannot send (malformed bodies, a client that hangs up). Greedy answers
equal the offline Engine's for the same prompts, under a bounded concurrent load too."""
import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from ulacache_jax.app import cli  # noqa: E402
from ulacache_jax.runtime.requests import SamplingParams  # noqa: E402
from scripts.bench_serve import stop_server  # noqa: E402

MAX_SEQS, MAX_QUEUE, MAX_TOKENS = 4, 40, 12
# the tiny preset (RANDOM weights, byte tokenizer); page 16, budget 64 (4 pages), context 256: as test_cli.py.
# MAX_TOKENS 12: the first token comes from the prefill and the other 11 from one 16-step chunk, the one the
# server's warm-up compiles
ENGINE_ARGS = ["--model", "tiny", "--page-size", "16", "--token-budget", "64", "--max-seqs", str(MAX_SEQS),
               "--max-context", "256", "--compile-cache", "off", "--attention", "sparse"]
SERVE_ARGS = ["--max-queue", str(MAX_QUEUE), "--max-new-tokens", str(MAX_TOKENS), "--log-level", "warning"]
MODEL = "tiny"
CHATS = [[{"role": "user", "content": "What does the keeper log?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
TEXTS = ["The keeper of the north light kept two logbooks", "Fault code E7 means"]
LOAD = [f"Line {i}: the tide came in at {i % 7} o'clock" for i in range(32)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base, path):
    try:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(base, path, raw: bytes):
    req = urllib.request.Request(base + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _metric(base, name, default=None) -> float:
    _, text = _get(base, "/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", text.decode(), re.M)
    if m is None and default is not None:
        return default
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "ulacache_jax.app.cli", "serve", "--port", str(port), *SERVE_ARGS,
                             *ENGINE_ARGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    deadline = time.monotonic() + 600
    try:
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the server was not ready within 600 s"
            try:
                status, _ = _get(base, "/health")
            except OSError:
                status = None                  # not listening yet
            seen.append(status)
            if status == 200:
                break
            time.sleep(0.2)
        yield {"base": base, "proc": proc, "health": seen}
    finally:
        stop_server(proc)
    out = proc.stdout.read()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the exit status says the signal (143 in a shell)
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def offline():
    """The offline Engine built from the same options -> {prompt key: text, token count} for every prompt the tests
    send, greedy, MAX_TOKENS each, in one batch (greedy tokens do not depend on the batch)."""
    args = cli.build_parser().parse_args(["serve", *ENGINE_ARGS])
    engine, _, _ = cli.serve_engine(args)         # the Engine the server builds from these options
    prompts = [("chat", i, m) for i, m in enumerate(CHATS)] + [("text", i, t) for i, t in enumerate(TEXTS + LOAD)]
    reqs = engine.run([p for _, _, p in prompts], SamplingParams(max_new_tokens=MAX_TOKENS))
    occ = engine.occupancy()              # every request finished: no slot and no host page is theirs any more
    assert occ["slots_used"] == occ["host_pages_of_requests"] == 0 and occ["hbm_frames_used"] > 0, occ
    return {(kind, i): (r.text, len(r.tokens), r.finish_reason) for (kind, i, _), r in zip(prompts, reqs)}


def _client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=300)


def test_health_says_ready_only_after_loading(server):
    assert 503 in server["health"], server["health"][:20]     # loading / compiling: 503, not an error
    assert _metric(server["base"], "ulacache_ready") == 1.0
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_sync_chat_and_completion_match_the_offline_engine(server, offline):
    client = _client(server)
    for i, messages in enumerate(CHATS):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        text, n, reason = offline[("chat", i)]
        assert r.choices[0].message.content == text
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == reason
    r = client.completions.create(model=MODEL, prompt=TEXTS, max_tokens=MAX_TOKENS, user="someone")
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [offline[("text", i)][0] for i in range(2)]


def test_async_streaming_matches_the_offline_engine(server, offline):
    async def run():
        client = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=300)
        chat = await client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                    stream=True, stream_options={"include_usage": True})
        pieces, usage, reasons = [], None, []
        async for chunk in chat:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        comp = await client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=MAX_TOKENS, stream=True)
        text = [c.choices[0].text async for c in comp]
        await client.close()
        return pieces, usage, reasons, text

    pieces, usage, reasons, text = asyncio.run(run())
    want, n, reason = offline[("chat", 0)]
    assert "".join(pieces) == want
    assert usage.completion_tokens == n and reasons[-1] == reason
    assert "".join(text) == offline[("text", 1)][0]


def _stop_in(text: str) -> str | None:
    """Two printable ASCII characters from the middle of `text` (a random model's bytes), to use as a stop string."""
    for i in range(2, len(text) - 2):
        if all(c.isascii() and c.isprintable() and not c.isspace() for c in text[i:i + 2]):
            return text[i:i + 2]
    return None


def test_stop_string_text_is_never_streamed(server, offline):
    """A stop string taken from the greedy answer: the stream's text, the whole answer's and the offline Engine's
    all end just before it (the characters that might start it are held back until it is decided)."""
    found = next(((i, s) for i in range(len(LOAD)) if (s := _stop_in(offline[("text", 2 + i)][0]))), None)
    assert found is not None, "no printable pair in any greedy answer"
    i, stop = found
    full = offline[("text", 2 + i)][0]
    want = full[:full.find(stop)]
    client = _client(server)
    r = client.completions.create(model=MODEL, prompt=LOAD[i], max_tokens=MAX_TOKENS, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=LOAD[i], stream=True,
                                                                    max_tokens=MAX_TOKENS, stop=[stop])]
    assert "".join(pieces) == want


def test_n_choices_stream_with_their_own_seeds(server):
    client = _client(server)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=MAX_TOKENS, n=2,
                                                 temperature=1.0, seed=7, stream=True))
    text = {0: "", 1: ""}
    done = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                done[c.index] = c.finish_reason
    assert set(done) == {0, 1}
    r = client.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=MAX_TOKENS, n=2, temperature=1.0,
                                       seed=7)
    assert [c.message.content for c in r.choices] == [text[0], text[1]]   # the same seeds, the same draws
    assert text[0] != text[1]                                             # distinct seeds per choice


def test_concurrent_streams_all_complete(server, offline):
    """32 streams at once over 4 slots (the rest queue): every one completes with the offline Engine's text."""
    async def one(client, i):
        s = await client.completions.create(model=MODEL, prompt=LOAD[i], max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].text async for c in s if c.choices])

    async def run():
        client = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(len(LOAD)))), 400)
        finally:
            await client.close()

    t0 = time.monotonic()
    got = asyncio.run(run())
    assert got == [offline[("text", 2 + i)][0] for i in range(len(LOAD))]
    assert time.monotonic() - t0 < 400
    assert _metric(server["base"], "ulacache_requests_running") == 0


def test_bad_bodies_get_400_naming_the_field_and_the_server_keeps_serving(server):
    base = server["base"]
    cases = [(b'{"messages": [', None, "not valid JSON"),
             (b'\xff\xfe', None, "not valid JSON"),
             (b'[1, 2]', None, "JSON object"),
             (json.dumps({"messages": CHATS[0], "temperature": -1}).encode(), "temperature", "temperature"),
             (json.dumps({"messages": CHATS[0], "colour": "red"}).encode(), "colour", "unknown field"),
             (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role", "role"),
             (json.dumps({"messages": [{"role": "user", "content": "x" * 300}]}).encode(), "messages",
              "maximum context length is 256 tokens")]
    for raw, param, text in cases:
        status, body = _post(base, "/v1/chat/completions", raw)
        assert status == 400, (raw[:40], body)
        assert body["error"]["param"] == param and text in body["error"]["message"], body
        assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _post(base, "/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode())
    assert status == 404 and body["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        _client(server).completions.create(model=MODEL, prompt="x", max_tokens=0)
    r = _client(server).completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_full_queue_gets_429(server):
    n = MAX_SEQS + MAX_QUEUE + 1          # one request whose choices alone overflow the bounded queue
    status, body = _post(server["base"], "/v1/completions",
                         json.dumps({"model": MODEL, "prompt": "x", "n": n, "max_tokens": 2}).encode())
    assert status == 429 and body["error"]["code"] == "queue_full"
    assert f"max_queue {MAX_QUEUE}" in body["error"]["message"]


def _slots_and_pages_free(base, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (_metric(base, "ulacache_requests_running") == 0 and _metric(base, "ulacache_slots_used") == 0
                and _metric(base, "ulacache_host_pages_of_requests") == 0
                and _metric(base, "ulacache_requests_queued") == 0):
            return True
        time.sleep(0.2)
    return False


def test_disconnect_aborts_and_frees_slot_and_pages(server):
    """A stream holds every slot (n = MAX_SEQS choices of 200 tokens); two streaming and two non-streaming requests
    of as many choices queue behind it and their clients hang up once all 16 choices are queued: all 16 are
    aborted (queued, or admitted moments before and far from their 200 tokens); then the holder hangs up too. Afterwards no request, slot or host page is held."""
    base = server["base"]
    host, port = base.removeprefix("http://").split(":")
    aborts = 'ulacache_requests_total{finish_reason="abort"}'
    before = _metric(base, aborts, default=0.0)

    def body(**kw):
        return json.dumps({"model": MODEL, "prompt": "a long answer please", "max_tokens": 200, "ignore_eos": True,
                           **kw}).encode()

    holder = http.client.HTTPConnection(host, int(port), timeout=120)
    holder.request("POST", "/v1/completions", body(stream=True, n=MAX_SEQS), {"Content-Type": "application/json"})
    resp = holder.getresponse()
    assert resp.status == 200
    line = b""
    while not line.startswith(b"data: "):     # the first event carries the first text: the slots are held
        line = resp.fp.readline()
        assert line, "the stream ended before any text"
    socks = []
    for raw in (body(stream=True, n=MAX_SEQS), body(n=MAX_SEQS)) * 2:
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        socks.append(s)
    # the server reads the four bodies and queues their 16 choices behind the holder (polled, not slept: on a fast
    # machine the holder's 200 tokens take a fraction of a second, and a queued choice admitted early could finish)
    deadline = time.monotonic() + 30
    while _metric(base, "ulacache_requests_queued") < 4 * MAX_SEQS:
        assert time.monotonic() < deadline, "the 16 choices were never queued together"
        time.sleep(0.01)
    for s in socks:
        s.close()
    holder.sock.shutdown(socket.SHUT_RDWR)
    holder.close()
    assert _slots_and_pages_free(base)
    assert _metric(base, aborts) >= before + 4 * MAX_SEQS
    # the server still answers
    r = _client(server).chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_metrics_report_cache_figures(server):
    """The cache's figures after this test's own request (its prompt of 200 bytes is longer than the 64-token
    budget, so pages are selected, fetched and stored as a prefix), so it does not depend on which tests this
    worker's server served before it."""
    r = _client(server).completions.create(model=MODEL, prompt=" ".join(LOAD[:6]), max_tokens=MAX_TOKENS)
    assert r.usage.prompt_tokens > 64
    _, text = _get(server["base"], "/metrics")
    text = text.decode()
    for name in ("ulacache_hbm_hits_total", "ulacache_hbm_misses_total", "ulacache_pcie_h2d_bytes_total",
                 "ulacache_pcie_d2h_bytes_total", "ulacache_prefix_cache_hit_tokens_total",
                 "ulacache_time_to_first_token_seconds_bucket", "ulacache_inter_token_latency_seconds_bucket",
                 "ulacache_host_pages_total", "ulacache_spec_accepted_tokens_total"):
        assert name in text, name
    used, total = (_metric(server["base"], f"ulacache_hbm_frames_{k}") for k in ("used", "total"))
    assert 0 < used <= total
    hits, misses = _metric(server["base"], "ulacache_hbm_hits_total"), _metric(server["base"],
                                                                               "ulacache_hbm_misses_total")
    assert hits + misses > 0          # the prompts are longer than the 64-token budget: pages were selected
    assert _metric(server["base"], "ulacache_generated_tokens_total") > 0


def test_logprobs_and_penalties_through_the_openai_client(server, offline):
    """Chat logprobs (logprobs + top_logprobs) and completion logprobs come back in OpenAI's shapes, one entry per
    generated token, the chosen token's logprob among its alternatives' (greedy: it is the best); the penalties and
    min_p are accepted, neutral values change nothing, and a per-request token_budget above the cap is a 400."""
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3)
    text, n, _ = offline[("chat", 0)]
    assert r.choices[0].message.content == text
    content = r.choices[0].logprobs.content
    assert len(content) == n == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert abs(entry.logprob - max(t.logprob for t in entry.top_logprobs)) < 1e-5   # greedy: the argmax
    c = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    # a dict {token text: logprob} per token (OpenAI's legacy shape): two alternatives spelled alike (bytes that
    # are not UTF-8 on their own both read as U+FFFD) share a key
    assert all(1 <= len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)
    same = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                     presence_penalty=0, frequency_penalty=0,
                                     extra_body={"repetition_penalty": 1.0, "min_p": 0.0})
    assert same.choices[0].text == offline[("text", 0)][0]
    rep = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                    frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    assert rep.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="token_budget"):
        client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4, extra_body={"token_budget": 1 << 20})
