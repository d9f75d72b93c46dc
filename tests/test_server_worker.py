"""The server's engine thread (app/server.EngineWorker) over a stand-in engine, no model: updates reach the event
loop in order, an abort that arrives before the engine saw the request ends it, a failing step fails only the
requests the engine lost and the thread keeps serving, and a build that raises reports it."""
import asyncio
import types

import pytest

pytest.importorskip("prometheus_client")

from ulacache_jax.app.metrics import ServingMetrics  # noqa: E402
from ulacache_jax.app.server import Built, Choice, EngineWorker  # noqa: E402
from ulacache_jax.runtime.requests import Request, SamplingParams, StepOutput  # noqa: E402


class StandInEngine:
    """Each step gives every running request one token (its id + 100) until max_new_tokens; a request whose prompt
    is [13] makes the step raise after finishing every running request with an error, as the Engine does when a
    decode chunk fails."""

    def __init__(self):
        self.requests: dict[int, Request] = {}
        self.pending: list[StepOutput] = []
        self.timeline = []
        self.config = types.SimpleNamespace(page_size=4, max_seqs=2, num_layers=1, num_groups=1, page_bytes=8)
        self.gen = types.SimpleNamespace(backend=types.SimpleNamespace(host_tier=False))
        self.next = 0

    def add_request(self, prompt, sp):
        rid, self.next = self.next, self.next + 1
        self.requests[rid] = Request(rid, list(prompt), sp, max_new_tokens=sp.max_new_tokens, status="running")
        self.requests[rid].t_admitted = 0.0
        return rid

    def has_unfinished(self):
        return bool(self.pending) or any(not r.finished for r in self.requests.values())

    def abort(self, rid):
        r = self.requests[rid]
        r.status, r.finish_reason = "finished", "stop"
        self.pending.append(StepOutput(rid, (), True, "stop"))

    def step(self):
        outs, self.pending = self.pending, []
        running = [r for r in self.requests.values() if not r.finished]
        if any(r.prompt_ids == [13] for r in running):
            for r in running:
                r.status, r.finish_reason, r.error = "finished", "error", "decode failed: boom"
            raise RuntimeError("boom")
        for r in running:
            r.tokens.append(r.request_id + 100)
            done = len(r.tokens) >= r.max_new_tokens
            if done:
                r.status, r.finish_reason, r.text = "finished", "length", "x" * len(r.tokens)
            outs.append(StepOutput(r.request_id, (r.request_id + 100,), done, r.finish_reason if done else None))
        return outs

    def get(self, rid):
        return self.requests[rid]

    def pop(self, rid):
        return self.requests.pop(rid)

    def prefix_stats(self):
        return types.SimpleNamespace(hit_tokens=0)

    def occupancy(self):
        running = sum(not r.finished for r in self.requests.values())
        return dict(slots_used=running, slots_total=2, host_pages_used=0, host_pages_total=0,
                    host_pages_of_requests=0, hbm_frames_used=0, hbm_frames_total=0, spec_proposed=0,
                    spec_accepted=0)

    num_running = property(lambda self: sum(not r.finished for r in self.requests.values()))
    num_queued = 0


async def _drain(sink, n_choices, timeout=10.0):
    got, done = {}, 0
    while done < n_choices:
        idx, upd = await asyncio.wait_for(sink.get(), timeout)
        got.setdefault(idx, []).append(upd)
        done += upd.finished
    return got


def _worker(engine):
    return EngineWorker(lambda: Built(engine, None, 64), ServingMetrics(), warmup="off")


def test_updates_abort_and_a_failing_step():
    async def run():
        eng = StandInEngine()
        w = _worker(eng)
        w.start(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, w.ready.wait, 10)
        sink = asyncio.Queue()
        finished = []
        ok = Choice(0, [1, 2], SamplingParams(max_new_tokens=3), sink, lambda: finished.append(0))
        gone = Choice(1, [1, 2], SamplingParams(max_new_tokens=3), sink, lambda: finished.append(1))
        w.abort(gone)                   # aborted before the engine saw it: it never runs
        w.submit(ok)
        w.submit(gone)
        got = await _drain(sink, 2)
        assert [u.tokens for u in got[0]] == [(100,), (100,), (100,)] and got[0][-1].finish_reason == "length"
        assert got[0][-1].text == "xxx" and got[0][-1].completion_tokens == 3
        assert [(u.tokens, u.finished, u.finish_reason) for u in got[1]] == [((), True, "stop")]
        assert sorted(finished) == [0, 1]
        # a step that raises: the requests it lost fail, the thread serves on
        sink2 = asyncio.Queue()
        bad = Choice(0, [13], SamplingParams(max_new_tokens=3), sink2, lambda: None)
        w.submit(bad)
        got = await _drain(sink2, 1)
        last = got[0][-1]
        assert last.finish_reason == "error" and "boom" in last.error and last.admitted
        sink3 = asyncio.Queue()
        w.submit(Choice(0, [5], SamplingParams(max_new_tokens=2), sink3, lambda: None))
        got = await _drain(sink3, 1)
        assert got[0][-1].finish_reason == "length"
        assert w.failed is None and w.ready.is_set() and not w.active
        w.stop()
        w.thread.join(10)
        assert not w.thread.is_alive()

    asyncio.run(run())


def test_a_failing_build_is_reported():
    async def run():
        seen = []

        def build():
            raise ValueError("no such model")

        w = EngineWorker(build, ServingMetrics(), warmup="off", on_fatal=seen.append, expected=(ValueError,))
        w.start(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, w.thread.join, 10)
        assert w.failed == "no such model" and w.failed_expected and seen == ["no such model"]
        assert not w.ready.is_set()

    asyncio.run(run())

