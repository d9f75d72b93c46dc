"""What a request is, on its way through the Engine and back: its sampling parameters (checked at the boundary),
its progress and timings, what one step did for it, and the timeline entry of one step. Kept apart from the
Engine so that checkpoint.py (which saves and restores requests) and the Engine (which saves checkpoints) import
each other's parts at module level, with no cycle."""
from __future__ import annotations

import dataclasses

import numpy as np

from ulacache_jax.runtime.sampling import MAX_LOGPROBS, check_extra, check_sampling
from ulacache_jax.runtime.text import check_stop_strings

STOP = "stop"
LENGTH = "length"
ERROR = "error"
FINISH_REASONS = (STOP, LENGTH, ERROR)
ATTENTION_KINDS = ("sparse", "dense")     # a request's attention (None: the engine's token budget)


class RequestError(ValueError):
    """A request that can never run (bad parameters, or too big for the cache); the message says why."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters. temperature 0 = greedy; top_k 0 = off; seed None = derived from the
    engine seed and the request id; stop_ids end the request (the stop token is kept in its tokens; None = the
    engine's default: its tokenizer's end-of-text and end-of-turn ids, else none); stop strings end it once its
    decoded text holds one (needs the engine's tokenizer; the tokens kept are the fewest that complete it).
    min_p: keep the tokens with p >= min_p * p_max (after temperature; 0 = off). presence_penalty and
    frequency_penalty (OpenAI semantics, in [-2, 2]) over the generated tokens; repetition_penalty (HF / vLLM, > 0,
    1 = off) over the prompt and the generated tokens; the order is sampling.py's (vLLM's). logprobs: None = off;
    k >= 0 returns, for every generated token, its raw model logprob (log-softmax of the logits before penalties
    and temperature, as vLLM by default) and the k best tokens' (Request.logprobs). token_budget: tokens attended
    per decode step for this request (a multiple of page_size, at most the engine's token_budget; None = the
    engine's); attention "dense" attends every page (needs the engine's budget >= the request's context),
    "sparse" or None the budget."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    token_budget: int | None = None
    attention: str | None = None

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the decode then runs its program with per-slot token counts)."""
        return (float(self.presence_penalty) != 0.0 or float(self.frequency_penalty) != 0.0
                or float(self.repetition_penalty) != 1.0)

    def check(self, vocab_size: int) -> None:
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise RequestError(f"max_new_tokens = {m!r} must be an int >= 1")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise RequestError(f"{name} = {v!r} must be a number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise RequestError(f"top_k = {self.top_k!r} must be an int")
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise RequestError(f"{name} = {v!r} must be a number")
        try:
            check_sampling(float(self.temperature), float(self.top_p), int(self.top_k), vocab_size)
            check_extra(float(self.min_p), float(self.presence_penalty), float(self.frequency_penalty),
                        float(self.repetition_penalty))
        except ValueError as e:
            raise RequestError(str(e)) from None
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, np.integer))
                               or not 0 <= lp <= min(MAX_LOGPROBS, vocab_size)):
            raise RequestError(f"logprobs = {lp!r} must be None or an int in [0, {min(MAX_LOGPROBS, vocab_size)}]")
        tb = self.token_budget
        if tb is not None and (isinstance(tb, bool) or not isinstance(tb, (int, np.integer)) or tb < 1):
            raise RequestError(f"token_budget = {tb!r} must be None or an int >= 1")
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise RequestError(f"attention = {self.attention!r} must be None, 'sparse' or 'dense'")
        if self.attention == "dense" and tb is not None:
            raise RequestError(f"attention = 'dense' attends every page: give no token_budget (it is {tb})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or not 0 <= self.seed < 2**32):
            # the seed becomes a uint32 PRNG key: one outside [0, 2**32) would be taken modulo, silently another's
            raise RequestError(f"seed = {self.seed!r} must be None or an int in [0, 2**32)")
        for t in self.stop_ids or ():
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
                raise RequestError(f"stop id {t!r} must be an int in [0, vocab_size = {vocab_size})")
        try:
            check_stop_strings(self.stop)
        except ValueError as e:
            raise RequestError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's raw model logprob and the `top` best tokens' (token id, logprob), best first; len(top)
    is the request's `logprobs`."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class Request:
    """One request's prompt, parameters, progress and timings (perf_counter seconds)."""
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int = 0                  # effective: sampling.max_new_tokens capped to the context limit
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)   # aligned with tokens (logprobs on)
    status: str = "queued"                   # queued | running | finished
    finish_reason: str | None = None         # stop | length | error
    error: str | None = None
    capped: bool = False                     # max_new_tokens was lowered to fit the context limit
    text: str | None = None                  # the generated text (engines with a tokenizer), cut before a stop string
    stop_reason: str | None = None           # the stop string that ended it
    slot: int | None = None
    t_added: float = 0.0
    t_admitted: float | None = None
    t_first_token: float | None = None
    t_finished: float | None = None
    deliveries: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)  # (time, tokens, step)

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step did for one request: the tokens it produced and, if it ended, why."""
    request_id: int
    new_tokens: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: tuple[TokenLogprob, ...] = ()     # aligned with new_tokens where the request asked for logprobs


@dataclasses.dataclass
class StepRecord:
    """Timeline entry of one step (seconds since the engine started). A decode chunk runs decode_steps steps
    (page_size, or fewer for a last chunk) for the whole slot batch (finished slots are masked), so
    decode_s / decode_steps is the step time."""
    index: int
    t_start: float
    t_end: float = 0.0
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_compiled: bool = False           # a prompt-length bucket seen for the first time (includes compile)
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0                   # tokens produced by the chunk (first tokens come from prefill)
    decode_compiled: bool = False            # first chunk of this length in this engine (includes compile)
    live_slots: int = 0
    hits: int = 0
    misses: int = 0
    overflow: int = 0
    fetched: int = 0
    queued: int = 0
    running: int = 0
    finished: int = 0

    @property
    def compiled(self) -> bool:
        return self.prefill_compiled or self.decode_compiled

    @property
    def tokens(self) -> int:
        return self.decode_tokens + self.prefills
