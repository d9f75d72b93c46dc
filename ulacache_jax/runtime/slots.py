"""The Engine's slot table: each sequence slot's decode inputs, host side, and the request that holds it.

Public (DESIGN.md section 8: the Engine over a public slot table) so that the speculative step
(speculative/decoder.py) and the checkpoint (checkpoint.py) read and write a slot's state through it instead of
reaching into the Engine. Plain numpy arrays of one entry a slot, handed to the compiled decode chunk and
verification as they are: a slot that no request decodes in has done = True, remaining = 0 and greedy sampling.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp

from ulacache_jax.runtime.sampling import SamplingArrays, row_keys


@dataclasses.dataclass(eq=False)
class SlotTable:
    tok: np.ndarray               # [S] int32: the slot's last token, its next decode input
    done: np.ndarray              # [S] bool: no request decodes in the slot (free, or its request just ended)
    remaining: np.ndarray         # [S] int32: tokens its request may still generate
    temperature: np.ndarray       # [S] float32
    top_p: np.ndarray             # [S] float32
    top_k: np.ndarray             # [S] int32
    min_p: np.ndarray             # [S] float32
    presence: np.ndarray          # [S] float32
    frequency: np.ndarray         # [S] float32
    repetition: np.ndarray        # [S] float32
    penalized: np.ndarray         # [S] bool: the request uses a penalty (the chunk carries token counts)
    logprobs: np.ndarray          # [S] int32: alternatives asked for, -1 = logprobs off
    budget: np.ndarray            # [S] int32: pages the slot's request selects a step, 0 = the engine's budget
    seed: np.ndarray              # [S] uint32: the running request's effective seed
    chunk: np.ndarray             # [S] uint32: its decode chunks so far (with seed and phase, its RNG state:
                                  # row_keys); a chunk shorter than a page counts once its page's steps are done
    phase: np.ndarray             # [S] int32: its decode steps since its last flush point (< page_size; 0 where
                                  # every chunk is a page: Program._decode)
    request_of: dict[int, int] = dataclasses.field(default_factory=dict)   # slot -> id of the request holding it

    @classmethod
    def empty(cls, num_slots: int) -> "SlotTable":
        S = num_slots
        return cls(tok=np.zeros(S, np.int32), done=np.ones(S, bool), remaining=np.zeros(S, np.int32),
                   temperature=np.zeros(S, np.float32), top_p=np.ones(S, np.float32), top_k=np.zeros(S, np.int32),
                   min_p=np.zeros(S, np.float32), presence=np.zeros(S, np.float32),
                   frequency=np.zeros(S, np.float32), repetition=np.ones(S, np.float32),
                   penalized=np.zeros(S, bool), logprobs=np.full(S, -1, np.int32), budget=np.zeros(S, np.int32),
                   seed=np.zeros(S, np.uint32), chunk=np.zeros(S, np.uint32), phase=np.zeros(S, np.int32))

    def running(self) -> list[tuple[int, int]]:
        """(slot, request id) of every slot whose request is decoding, in admission order."""
        return [(s, r) for s, r in self.request_of.items() if not self.done[s]]

    def any_running(self) -> bool:
        return any(not self.done[s] for s in self.request_of)

    def start(self, slot: int, tok: int, remaining: int, sampling, budget_pages: int = 0) -> None:
        """The slot decodes from `tok` with `remaining` tokens to go under `sampling` (engine.SamplingParams),
        selecting `budget_pages` pages a step (0 = the engine's budget)."""
        self.budget[slot] = budget_pages
        self.tok[slot], self.done[slot], self.remaining[slot], self.phase[slot] = tok, False, remaining, 0
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = sampling.temperature, sampling.top_p, sampling.top_k
        self.min_p[slot], self.presence[slot] = sampling.min_p, sampling.presence_penalty
        self.frequency[slot], self.repetition[slot] = sampling.frequency_penalty, sampling.repetition_penalty
        self.penalized[slot] = sampling.penalized
        self.logprobs[slot] = -1 if sampling.logprobs is None else sampling.logprobs

    def clear(self, slot: int) -> None:
        """The slot is free: no request, not decoding, greedy."""
        self.request_of.pop(slot, None)
        self.done[slot] = True
        self.remaining[slot] = self.phase[slot] = 0
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = 0.0, 1.0, 0
        self.min_p[slot], self.presence[slot], self.frequency[slot], self.repetition[slot] = 0.0, 0.0, 0.0, 1.0
        self.penalized[slot], self.logprobs[slot], self.budget[slot] = False, -1, 0

    def sampling_arrays(self) -> SamplingArrays:
        """Every slot's sampling parameters as device arrays [S] (the compiled programs' per-slot input)."""
        return SamplingArrays(*(jnp.asarray(a) for a in (self.temperature, self.top_p, self.top_k, self.min_p,
                                                         self.presence, self.frequency, self.repetition)))

    def penalties_on(self) -> bool:
        """Some running slot uses a penalty: the chunk must be the program that carries token counts."""
        return any(self.penalized[s] for s, _ in self.running())

    def budgets(self, select_pages: int) -> np.ndarray | None:
        """Every slot's pages a step [S] int32 (select_pages where the engine's budget), or None when every running
        slot selects select_pages (the chunk then runs the program without per-slot budgets)."""
        if not any(0 < self.budget[s] < select_pages for s, _ in self.running()):
            return None
        return np.where(self.budget > 0, np.minimum(self.budget, select_pages), select_pages).astype(np.int32)

    def logprobs_on(self) -> bool:
        """Some running slot asked for logprobs: the chunk must be the program that returns them."""
        return any(self.logprobs[s] >= 0 for s, _ in self.running())

    def keys(self):
        """Every slot's key for its next decode chunk [S] (sampling.row_keys of its seed and chunk count)."""
        return row_keys(jnp.asarray(self.seed), jnp.asarray(self.chunk))

    def advance(self, steps: int, page_size: int, decoded: np.ndarray) -> None:
        """After a decode chunk of `steps` steps: the slots that decoded in it (decoded [S] bool) move their phase
        on; where it reaches page_size (a flush point) it wraps and the chunk counter advances."""
        phase = self.phase + np.where(decoded, steps, 0)
        self.chunk += (phase >= page_size).astype(np.uint32)
        self.phase = (phase % page_size).astype(np.int32)
