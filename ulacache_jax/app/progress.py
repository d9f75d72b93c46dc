"""Progress of a `ulacache generate` run without a terminal (a batch scheduler's log): one line every `every`
seconds on stderr, requests done of the total, generated tokens/s since the engine started, running / queued,
and the HBM hit rate so far (sparse). On a terminal the tqdm bar shows the same; `--no-progress` silences both."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, TextIO


@dataclasses.dataclass
class ProgressLog:
    """Call `update(done, tokens, engine)` after every engine step; it prints at most once per `every` seconds
    (and `close` prints a last line when anything was printed, so a log ends with the final count)."""
    total: int
    every: float = 10.0
    stream: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)
    clock: Callable[[], float] = time.monotonic
    _last: float | None = None
    _printed: bool = False
    _line: str = ""

    def __post_init__(self):
        if not (self.every > 0):
            raise ValueError(f"progress interval = {self.every!r} s must be > 0")
        self._last = self.clock()

    def line(self, done: int, tokens: int, engine) -> str:
        el = engine.elapsed()
        rate = f"{tokens / el:.1f} tok/s" if el > 0 else "- tok/s"
        tot = engine.stats_totals()
        sel = tot["hits"] + tot["misses"]
        hit = f", HBM hit rate {tot['hits'] / sel:.3f}" if sel else ""
        return (f"ulacache: {done}/{self.total} requests done, {tokens} tokens, {rate}, {engine.num_running} running, "
                f"{engine.num_queued} queued{hit}")

    def update(self, done: int, tokens: int, engine) -> None:
        now = self.clock()
        self._line = self.line(done, tokens, engine)
        if now - self._last >= self.every:
            print(self._line, file=self.stream, flush=True)
            self._last, self._printed = now, True

    def close(self) -> None:
        if self._printed and self._line:
            print(self._line, file=self.stream, flush=True)
