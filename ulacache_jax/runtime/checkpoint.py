"""Checkpoint and restore of a running Engine (Engine.save / Engine.restore), with orbax.

What is saved, always: every request the engine still holds (queued, running, finished but not popped): its prompt,
generated tokens (and their logprobs, where asked for), sampling parameters, effective seed, decode-chunk count and
phase (its RNG state: a request's draws are `sampling.row_keys(seed, chunk)` folded with phase + step), remaining
token count and status; the queue order; the engine's next request id. A request whose prompt is partly prefilled
(chunked prefill) has no token yet: it is saved as queued, at the head of the queue, and prefilled again from its
start on restore. The cache itself is not saved: a running request is restored by admitting it again, prefilling
its prompt and feeding every generated token but the last (the next decode input) through decode steps
(Generator.replay: page_size steps a round from the prompt's end, so its flush points fall where they fell and a
saved phase between two is restored with the tail page unflushed), so the K/V of generated tokens are those its
decode wrote: a prefill would attend every earlier token where a sparse decode attended its selection, and the
continuation parted from the uninterrupted one right after the restore. A greedy continuation is then the
uninterrupted one token for token (float32, sparse and dense; tests/test_engine_checkpoint.py). Its penalty
counts, if it uses a penalty, are recomputed from its prompt and tokens. A speculative engine's requests stop
between flush points: they are restored by re-prefilling prompt + tokens (its draft cache too), the pages completed
since the last flush point flushed by the prefill instead of read from the tail ring, so past the token budget a
sparse continuation may differ from the uninterrupted one. Rebuilding from tokens is the cheaper restore: at 256K
tokens x 3 sequences the host pages are ~100 GB, the requests' tokens a few MB; the replay costs one decode step a
generated token (all restored requests in the same steps).

A checkpoint records what decides its tokens: the model config, a digest of the weights (shapes, dtypes and the
first values of every parameter array), the cache config and the attention kind. Restoring it into an engine that
differs in any of them raises CheckpointMismatch naming each difference.

Layout: `directory/<step>/` through orbax's CheckpointManager: a step is written to a temporary folder and renamed
when complete, and the previous step is kept until the new one is, so a kill during a save leaves the last
complete checkpoint readable (a leftover temporary folder is ignored). orbax takes every integer-named entry for a
step and prunes all but the newest two, so save only writes into a folder that is ours: one holding our marker file
(MARKER, written by the first save), or empty, or (written before the marker existed) holding nothing but our step
folders; anything else is refused with CheckpointError naming what is there, and nothing in it is touched.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

import numpy as np
import jax

from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.requests import ERROR, Request, SamplingParams, StepOutput, TokenLogprob

FORMAT = 1
_ITEMS = ("arrays", "meta")
_KEEP = 2                                 # the newest step and the one before it (a kill during a save)
_DIGEST_VALUES = 64                       # leading values of each parameter array in the weight digest
MARKER = ".ulacache-checkpoints"          # in a folder Engine.save writes: its integer-named entries are our steps
_STEP_ENTRIES = frozenset(_ITEMS) | {"_CHECKPOINT_METADATA", "commit_success.txt"}   # what orbax writes into a step
_TMP_STEP = re.compile(r"^\d+\.orbax-checkpoint-tmp-\d+$")   # a step a killed save left half-written


class CheckpointError(ValueError):
    """No usable checkpoint in the directory (missing, unreadable, or not written by Engine.save)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was made with another model, weights, cache config or attention; the message names each."""


@dataclasses.dataclass(frozen=True)
class SavedRequest:
    """One request as saved: enough to resume it (running), start it (queued) or report it (finished)."""
    request_id: int
    prompt_ids: list[int]
    tokens: list[int]
    sampling: dict                        # engine.SamplingParams fields
    status: str                           # queued | running | finished
    max_new_tokens: int
    capped: bool
    seed: int                             # effective seed (running); -1 before admission
    chunk: int                            # decode chunks run (its RNG counter)
    remaining: int                        # tokens still to generate (running)
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None
    stop_reason: str | None = None
    pending: bool = False                 # finished but not yet reported by a step
    logprobs: list = dataclasses.field(default_factory=list)   # [token_id, logprob, [[id, logprob], ...]] a token
    phase: int = 0                        # decode steps since its last flush point (running)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The newest checkpoint in a directory, read without an engine (checkpoint.read)."""
    step: int
    path: pathlib.Path
    identity: dict                        # what must match the restoring engine (engine_identity)
    requests: list[SavedRequest]
    queue: list[int]                      # queued request ids, in order
    next_id: int
    meta: dict                            # the caller's JSON-able data given to save

    @property
    def cache_config(self):
        return CacheConfig(**self.identity["cache_config"])


# ---- identity ---------------------------------------------------------------------------------------------------
def weights_digest(params) -> str:
    """sha256 over every parameter array's path, shape, dtype and first values: another checkpoint of the same
    architecture differs in the first values of (nearly) every array, and reading them costs a few KB."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # the first row's leading values: a slice, not a reshape (which would copy every array)
    heads = jax.device_get([leaf[(0,) * (leaf.ndim - 1)][:_DIGEST_VALUES] if leaf.ndim else leaf
                            for _, leaf in leaves])
    for (path, leaf), head in zip(leaves, heads):
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{leaf.dtype}|".encode())
        h.update(np.asarray(head, np.float32).tobytes())
    return h.hexdigest()


def engine_identity(engine) -> dict:
    """What decides an engine's tokens, JSON-able: model config, weight digest, cache config, attention kind.
    Engine.identity computes it once per engine and keeps it (none of it changes over an engine's life)."""
    gen = engine.gen
    mc = gen.model_config
    model = mc.to_dict() if hasattr(mc, "to_dict") else dataclasses.asdict(mc)
    return json.loads(json.dumps({"model_config": model, "weights": weights_digest(gen.params),
                                  "cache_config": dataclasses.asdict(engine.config), "attention": gen.attention},
                                 default=str))


def identity_differences(saved: dict, current: dict) -> list[str]:
    """-> one line per differing field, 'model_config.num_layers: checkpoint 2, this engine 4'."""
    out = []
    for part in ("model_config", "cache_config"):
        a, b = saved.get(part) or {}, current.get(part) or {}
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{part}.{k}: checkpoint {a.get(k)!r}, this engine {b.get(k)!r}")
    if saved.get("attention") != current.get("attention"):
        out.append(f"attention: checkpoint {saved.get('attention')!r}, this engine {current.get('attention')!r}")
    if not out and saved.get("weights") != current.get("weights"):
        out.append("weights: same architecture, different parameter values (another checkpoint of the model)")
    return out


# ---- the folder -------------------------------------------------------------------------------------------------
def _our_step(p: pathlib.Path, *, partial: bool = False) -> bool:
    """A step folder Engine.save wrote (orbax's layout with our two items), or one a killed save left behind.
    partial (in a folder holding our marker only): also a step folder holding nothing but what orbax writes into
    one, some or all of it gone: a step whose pruning (orbax deletes all but the newest `_KEEP` after a save) a kill
    or SIGTERM cut short, e.g. `4/meta` alone, or `4/` empty (a kill between the last file and the folder itself:
    refusing it would leave the killed run unable to resume, and an empty folder holds nothing to lose). Without
    the marker such a folder may be a user's."""
    if _TMP_STEP.match(p.name):
        return p.is_dir()
    if not (p.name.isdigit() and p.is_dir()):
        return False
    if all((p / item).is_dir() for item in _ITEMS):
        return True
    if not partial:
        return False
    return {c.name for c in p.iterdir()} <= _STEP_ENTRIES


def foreign_entries(directory) -> list[str]:
    """The entries of `directory` that Engine.save did not write and that orbax would take for steps (and prune),
    or, in a folder without our marker, every entry that is not one of our steps: [] when saving there is safe
    (missing, empty, ours)."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    entries = sorted(d.iterdir())
    if (d / MARKER).is_file():
        return [p.name for p in entries if p.name.isdigit() and not _our_step(p, partial=True)]
    return [p.name for p in entries if not _our_step(p)]


def check_directory(directory) -> None:
    """CheckpointError when `directory` holds things Engine.save did not write (foreign_entries): saving there would
    take integer-named folders for steps and delete all but the newest two."""
    foreign = foreign_entries(directory)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise CheckpointError(f"{directory} is not a checkpoint folder written by ulacache (no {MARKER} marker, or "
                              f"entries it did not write): it holds {shown}; choose an empty or new folder (saving "
                              "here would take integer-named folders for checkpoint steps and delete them)")


def _claim_directory(directory) -> None:
    """Before a save: refuse a folder that is not ours (check_directory), create it if missing, mark it ours."""
    check_directory(directory)
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    marker = d / MARKER
    if not marker.is_file():
        marker.write_text("ulacache_jax Engine checkpoints (orbax steps): integer-named folders here are pruned\n")


# ---- save -------------------------------------------------------------------------------------------------------
def _manager(directory, *, create: bool):
    import orbax.checkpoint as ocp
    opts = ocp.CheckpointManagerOptions(max_to_keep=_KEEP, enable_async_checkpointing=False, create=create)
    return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=opts, item_names=_ITEMS)


def _ragged(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints -> (flat [sum n + 1] int64, offsets [len + 1] int64). The flat array ends with one unused -1:
    orbax refuses arrays of size zero (no requests, or none with tokens yet)."""
    offsets = np.zeros(len(lists) + 1, np.int64)
    offsets[1:] = np.cumsum([len(x) for x in lists])
    flat = np.fromiter((t for x in lists for t in x), np.int64, count=int(offsets[-1]))
    return np.append(flat, -1), offsets


def _unragged(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [[int(t) for t in flat[offsets[i]:offsets[i + 1]]] for i in range(len(offsets) - 1)]


def saved_requests(engine) -> list[SavedRequest]:
    """The engine's requests as SavedRequests (host state only: nothing is read from the device)."""
    slots = engine.slots
    slot_of = {rid: slot for slot, rid in slots.request_of.items()}
    pending = set(engine.pending_ids)
    prefilling = set(engine.prefilling_ids)      # no token yet: saved as queued (save puts them first)
    out = []
    for rid, req in engine.requests.items():
        slot = slot_of.get(rid)
        running = slot is not None and not req.finished and rid not in prefilling
        out.append(SavedRequest(
            request_id=rid, prompt_ids=list(req.prompt_ids), tokens=list(req.tokens),
            sampling=dataclasses.asdict(req.sampling), status="queued" if rid in prefilling else req.status,
            max_new_tokens=int(req.max_new_tokens),
            capped=bool(req.capped), seed=int(slots.seed[slot]) if running else -1,
            chunk=int(slots.chunk[slot]) if running else 0,
            remaining=int(slots.remaining[slot]) if running else 0, finish_reason=req.finish_reason,
            error=req.error, text=req.text, stop_reason=req.stop_reason, pending=rid in pending,
            logprobs=[[t.token_id, t.logprob, [list(a) for a in t.top]] for t in req.logprobs],
            phase=int(slots.phase[slot]) if running else 0))
    return out


def save(engine, directory, *, meta: dict | None = None) -> pathlib.Path:
    """Write the engine's requests as a new step under `directory` -> the step's folder. Call between steps.
    meta: the caller's JSON-able data, returned by read/restore (the CLI keeps its ids there)."""
    import orbax.checkpoint as ocp
    reqs = saved_requests(engine)
    for r in reqs:
        if r.status == "running" and r.seed < 0:
            raise RuntimeError(f"request {r.request_id} is running without a slot: save between engine steps")
    prompts, p_off = _ragged([r.prompt_ids for r in reqs])
    tokens, t_off = _ragged([r.tokens for r in reqs])
    # one row per request, and one unused row at the end (orbax refuses arrays of size zero)
    cols = np.asarray([[r.request_id, r.max_new_tokens, r.capped, r.seed, r.chunk, r.remaining, r.pending]
                       for r in reqs] + [[-1] * 7], np.int64)
    arrays = {"prompts": prompts, "prompt_offsets": p_off, "tokens": tokens, "token_offsets": t_off,
              "columns": cols}
    info = {"format": FORMAT, "identity": engine.identity, "next_id": engine.next_id,
            "queue": engine.prefilling_ids + engine.queued_ids, "meta": meta or {},
            "requests": [{"sampling": r.sampling, "status": r.status, "finish_reason": r.finish_reason,
                          "error": r.error, "text": r.text, "stop_reason": r.stop_reason,
                          "logprobs": r.logprobs, "phase": r.phase} for r in reqs]}
    info = json.loads(json.dumps(info))   # tuples -> lists; fails here, not half-way through a write
    _claim_directory(directory)
    mngr = _manager(directory, create=True)
    try:
        step = (mngr.latest_step() or 0) + 1
        mngr.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                meta=ocp.args.JsonSave(info)), force=True)
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return pathlib.Path(directory) / str(step)


# ---- read and restore -------------------------------------------------------------------------------------------
def read(directory) -> Checkpoint:
    """The newest complete checkpoint under `directory`; CheckpointError when there is none."""
    import orbax.checkpoint as ocp
    d = pathlib.Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    mngr = _manager(d, create=False)
    try:
        step = mngr.latest_step()
        if step is None:
            raise CheckpointError(f"{directory} holds no complete checkpoint (no step folder written by Engine.save)")
        try:
            got = mngr.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(),
                                                             meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the folder
            raise CheckpointError(f"checkpoint {d / str(step)} cannot be read: {type(e).__name__}: {e}") from None
    finally:
        mngr.close()
    info, arr = got["meta"], got["arrays"]
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {d / str(step)} is not an Engine checkpoint of format {FORMAT} "
                              f"(format {info.get('format') if isinstance(info, dict) else None!r})")
    prompts = _unragged(np.asarray(arr["prompts"]), np.asarray(arr["prompt_offsets"]))
    tokens = _unragged(np.asarray(arr["tokens"]), np.asarray(arr["token_offsets"]))
    cols = np.asarray(arr["columns"]).reshape(-1, 7)
    reqs = []
    for i, r in enumerate(info["requests"]):
        rid, max_new, capped, seed, chunk, remaining, pending = (int(x) for x in cols[i])
        reqs.append(SavedRequest(rid, prompts[i], tokens[i], r["sampling"], r["status"], max_new, bool(capped),
                                 seed, chunk, remaining, r["finish_reason"], r["error"], r["text"], r["stop_reason"],
                                 bool(pending), r.get("logprobs") or [],
                                 int(r.get("phase", 0))))    # checkpoints before phases: 0
    return Checkpoint(step, d / str(step), info["identity"], reqs, [int(x) for x in info["queue"]],
                      int(info["next_id"]), info.get("meta") or {})


def sampling_params(saved: dict):
    """A SavedRequest's sampling dict -> engine.SamplingParams (lists back to tuples)."""
    d = dict(saved)
    d["stop_ids"] = None if d.get("stop_ids") is None else tuple(d["stop_ids"])
    d["stop"] = tuple(d.get("stop") or ())
    return SamplingParams(**d)


def restore(engine, directory, *, skip=()) -> Checkpoint:
    """Load the newest checkpoint under `directory` into `engine`, which must hold no requests: queued requests
    are queued again in their order, running ones re-admitted, their prompt prefilled and their generated tokens
    but the last fed through decode steps (Generator.replay; a speculative engine re-prefills prompt + tokens),
    and continue with their own seed and chunk count, finished ones come back as they were (those not yet
    reported are reported by the next step). Request ids are kept. `skip`: request ids not to restore (e.g. ones
    whose results were written after the checkpoint). CheckpointMismatch if the checkpoint's model, weights,
    cache config or attention differ from the engine's. -> the Checkpoint read."""
    ck = read(directory)
    if engine.requests or engine.num_queued or engine.slots.request_of:
        raise ValueError(f"restore needs an engine without requests (this one holds {len(engine.requests)})")
    diff = identity_differences(ck.identity, engine.identity)
    if diff:
        raise CheckpointMismatch(f"checkpoint {ck.path} was made with another model or cache: " + "; ".join(diff))
    skip = set(skip)
    now = engine.clock()
    by_id = {}
    for r in ck.requests:
        if r.request_id in skip:
            continue
        req = Request(r.request_id, list(r.prompt_ids), sampling_params(r.sampling), max_new_tokens=r.max_new_tokens,
                      tokens=list(r.tokens), status=r.status, finish_reason=r.finish_reason, error=r.error,
                      capped=r.capped, text=r.text, stop_reason=r.stop_reason, t_added=now,
                      logprobs=[TokenLogprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
                                for t, lp, top in r.logprobs])
        by_id[r.request_id] = (r, req)
    engine.reserve_ids(ck.next_id)
    replays: dict[int, list[int]] = {}        # slot -> generated tokens to feed through decode steps
    # running requests first, into slots, so queued ones wait behind them as before
    for rid, (r, req) in by_id.items():
        engine.requests[rid] = req
        if r.status == "finished":
            if r.pending:
                engine.report(StepOutput(rid, (), True, r.finish_reason, r.error))
            continue
        if r.status != "running":
            continue
        ids = r.prompt_ids + r.tokens[:-1]          # the cache held these; the last token is the next input
        # decoded tokens are rebuilt by decode steps (Generator.replay) where the saved phase says their flush
        # points are every page_size steps from the prompt's end (always, but with speculative decoding)
        replay = engine.spec is None and (len(r.tokens) - 1) % engine.config.page_size == r.phase
        pre = r.prompt_ids if replay else ids
        slot = engine.gen.admit(len(r.prompt_ids) + r.max_new_tokens, pre)   # (shared prefixes attach by ids)
        req.slot, req.t_admitted, req.t_first_token = slot, now, now
        engine.slots.request_of[slot] = rid
        try:
            engine.gen.prefill(slot, pre)
            if engine.spec is not None:   # speculative: its draft cache, and flush points from the prompt's end
                engine.spec.prefill(slot, ids, len(r.prompt_ids) + r.max_new_tokens)
                engine.spec.prompt_len[slot] = len(r.prompt_ids)
        except Exception as e:  # noqa: BLE001 - as a failed prefill in Engine.step: this request alone fails
            engine.release(slot)
            engine.finish(req, ERROR, error=f"restore prefill failed: {type(e).__name__}: {e}")
            engine.report(StepOutput(rid, (), True, ERROR, req.error))
            continue
        engine.slots.start(slot, r.tokens[-1], r.remaining, req.sampling, engine.budget_pages(req.sampling))
        engine.slots.seed[slot], engine.slots.chunk[slot], engine.slots.phase[slot] = r.seed, r.chunk, r.phase
        if req.sampling.penalized:           # the counts are not saved: the prompt and tokens decide them
            engine.seed_penalties(slot, r.prompt_ids, r.tokens)
        if replay:
            replays[slot] = r.tokens[:-1]
    try:
        engine.gen.replay(replays, engine.slots.budgets(engine.config.select_pages))
    except Exception as e:  # noqa: BLE001 - the cache went into the failed call: every replayed request fails
        for slot in list(replays):
            req = engine.requests[engine.slots.request_of[slot]]
            engine.release(slot)
            engine.finish(req, ERROR, error=f"restore replay failed: {type(e).__name__}: {e}")
            engine.report(StepOutput(req.request_id, (), True, ERROR, req.error))
    for rid in ck.queue:
        if rid in by_id and by_id[rid][0].status == "queued":
            engine.enqueue(rid)
    return ck
