"""Long-context quality (issue 47 item 3, issue 48 item 3): RULER-style tasks (scripts/ruler_tasks.py) over real
haystacks (scripts/haystacks.py), every answer from the library's decode path (`ulacache_jax.generate`, greedy, the
model's chat template), dense and every sparse rule in one run on the SAME prompts.

    # CPU machine: make the prompts with the model's tokenizer (the file holds haystack text: never commit it)
    python -m scripts.bench_longctx --make-prompts /tmp/p.json --model qwen2.5-coder-0.5b \\
        --tasks niah_single,niah_multikey --contexts 16384,32768 --depths 0.1,0.5,0.9 --num-prompts 8 --haystack essays
    # GPU machine: answer them (no haystack source needed there)
    python -m scripts.bench_longctx --prompts /tmp/p.json --model /path/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf \\
        --rules dense,quest,key_copy:16,labels:16:8 --budget-ratios 0.03125,0.0625 --out DIR --deadline 540
    # tests: tiny random model, byte tokenizer (answers meaningless, the pipeline runs)
    python -m scripts.bench_longctx --tiny --contexts 1024 --haystack noise --rules dense,quest --budgets 256 --out DIR

Prompts: `ruler_tasks.grid(tasks, contexts, depths, num_prompts, seed)`, each made by `ruler_tasks.make` with a user
message of at most `context - max_new_tokens - chat template tokens` tokens, then shrunk until the chat-templated
prompt plus its max new tokens fits the context. Without --prompts / --make-prompts they are made in-process. With
--prompts, --tasks / --contexts / --depths pick a subset of the file (one run split over several device calls).
Rules (`--rules`, comma list): dense; quest; key_copy:C (CacheConfig.key_channels = C, label_bits = 0);
labels:C:BITS (label_bits 8 or 4) and labels:C:BITS:TABLE (an offline channel table, JSON {"model_digest",
"channels": [L][KV][C]}, passed as CacheConfig.channel_table; TABLE 'auto': the model's shipped table,
models/calibration); two:MULT:<rule> (not dense): that rule ranks the shortlist of a TwoStage (Quest's page bound
shortlists MULT x the budget; rows carry two_stage MULT); two:MULT:<first>+<rule>: <first> (key_copy or labels)
shortlists instead of Quest (rows also carry first_rule, first_channels, first_bits); exact:K:<rule> (not dense):
exact mode, <rule> drafts K tokens with sparse attention and dense attention verifies them (SpecConfig("sparse",
K); rows carry exact K, acceptance, verifications, tokens_per_verification). Every sparse rule runs at
every budget (--budgets, plus --budget-ratios x context, rounded to the page size; a budget >= the context is dense
by construction and skipped); dense runs once per context, first.
Cells: the unit of work is one generate call, (context, rule, budget, max_new_tokens) over every task and depth of
that context with that answer length, batched through `--batch` cache slots (more prompts queue in the engine);
its cache config is `generation.default_cache_config` for (batch, context) with `dataclasses.replace` for the rule,
so every call of one context and rule reuses one compiled program (prompt lengths are bucketed by the library:
the next power of two of the prompt; a 16K-context prompt always lands in the 16K bucket). generate's Engine
attaches shared prompt prefixes (its default; the prompts of one index share their haystack up to the first
needle; key-copy / label rules with online channels only prefixes that cover the tokens they calibrate on).
Rows (one per (rule, budget, task, context, depth)): model, attention, rule, channels, label_bits, kv_dtype, task,
context, prompt_tokens (mean chat-templated prompt length), depth, batch (cache slots), budget, page_size, accuracy
(mean ruler_tasks.score), same_as_dense (fraction of prompts whose output text equals dense's), n, tokens_per_s
(generated tokens / wall seconds of the generate call: it includes prefill, and the compile on a config's first
call), device, commit; plus spec (the rule as given), channel_table, haystack, budget_ratio, seconds. Per-prompt
outputs are kept in "outputs" (id, spec, budget, output, score) so same_as_dense can be recomputed; "prompts" holds
each prompt's id, task, context, depth, seed, answers and lengths (not its text). The JSON is rewritten after every
call; --deadline SECONDS stops starting calls after that many seconds from the start (meta.skipped names them).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time

import numpy as np

from scripts import ruler_tasks
from ulacache_jax.cache.select import registry, two_stage
from scripts.bench_meta import add_common_args

# answer lengths (new tokens) per task: 7-digit numbers are 7 tokens in Qwen's / Llama-3's tokenizers
MAX_NEW = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 48, "niah_multiquery": 64, "vt": 64, "cwe": 64}
FIT_MARGIN = 4            # tokens kept free past the chat template's estimate (merges at the message's edges)
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
PROMPT_FILE_VERSION = 1
DEFAULTS = dict(tasks="niah_single,niah_multikey", contexts="16384,32768", depths="0.1,0.5,0.9")


def log(*a):
    print(*a, flush=True)


# ---- rules ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rule:
    spec: str                    # as given on the command line
    rule: str                    # dense | quest | key_copy | labels (the rows' vocabulary)
    channels: int = 0
    label_bits: int = 0
    table_path: str | None = None
    table: tuple | None = None   # [L][KV][C] channel ids
    table_digest: str | None = None
    two_stage: int | None = None   # the shortlist's multiple of the budget: this rule ranks a TwoStage's shortlist
    first: "Rule | None" = None    # that TwoStage's first stage (None: Quest's page bound)
    exact: int | None = None       # exact mode: this rule drafts K = exact tokens, dense attention verifies them

    @property
    def attention(self) -> str:
        return "dense" if self.rule == "dense" or self.exact else "sparse"

    def cache_config(self, base):
        if self.rule in ("dense", "quest"):
            cfg = base
        elif self.rule == "key_copy":
            cfg = dataclasses.replace(base, key_channels=self.channels, label_bits=0)
        else:
            cfg = dataclasses.replace(base, key_channels=self.channels, label_bits=self.label_bits,
                                      channel_table=self.table)
        if not self.two_stage:
            return cfg
        first = None if self.first is None else registry.resolve(self.first.cache_config(base))
        return two_stage.configure(cfg, self.two_stage, first=first)


def parse_rule(spec: str) -> Rule:
    spec = spec.strip()
    if spec.startswith("exact:"):   # exact:K:<rule>: <rule> drafts K tokens a step, dense verifies (SpecConfig sparse)
        parts = spec.split(":", 2)
        try:
            if len(parts) < 3:
                raise ValueError("needs exact:K:<rule>")
            k = int(parts[1])
            if k < 1:
                raise ValueError(f"K = {k} must be >= 1")
        except ValueError as e:
            raise SystemExit(f"--rules {spec!r}: {e}") from None
        inner = parse_rule(parts[2])
        if inner.rule == "dense" or inner.exact:
            raise SystemExit(f"--rules {spec!r}: the drafting rule must be a sparse one (quest, key_copy, labels, two)")
        return dataclasses.replace(inner, spec=spec, exact=k)
    if spec.startswith("two:"):   # two:MULT:[<first>+]<rule>: <rule> reranks a TwoStage's shortlist
        parts = spec.split(":", 2)
        try:
            if len(parts) < 3:
                raise ValueError("needs two:MULT:<rule>")
            mult = two_stage.parse_spec(parts[1])
        except ValueError as e:
            raise SystemExit(f"--rules {spec!r}: {e}") from None
        stages = parts[2].split("+")
        if len(stages) > 2:
            raise SystemExit(f"--rules {spec!r}: two:MULT:<first>+<second> takes two stages, not {len(stages)}")
        inner = parse_rule(stages[-1])
        if inner.rule == "dense" or inner.two_stage:
            raise SystemExit(f"--rules {spec!r}: the second stage must be quest, key_copy:C or labels:C:BITS")
        first = parse_rule(stages[0]) if len(stages) == 2 else None
        if first is not None and (first.rule in ("dense", "quest") or first.two_stage):
            raise SystemExit(f"--rules {spec!r}: the first stage must be key_copy:C or labels:C:BITS (Quest's bound "
                             "is the first stage when none is given)")
        return dataclasses.replace(inner, spec=spec, two_stage=mult, first=first)
    parts = spec.split(":", 3)
    name = parts[0]
    try:
        if name in ("dense", "quest") and len(parts) == 1:
            return Rule(spec, name)
        if name == "key_copy" and len(parts) == 2:
            return Rule(spec, name, channels=int(parts[1]))
        if name == "labels" and len(parts) in (3, 4):
            bits = int(parts[2])
            if bits not in (4, 8):
                raise ValueError(f"label bits {bits} must be 8 or 4")
            if len(parts) == 3:
                return Rule(spec, name, channels=int(parts[1]), label_bits=bits)
            if parts[3] == "auto":   # the model's shipped table: resolve_tables, once the model is known
                return Rule(spec, name, channels=int(parts[1]), label_bits=bits, table_path="auto")
            with open(parts[3]) as fh:
                tab = json.load(fh)
            channels = tab["channels"]
            if isinstance(channels, dict):   # scripts/calibrate_labels.py's file: one table per C
                channels = channels[str(int(parts[1]))]
            return Rule(spec, name, channels=int(parts[1]), label_bits=bits, table_path=parts[3],
                        table=channels, table_digest=tab.get("model_digest"))
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise SystemExit(f"--rules {spec!r}: {type(e).__name__}: {e}") from None
    raise SystemExit(f"--rules {spec!r}: one of dense, quest, key_copy:C, labels:C:BITS[:TABLE|:auto], "
                     "two:MULT:<one of those but dense>, exact:K:<one of those but dense>")


def resolve_tables(rules: list[Rule], model: str) -> list[Rule]:
    """Rules whose table is 'auto' (labels:C:BITS:auto) with the model's shipped table for C (models.calibration:
    found by the model file's sha256); SystemExit naming the rule when the model has none, or none for C."""
    from ulacache_jax.models import calibration
    out, digest = [], None
    for r in rules:
        if r.first is not None:
            r = dataclasses.replace(r, first=resolve_tables([r.first], model)[0])
        if r.table_path == "auto":
            try:
                digest = digest or calibration.model_digest(model)      # hashed once for every 'auto' rule
                table = calibration.channel_table(model, r.channels, digest=digest) if digest else None
            except (ValueError, OSError, KeyError) as e:
                raise SystemExit(f"--rules {r.spec!r}: {e}") from None
            if table is None:
                raise SystemExit(f"--rules {r.spec!r}: no shipped label-channel table for --model {model!r} "
                                 f"(tables: {calibration.FOLDER}; make one with python -m scripts.calibrate_labels)")
            r = dataclasses.replace(r, table_path=str(calibration.table_path(digest)), table=table,
                                    table_digest=digest)
        out.append(r)
    return out


def first_fields(rule: Rule) -> dict:
    """A two-stage row's first stage when it is a rule (first_rule, first_channels, first_bits); none for Quest's
    bound (the rows before first stages existed read the same)."""
    f = rule.first
    return {} if f is None else dict(first_rule=f.rule, first_channels=f.channels, first_bits=f.label_bits)


def exact_generate(model, prompts, max_new: int, cache_config, k: int, stop_ids):
    """An exact-mode cell (rule exact:K:<rule>): the prompts through an Engine whose dense cache verifies the drafts
    of the model's own sparse decoding on `cache_config`'s rule (SpecConfig("sparse", K)) -> (token lists in prompt
    order, the speculative counters: acceptance = accepted / proposed drafts, tokens_per_verification = tokens
    delivered by the decode steps, summed over the batch, / verifications (each verifies every running sequence))."""
    from ulacache_jax.runtime.engine import Engine, SamplingParams
    from ulacache_jax.runtime.speculative.rules import SpecConfig
    eng = Engine(model, cache_config, attention="dense", speculative=SpecConfig("sparse", k))
    reqs = eng.run(prompts, SamplingParams(max_new_tokens=max_new, stop_ids=tuple(stop_ids or ())))
    for r in reqs:
        if r.finish_reason == "error":
            raise RuntimeError(r.error)
    sp = eng.spec
    decoded = sum(max(0, len(r.tokens) - 1) for r in reqs)      # the first token of each comes from its prefill
    return [r.tokens for r in reqs], dict(acceptance=sp.acceptance_rate, verifications=int(sp.steps),
                                          proposed=int(sp.proposed), accepted=int(sp.accepted),
                                          tokens_per_verification=decoded / max(1, sp.steps))


def parse_rules(text: str) -> list[Rule]:
    rules = [parse_rule(s) for s in text.split(",") if s.strip()]
    specs = [r.spec for r in rules]
    if len(set(specs)) != len(specs):
        raise SystemExit(f"--rules lists a rule twice: {text}")
    # dense first: every sparse output is compared with it
    return sorted(rules, key=lambda r: r.rule != "dense")


def budgets_for(context: int, budgets, ratios, page: int) -> tuple[list[int], list[int]]:
    """(budgets to run, budgets skipped as >= the context) for one context: --budgets and --budget-ratios x context,
    rounded to the page size (at least one page)."""
    want = {max(page, round(b / page) * page) for b in budgets}
    want |= {max(page, round(r * context / page) * page) for r in ratios}
    return sorted(b for b in want if b < context), sorted(b for b in want if b >= context)


# ---- model and tokenizer ----------------------------------------------------------------------------------------
def model_spec(args) -> str:
    return "tiny" if args.tiny else (args.model or DEFAULT_MODEL)


def model_name(spec: str) -> str:
    """The rows' model field: a preset / pretrained name as is, a path's file (or folder) name."""
    return os.path.basename(os.path.normpath(spec)) if os.path.exists(spec) else spec


def load_tokenizer(spec: str):
    """The tokenizer alone (making prompts needs no weights): the byte tokenizer of the random presets, else the
    library's load_tokenizer (a pretrained name, a GGUF file, a folder)."""
    from ulacache_jax import models
    if spec in models.PRESETS and not os.path.exists(spec):
        if models.get_preset(spec).vocab_size != models.BYTE_VOCAB_SIZE:
            raise SystemExit(f"--model {spec!r}: a random preset without a tokenizer")
        return models.ByteTokenizer()
    return models.load_tokenizer(spec)


def load_model(spec: str, dtype: str, seed: int = 0):
    """-> (model, tokenizer), resolved as the CLI resolves --model (app/model_loading.py: pretrained names, random
    presets, GGUF files, Hugging Face / checkpoint folders)."""
    from ulacache_jax.app import model_loading
    from ulacache_jax.app.errors import UsageError
    try:
        loaded = model_loading.load_model(spec, dtype, seed)
    except UsageError as e:
        raise SystemExit(str(e)) from None
    if loaded.tokenizer is None or not hasattr(loaded.tokenizer, "apply_chat_template"):
        raise SystemExit(f"--model {spec!r}: no tokenizer with a chat template")
    if loaded.random_weights:
        log(f"model {spec}: RANDOM weights (answers are meaningless; the pipeline runs)")
    return loaded.model, loaded.tokenizer


def chat_ids(tok, text: str) -> list[int]:
    return [int(i) for i in tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)]


def stop_ids_of(model, tok) -> tuple[int, ...]:
    ids = tuple(getattr(tok, "eos_ids", ()) or ()) + tuple(model.config.eos_token_ids or ())
    return tuple(sorted({int(i) for i in ids}))


# ---- prompts ----------------------------------------------------------------------------------------------------
def prompt_id(task: str, context: int, depth, seed: int) -> str:
    return f"{task}/{context}/{depth}/{seed}"


def max_new_of(task: str, override: int | None) -> int:
    return override or MAX_NEW[task]


def make_prompts(tok, *, tasks, contexts, depths, num_prompts, haystack, seed, max_new=None) -> tuple[list, dict]:
    """-> (prompt dicts, provenance). Each: id, task, context, depth, seed, text (the user message), answers,
    prompt_tokens (the user message's tokens, ruler_tasks' count), chat_tokens (the chat-templated prompt's),
    max_new_tokens; chat_tokens + max_new_tokens <= context."""
    from scripts import haystacks
    docs = haystacks.load(haystack)
    fn = haystacks.haystack_fn(docs, tok)
    overhead = len(chat_ids(tok, "x")) - ruler_tasks.count_tokens(tok, "x")
    out = []
    for task, context, depth, pseed in ruler_tasks.grid(tasks, contexts, depths, num_prompts, seed):
        mn = max_new_of(task, max_new)
        num = context - mn - overhead - FIT_MARGIN
        for _ in range(6):
            p = ruler_tasks.make(task, haystack_text_fn=fn, num_tokens=num, depth=depth, seed=pseed, tokenizer=tok)
            n = len(chat_ids(tok, p.text))
            if n + mn <= context:
                break
            num -= n + mn - context + FIT_MARGIN
        else:
            raise RuntimeError(f"{task} at {context}: could not fit a prompt into the context")
        out.append(dict(id=prompt_id(task, context, depth, pseed), task=task, context=int(context), depth=depth,
                        seed=int(pseed), text=p.text, answers=list(p.answers), prompt_tokens=int(p.prompt_tokens),
                        chat_tokens=int(n), max_new_tokens=int(mn)))
    return out, haystacks.describe(haystack, docs)


def prompts_digest(prompts) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p["id"], p["text"], p["answers"], p["max_new_tokens"]]).encode())
    return h.hexdigest()


def write_prompt_file(path: str, prompts, meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(dict(meta=dict(meta, version=PROMPT_FILE_VERSION, digest=prompts_digest(prompts),
                                 note="holds haystack text (some sources are copyrighted): never commit this file"),
                       prompts=prompts), fh)
    os.replace(tmp, path)


def read_prompt_file(path: str) -> tuple[list, dict]:
    with open(path) as fh:
        data = json.load(fh)
    meta, prompts = data["meta"], data["prompts"]
    if meta.get("version") != PROMPT_FILE_VERSION:
        raise SystemExit(f"{path}: prompt file version {meta.get('version')} (this script reads {PROMPT_FILE_VERSION})")
    if meta.get("digest") != prompts_digest(prompts):
        raise SystemExit(f"{path}: its prompts do not match its digest (edited or truncated?)")
    return prompts, meta


def as_prompt(p: dict) -> ruler_tasks.Prompt:
    return ruler_tasks.Prompt(p["task"], p["context"], p["depth"], p["seed"], p["text"], tuple(p["answers"]),
                              p["prompt_tokens"])


# ---- the run ----------------------------------------------------------------------------------------------------
def run(args, prompts: list, prompt_meta: dict) -> dict:
    import ulacache_jax
    from ulacache_jax.runtime.generation import default_cache_config
    from scripts.bench_meta import Results, run_meta

    t_start = time.monotonic()
    spec = model_spec(args)
    rules = resolve_tables(parse_rules(args.rules), spec)
    t0 = time.perf_counter()
    model, tok = load_model(spec, args.dtype)
    log(f"model {spec} loaded in {time.perf_counter() - t0:.1f} s")
    stop_ids = stop_ids_of(model, tok)
    mc = model.config
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()] if args.budgets else []
    ratios = [float(r) for r in args.budget_ratios.split(",") if r.strip()] if args.budget_ratios else []
    if any(r.rule != "dense" for r in rules) and not (budgets or ratios):
        raise SystemExit("sparse rules need --budgets and/or --budget-ratios")

    for rule in rules:       # a rule this model's cache refuses (channels > head_dim, a table's shape): now
        try:
            rule.cache_config(default_cache_config(mc, num_seqs=args.batch, max_tokens=4 * args.page_size,
                                                   page_size=args.page_size, token_budget=2 * args.page_size,
                                                   dtype=model.dtype))
        except ValueError as e:
            raise SystemExit(f"--rules {rule.spec}: {e}") from None

    ids = {}
    mismatched = 0
    for p in prompts:
        ids[p["id"]] = chat_ids(tok, p["text"])
        mismatched += len(ids[p["id"]]) != p["chat_tokens"]
    if mismatched:
        log(f"WARNING: {mismatched} prompts have another chat-templated length with this model's tokenizer than "
            "when they were made (another tokenizer?)")
    contexts = sorted({p["context"] for p in prompts})
    commit_meta = run_meta(args.commit)
    device, commit = commit_meta["device"], commit_meta["commit"]
    meta = dict(commit_meta, model=model_name(spec), model_spec=spec, dtype=args.dtype, batch=args.batch,
                page_size=args.page_size, rules=[r.spec for r in rules], budgets=budgets, budget_ratios=ratios,
                deadline_s=args.deadline, stop_ids=list(stop_ids), prompt_source=prompt_meta,
                prompts_digest=prompts_digest(prompts), chat_length_mismatches=mismatched,
                tables={r.spec: dict(path=r.table_path, model_digest=r.table_digest) for r in rules if r.table},
                skipped=[], calls=[])
    outputs: list[dict] = []
    prompt_rows = [{k: v for k, v in p.items() if k != "text"} for p in prompts]
    res = Results(os.path.join(args.out, f"{args.name}.json"), meta, prompts=prompt_rows, outputs=outputs)
    res.save()

    dense_out: dict[str, str] = {}
    haystack = (prompt_meta.get("haystack") or {}).get("source")
    for context in contexts:
        cps = [p for p in prompts if p["context"] == context]
        longest = max(len(ids[p["id"]]) + p["max_new_tokens"] for p in cps)
        run_b, too_big = budgets_for(context, budgets, ratios, args.page_size)
        for b in too_big:
            meta["skipped"].append(dict(context=context, budget=b, reason="budget >= context: dense by construction"))
        cells = [(r, None) if r.rule == "dense" else (r, b) for r in rules
                 for b in ([None] if r.rule == "dense" else run_b)]
        for rule, budget in cells:
            base = default_cache_config(mc, num_seqs=args.batch, max_tokens=max(context, longest),
                                        page_size=args.page_size, token_budget=budget or 2048, dtype=model.dtype)
            cc = rule.cache_config(base)
            for mn in sorted({p["max_new_tokens"] for p in cps}):
                group = sorted((p for p in cps if p["max_new_tokens"] == mn), key=lambda p: len(ids[p["id"]]))
                label = f"{rule.spec} budget {budget} context {context} max_new {mn} ({len(group)} prompts)"
                elapsed = time.monotonic() - t_start
                if args.deadline is not None and elapsed > args.deadline:
                    meta["skipped"].append(dict(context=context, spec=rule.spec, budget=budget, max_new_tokens=mn,
                                                tasks=sorted({p["task"] for p in group}),
                                                reason=f"deadline {args.deadline} s (at {elapsed:.0f} s)"))
                    res.save()
                    log(f"skip {label}: past the deadline")
                    continue
                t0 = time.perf_counter()
                spec_counts = {}
                if rule.exact:
                    gen, spec_counts = exact_generate(model, [ids[p["id"]] for p in group], mn, cc, rule.exact,
                                                      stop_ids)
                else:
                    gen = ulacache_jax.generate(model, [ids[p["id"]] for p in group], max_new_tokens=mn,
                                                cache_config=cc, attention=rule.attention, stop_ids=stop_ids)
                seconds = time.perf_counter() - t0
                new_tokens = sum(len(g) for g in gen)
                tps = new_tokens / seconds if seconds > 0 else None
                texts = {p["id"]: tok.decode(g) for p, g in zip(group, gen)}
                scores = {p["id"]: ruler_tasks.score(as_prompt(p), texts[p["id"]]) for p in group}
                if rule.rule == "dense":
                    dense_out.update(texts)
                for p in group:
                    outputs.append(dict(id=p["id"], model=model_name(spec), spec=rule.spec, rule=rule.rule,
                                        budget=budget, output=texts[p["id"]], score=scores[p["id"]]))
                meta["calls"].append(dict(context=context, spec=rule.spec, budget=budget, max_new_tokens=mn,
                                          prompts=len(group), new_tokens=new_tokens, seconds=round(seconds, 2)))
                cell_keys = sorted({(p["task"], -1.0 if p["depth"] is None else p["depth"]) for p in group})
                for task, d in cell_keys:
                    depth = None if d == -1.0 else d
                    sel = [p for p in group if p["task"] == task and p["depth"] == depth]
                    same = ([texts[p["id"]] == dense_out[p["id"]] for p in sel]
                            if all(p["id"] in dense_out for p in sel) else None)
                    res.add(dict(model=model_name(spec), attention=rule.attention, rule=rule.rule,
                                 channels=rule.channels, label_bits=rule.label_bits,
                                 two_stage=rule.two_stage, **first_fields(rule),
                                 kv_dtype=str(cc.codec.storage_dtype(cc.dtype)), task=task,
                                 context=context, prompt_tokens=float(np.mean([len(ids[p["id"]]) for p in sel])),
                                 depth=depth, batch=cc.max_seqs, budget=budget, page_size=cc.page_size,
                                 accuracy=float(np.mean([scores[p["id"]] for p in sel])),
                                 same_as_dense=None if same is None else float(np.mean(same)), n=len(sel),
                                 tokens_per_s=tps, device=device, commit=commit, spec=rule.spec,
                                 channel_table=rule.table_path and os.path.basename(rule.table_path),
                                 haystack=haystack, budget_ratio=None if budget is None else budget / context,
                                 seconds=round(seconds, 2), exact=rule.exact, **spec_counts))
                acc = float(np.mean(list(scores.values())))
                same_all = (np.mean([texts[i] == dense_out[i] for i in texts]) if all(i in dense_out for i in texts)
                            else float("nan"))
                log(f"cell {label}: {seconds:.1f} s, {new_tokens} new tokens, accuracy {acc:.3f}, "
                    f"same_as_dense {same_all:.3f}")
    meta["seconds"] = round(time.monotonic() - t_start, 1)
    res.save()
    if res.rows:
        plot(res.rows, os.path.join(args.out, f"{args.name}.png"), model_name(spec))
    print_table(res.rows)
    return dict(meta=meta, rows=res.rows, outputs=outputs)


# ---- report -----------------------------------------------------------------------------------------------------
def summarise(rows) -> list[dict]:
    """Per (spec, budget, context): accuracy and same_as_dense weighted by n over tasks and depths."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["spec"], r["budget"], r["context"]), []).append(r)
    out = []
    for (spec, budget, context), rs in groups.items():
        n = sum(r["n"] for r in rs)
        same = [r for r in rs if r["same_as_dense"] is not None]
        out.append(dict(spec=spec, budget=budget, context=context, n=n,
                        accuracy=sum(r["accuracy"] * r["n"] for r in rs) / n,
                        same_as_dense=(sum(r["same_as_dense"] * r["n"] for r in same) / sum(r["n"] for r in same)
                                       if same else None)))
    return sorted(out, key=lambda s: (s["context"], s["spec"] != "dense", s["spec"], s["budget"] or 0))


def print_table(rows) -> None:
    print(f"{'context':>8} {'rule':<24} {'budget':>7} {'n':>5} {'accuracy':>9} {'same':>6}")
    for s in summarise(rows):
        same = "-" if s["same_as_dense"] is None else f"{s['same_as_dense']:.3f}"
        print(f"{s['context']:>8} {s['spec']:<24} {str(s['budget'] or '-'):>7} {s['n']:>5} {s['accuracy']:>9.3f} "
              f"{same:>6}")


def row_page(row: dict) -> int:
    """A harness row's page size: its `page_size`, or 64 (--page-size's default) for a row written before rows
    recorded it."""
    return row.get("page_size") or 64


def page_series(rows) -> list[dict]:
    """Rows with a spec that ran at several page sizes get the page in their spec (`labels:64:4@p16`), so a plot or
    table keeps those runs apart instead of averaging them; dense, and a spec run at one page size, stay as they are."""
    pages: dict = {}
    for r in rows:
        pages.setdefault(r["spec"], set()).add(row_page(r))
    return [dict(r, spec=f"{r['spec']}@p{row_page(r)}")
            if r["spec"] != "dense" and len(pages[r["spec"]]) > 1 else r for r in rows]


def bar_by_task(ax, rows, tasks) -> None:
    """Grouped bars on `ax`: accuracy of each spec per task (n-weighted over depths and runs), specs in first-seen
    order, n under each task's label."""
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    w = 0.8 / len(specs)
    for k, spec in enumerate(specs):
        acc = []
        for t in tasks:
            rs = [r for r in rows if r["spec"] == spec and r["task"] == t]
            n = sum(r["n"] for r in rs)
            acc.append(sum(r["accuracy"] * r["n"] for r in rs) / n if n else 0.0)
        ax.bar([i + w * k - 0.4 + w / 2 for i in range(len(tasks))], acc, w, label=spec)
    ax.set_xticks(range(len(tasks)), tasks, fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("accuracy (mean score)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)


def plot(rows, path: str, title: str) -> str:
    """One panel per (model, context): bars per task where there are several, else accuracy over budgets per spec."""
    from scripts.bench_meta import pyplot, save_figure
    plt = pyplot()
    panels = sorted({(r.get("model") or "", r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    for ax, (model, context) in zip(axes[0], panels):
        mine = page_series([r for r in rows if (r.get("model") or "") == model and r["context"] == context])
        cs = summarise(mine)
        name = f"{title}{', ' + model if len({m for m, _ in panels}) > 1 else ''}, context {context}"
        tasks = sorted({r["task"] for r in mine})
        if len(tasks) > 1:
            # several tasks: accuracy per task (a line over budgets would average unlike tasks, which need not have
            # run at the same budgets); a bar per spec, and per budget where several ran
            several = len({s["budget"] for s in cs if s["spec"] != "dense"}) > 1
            bar_by_task(ax, [dict(r, spec=f"{r['spec']} @ {r['budget']}") if several and r["budget"] else r
                             for r in mine], tasks)
            ax.set_title(name)
            continue
        for s in cs:
            if s["spec"] == "dense":
                ax.axhline(s["accuracy"], color="k", ls="--", label="dense")
        for spec in sorted({s["spec"] for s in cs if s["spec"] != "dense"}):
            pts = sorted((s["budget"], s["accuracy"]) for s in cs if s["spec"] == spec)
            ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", label=spec)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("token budget")
        ax.set_ylabel("accuracy (mean score)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


# ---- main -------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--make-prompts", metavar="FILE", default=None,
                      help="make the prompts with the model's tokenizer, write them to FILE (never commit it), exit")
    mode.add_argument("--prompts", metavar="FILE", default=None,
                      help="answer the prompts of FILE (from --make-prompts; needs no haystack source)")
    ap.add_argument("--tiny", action="store_true", help="the tiny random preset and the byte tokenizer (tests)")
    ap.add_argument("--tasks", default=None, help=f"comma list of {', '.join(ruler_tasks.TASKS)} (default "
                    f"{DEFAULTS['tasks']}); with --prompts: only these of the file's")
    ap.add_argument("--contexts", default=None,
                    help=f"default {DEFAULTS['contexts']}; with --prompts: only these of the file's")
    ap.add_argument("--depths", default=None, help=f"default {DEFAULTS['depths']}; with --prompts: only these")
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per (task, context, depth)")
    ap.add_argument("--haystack", default="pydoc", help="noise, pydoc, austen or essays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=None, help="max new tokens for every task (default per task)")
    ap.add_argument("--rules", default="dense,quest")
    ap.add_argument("--budgets", default="", help="comma list of token budgets")
    ap.add_argument("--budget-ratios", default="", help="comma list of budget / context ratios")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="cache slots (prompts decoded together)")
    ap.add_argument("--name", default="longctx")
    ap.add_argument("--deadline", type=float, default=None, help="start no generate call after this many seconds")
    # no default --out: --make-prompts writes no results, and a run's rows go where the caller means them to
    return add_common_args(ap, out_default=None, out_default_help="none (needed to run the prompts)",
                           files="NAME.json, NAME.png (--name)", model=None, model_default_help=DEFAULT_MODEL,
                           dtype="bfloat16")


def main(argv=None) -> dict | None:
    args = build_parser().parse_args(argv)
    spec = model_spec(args)
    given = {k: getattr(args, k) for k in DEFAULTS}
    tasks = [t.strip() for t in (given["tasks"] or DEFAULTS["tasks"]).split(",") if t.strip()]
    contexts = [int(c) for c in (given["contexts"] or DEFAULTS["contexts"]).split(",") if c.strip()]
    depths = [float(d) for d in (given["depths"] or DEFAULTS["depths"]).split(",") if d.strip()]
    if args.prompts:
        prompts, pmeta = read_prompt_file(args.prompts)
        pmeta = dict(pmeta, file=os.path.basename(args.prompts))
        if model_name(pmeta.get("model", spec)) != model_name(spec):
            log(f"note: the prompts were made with {pmeta.get('model')}'s tokenizer, the model is {spec}")
        # --tasks / --contexts / --depths given: a subset of the file (a run split over several device calls)
        keep = [p for p in prompts if (not given["tasks"] or p["task"] in tasks)
                and (not given["contexts"] or p["context"] in contexts)
                and (not given["depths"] or p["depth"] is None or p["depth"] in depths)]
        if len(keep) != len(prompts):
            pmeta = dict(pmeta, subset={k: v for k, v in given.items() if v})
            prompts = keep
        if not prompts:
            raise SystemExit(f"{args.prompts}: no prompts left after --tasks / --contexts / --depths")
    else:
        t0 = time.perf_counter()
        tok = load_tokenizer(spec)
        prompts, hay = make_prompts(tok, tasks=tasks, contexts=contexts, depths=depths, num_prompts=args.num_prompts,
                                    haystack=args.haystack, seed=args.seed, max_new=args.max_new)
        pmeta = dict(model=spec, tasks=tasks, contexts=contexts, depths=depths, num_prompts=args.num_prompts,
                     seed=args.seed, haystack=hay)
        log(f"{len(prompts)} prompts made in {time.perf_counter() - t0:.1f} s")
        if args.make_prompts:
            write_prompt_file(args.make_prompts, prompts, pmeta)
            log(f"wrote {args.make_prompts} (holds haystack text: never commit it)")
            return None
    if not args.out:
        raise SystemExit("--out DIR is needed to run the prompts")
    return run(args, prompts, pmeta)


if __name__ == "__main__":
    main()
