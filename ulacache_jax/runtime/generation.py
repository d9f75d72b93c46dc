"""generate(): prompts in, tokens out, on the Engine's path (continuous batching over one Generator).

The Generator (generator.py) holds the model, the cache backend and the one compiled program; the Engine
(engine.py) schedules requests over its slots; generate() adds every prompt to an Engine and runs it to the end.
Tensor parallelism is `tp=N` (the model and the cache head-sharded over N local devices, tp.py).
"""
from __future__ import annotations

import dataclasses


from ulacache_jax.cache.config import CacheConfig
from ulacache_jax.runtime.cost_model import pool_headroom
from ulacache_jax.cache.decode_layer import DecodeOptions
from ulacache_jax.runtime.engine import Engine, SamplingParams
from ulacache_jax.runtime.generator import DenseCache, Generator, bucket_length, bucket_pages, default_cache_config  # noqa: F401
from ulacache_jax.runtime import validate
from ulacache_jax.runtime.speculative.rules import SpecConfig, target_attention
from ulacache_jax.runtime.text import check_stop_strings, encode_prompt, is_text
from ulacache_jax.runtime.tp import check_tp, prepare_model

MAX_BATCH = 8   # default cache slots of generate(): prompts beyond it queue (continuous batching)


def _tp_cache_config(cache_config: CacheConfig, tp: int, num_kv_heads: int, orig_kv_heads: int) -> CacheConfig:
    """A given cache config for `tp` ranks: it may say tp = 1 or tp; its num_kv_heads is the model's, scaled when
    prepare_model replicated the KV heads."""
    if cache_config.tp not in (1, tp):
        raise ValueError(f"cache_config.tp = {cache_config.tp} but tp = {tp}")
    one = dataclasses.replace(cache_config, tp=1)
    if num_kv_heads != orig_kv_heads and one.num_kv_heads == orig_kv_heads:
        one = dataclasses.replace(one, num_kv_heads=num_kv_heads)
    check_tp(one, tp)
    return dataclasses.replace(one, tp=tp)


def generate(model, prompts, *, max_new_tokens: int, tokenizer=None, stop=(), stop_ids=None,
             cache_config: CacheConfig | None = None, attention: str = "auto", tp: int = 1,
             token_budget: int = 2048, page_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, options: DecodeOptions = DecodeOptions(), mesh=None,
             speculative=None, min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, logprobs: int | None = None, kv_dtype: str = "auto") -> list:
    """Generate up to max_new_tokens tokens for each prompt.

    prompts: a list of token-id lists -> a list of token-id lists; or, with a tokenizer, a list of texts (str)
    or chats (lists of {"role", "content"} messages, rendered by the tokenizer's chat template) -> a list of
    generated texts. stop_ids end a sequence (the stop token is kept); None = the tokenizer's end-of-text and
    end-of-turn ids (e.g. SmolLM2's <|im_end|>), or none without a tokenizer. stop: strings that end a sequence
    once its text holds one (needs the tokenizer; the text is cut before it).
    attention="auto" (the default) picks one of the two below when the engine is built, from its batch, max
    context, model and device memory (cost_model.resolve_attention; the HBM pool sized for it), never mid-sequence;
    attention="sparse" decodes with UlaCache (query-aware page selection over a two-tier cache);
    attention="dense" is the baseline with the same model and every K/V in HBM. tp: tensor-parallel ranks (local
    devices). Without a cache_config, one is sized for these prompts (`default_cache_config`: up to 8 slots,
    `token_budget` tokens attended per step, `page_size` None = 64, or 16 for contexts up to 512 tokens); more
    prompts than slots queue and are admitted as slots free up. A request's tokens do not depend on what shares
    its batch; sampled tokens are seeded by `seed` and the prompt's index. speculative: a
    speculative.SpecConfig (drafts verified K + 1 rows at a time; greedy tokens equal plain decoding's in float32;
    with deterministic=True, those of SpecConfig("none", K, deterministic=True) in any dtype), None = off;
    SpecConfig("sparse") is exact mode: sparse attention drafts, dense attention verifies (attention "auto" means
    dense then), so the tokens are dense decoding's.
    min_p, presence_penalty, frequency_penalty, repetition_penalty, logprobs: as SamplingParams' (the penalties
    and logprobs are refused with speculative decoding); with logprobs (an int k), each output is a pair (tokens or
    text, list of requests.TokenLogprob: each token's raw model logprob and the k best alternatives).
    kv_dtype: the K/V page format (CacheConfig.kv_dtype, cache/codec.py): "auto" (the model's dtype, or a given
    cache_config's) or "float8_e4m3fn" (e4m3 with a scale per page and KV head: half of bf16's bytes)."""
    validate.check_model(model)
    tp = validate.check_tp_count(tp)
    validate.check_speculative(speculative, SpecConfig)
    attention = target_attention(speculative, attention)      # exact mode verifies with dense attention
    k0 = model.config.num_kv_heads
    model = prepare_model(model, tp)
    mc = model.config
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError("prompts must be a list of prompts (token-id lists, or texts / chats with a tokenizer)")
    as_text = len(prompts) > 0 and all(is_text(p) for p in prompts)
    stop = check_stop_strings(stop)
    if stop and tokenizer is None:
        raise ValueError(f"stop strings {stop!r} need a tokenizer to decode the text (pass tokenizer=...)")
    # token ids are checked as given (a flat id list or float ids are refused, not reinterpreted); texts and chats
    # once encoded
    prompts = validate.check_prompt_batch([encode_prompt(p, tokenizer) for p in prompts] if as_text else prompts,
                                          mc.vocab_size)
    max_new_tokens = validate.check_max_new_tokens(max_new_tokens)
    temperature, top_p, top_k = validate.check_sampling_args(temperature, top_p, top_k, mc.vocab_size)
    seed = validate.check_seed(seed)
    try:       # the options' checks (SamplingParams.check), before the engine is built
        SamplingParams(min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       repetition_penalty=repetition_penalty, logprobs=logprobs).check(mc.vocab_size)
    except ValueError as e:
        raise ValueError(str(e)) from None
    if stop_ids is not None:
        stop_ids = validate.check_stop_ids(stop_ids, mc.vocab_size)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if cache_config is None:
        n = len(prompts)
        cache_config = default_cache_config(mc, num_seqs=bucket_length(n, 1) if n <= MAX_BATCH else MAX_BATCH,
                                            max_tokens=longest, page_size=page_size, token_budget=token_budget,
                                            dtype=model.dtype, tp=tp, pool_headroom=pool_headroom(attention),
                                            kv_dtype=kv_dtype)
    else:
        cache_config = _tp_cache_config(cache_config, tp, mc.num_kv_heads, k0)
        if kv_dtype != "auto":
            cache_config = dataclasses.replace(cache_config, kv_dtype=kv_dtype)
    if longest > cache_config.max_context:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds the cache's max context "
                         f"{cache_config.max_context} (max_pages_per_seq x page_size)")
    if speculative is not None:
        # as the Engine does for a model: a verification attends 1 + K rows per sequence in one call, whose
        # overflow pages the cache stages too (a user never sizes the cache for an option of generate)
        cache_config = dataclasses.replace(cache_config, verify_rows=max(cache_config.verify_rows,
                                                                         speculative.num_tokens + 1))
    engine = Engine(generator=Generator(model, cache_config, attention=attention, options=options, mesh=mesh),
                    seed=seed, tokenizer=tokenizer, speculative=speculative)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_ids=None if stop_ids is None else tuple(int(t) for t in stop_ids), stop=stop,
                            min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty, logprobs=logprobs)
    out = []
    for req in engine.run(prompts, params):
        if req.finish_reason == "error":
            raise ValueError(f"prompt {req.request_id}: {req.error}")
        res = req.text if as_text else req.tokens
        out.append(res if logprobs is None else (res, req.logprobs))
    return out
