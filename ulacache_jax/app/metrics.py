"""Serving metrics in Prometheus' text format (`prometheus-client`), one CollectorRegistry per server.

Two kinds of figures:
- request figures (running / queued requests, time to first token, inter-token latency, end-to-end latency,
  prompt and generated tokens, finish reasons), observed by the engine thread as requests progress;
- cache figures (HBM hits and misses, so the hit rate; selected and fetched pages; PCIe bytes each way; host
  pool, HBM frame pool and slot occupancy; prefix-cache hit tokens; speculative drafts proposed and accepted), read from the
  Engine after each step into a snapshot that a custom collector reports on each scrape.

The cache figures mean what the run report's do (app/report.py): hits and misses count selected, flushed pages
(tail-ring pages are not selected), host->HBM bytes = fetched pages x page_bytes x 2 (K and V), HBM->host
write-through bytes = pages completed by finished requests x page_bytes x 2, less the pages a shared prefix
attached (never written again). With the dense cache nothing crosses PCIe: those figures stay 0.
"""
from __future__ import annotations

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "ulacache"
# seconds: decode chunks are tens of ms on the H200 and seconds on CPU; first tokens wait for a whole prefill
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclasses.dataclass
class CacheSnapshot:
    """Cumulative cache figures since the server started (CacheSnapshot() = nothing yet)."""
    hits: int = 0
    misses: int = 0
    fetched_pages: int = 0
    overflow_reads: int = 0
    decode_steps: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    slots_used: int = 0
    slots_total: int = 0
    host_pages_used: int = 0
    host_pages_total: int = 0
    host_pages_of_requests: int = 0
    hbm_frames_used: int = 0
    hbm_frames_total: int = 0


class _CacheCollector:
    """Reports the latest CacheSnapshot at each scrape (the engine thread replaces it after each step)."""

    def __init__(self, metrics: "ServingMetrics"):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot()
        p = PREFIX

        def counter(name, doc, value):
            m = CounterMetricFamily(f"{p}_{name}", doc)
            m.add_metric([], value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(f"{p}_{name}", doc)
            m.add_metric([], value)
            return m

        yield counter("hbm_hits", "selected pages found in the HBM frame pool", s.hits)
        yield counter("hbm_misses", "selected pages fetched from the host pool", s.misses)
        sel = s.hits + s.misses
        yield gauge("hbm_hit_rate", "HBM hits / selected pages since start (NaN before any)",
                    s.hits / sel if sel else float("nan"))
        yield counter("selected_pages", "pages selected, summed over layers, KV groups and decode steps", sel)
        yield counter("decode_steps", "decode steps run (selected_pages / decode_steps = pages a step)",
                      s.decode_steps)
        yield counter("fetched_pages", "pages copied host -> HBM", s.fetched_pages)
        yield counter("overflow_reads", "selected pages read past a full HBM pool", s.overflow_reads)
        yield counter("pcie_h2d_bytes", "bytes host -> HBM (fetched pages x page_bytes x 2)", s.h2d_bytes)
        yield counter("pcie_d2h_bytes", "bytes HBM -> host (completed pages written through x page_bytes x 2)",
                      s.d2h_bytes)
        yield counter("prefix_cache_hit_tokens", "prompt tokens attached from stored prefixes, not prefilled",
                      s.prefix_hit_tokens)
        yield counter("spec_proposed_tokens", "speculative draft tokens verified", s.spec_proposed)
        yield counter("spec_accepted_tokens", "speculative draft tokens accepted", s.spec_accepted)
        yield gauge("slots_used", "sequence slots held by requests", s.slots_used)
        yield gauge("slots_total", "sequence slots (max_seqs)", s.slots_total)
        yield gauge("host_pages_used", "host pool pages in use (requests and stored prefixes)", s.host_pages_used)
        yield gauge("host_pages_of_requests", "host pool pages held by running requests", s.host_pages_of_requests)
        yield gauge("host_pages_total", "host pool pages (0: the dense cache has no host tier)", s.host_pages_total)
        yield gauge("hbm_frames_used", "HBM frames holding a page (all ranks; stored prefix pages stay until evicted)",
                    s.hbm_frames_used)
        yield gauge("hbm_frames_total", "HBM frames (all ranks; 0: the dense cache has no frame pool)",
                    s.hbm_frames_total)


class ServingMetrics:
    """The server's metrics over its own registry (no module globals: two servers in one process do not mix)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = PREFIX
        self.running = Gauge(f"{p}_requests_running", "requests holding a sequence slot", registry=r)
        self.queued = Gauge(f"{p}_requests_queued", "requests accepted and waiting for a slot", registry=r)
        self.requests = Counter(f"{p}_requests", "engine requests finished, by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter(f"{p}_http_rejected", "HTTP requests refused, by status", ["status"], registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "request accepted -> first token (queue included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds",
                             "time between a request's deliveries / tokens delivered, one observation a token",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}_request_latency_seconds", "request accepted -> finished", buckets=E2E_BUCKETS,
                             registry=r)
        self.ready = Gauge(f"{p}_ready", "1 once the serving programs are compiled (the warm-up request ran)",
                           registry=r)
        self._lock = threading.Lock()
        self._snap = CacheSnapshot()
        r.register(_CacheCollector(self))

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            return self._snap

    def set_snapshot(self, snap: CacheSnapshot) -> None:
        with self._lock:
            self._snap = snap

    def render(self) -> bytes:
        return generate_latest(self.registry)
