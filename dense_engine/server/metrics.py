"""What /metrics reports (Prometheus' text format, a registry of the server's own)."""

from __future__ import annotations

import time


class Metrics:
    """What /metrics reports, in Prometheus' text format (prometheus_client, a registry of the server's own):
    requests by status, prompt and generated tokens, prefixes reused (from the rows and the prefix store: hits,
    tokens, the store's bytes and evictions), the queue and the busy rows, time to first token and the time between
    tokens (seconds, histograms)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("dense_requests", "Completion requests answered, by HTTP status", ["status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("dense_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("dense_generated_tokens", "Tokens generated", registry=self.registry)
        self.prefix_hits = Counter("dense_prefix_hits",
                                   "Requests whose row's cache already held a prefix of the prompt",
                                   registry=self.registry)
        self.reused_tokens = Counter("dense_prefix_reused_tokens", "Prompt tokens found in a row's cache or the "
                                     "prefix store (not prefilled again)", registry=self.registry)
        self.stored_tokens = Counter("dense_prefix_store_reused_tokens", "Prompt tokens copied from the prefix "
                                     "store into a row (part of dense_prefix_reused_tokens)", registry=self.registry)
        self.disk_tokens = Counter("dense_prefix_disk_read_tokens", "Prompt tokens read back from the prefix "
                                   "store's disk files", registry=self.registry)
        self.evictions = Counter("dense_prefix_store_evictions", "Blocks dropped from the prefix store to make room",
                                 registry=self.registry)
        self.store_bytes = Gauge("dense_prefix_store_bytes", "Bytes of keys and values the prefix store holds",
                                 registry=self.registry)
        self.queue = Gauge("dense_queue_depth", "Requests waiting for a row", registry=self.registry)
        self.busy = Gauge("dense_busy_rows", "Cache rows running a request", registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("dense_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("dense_inter_token_latency_seconds", "Between a request's consecutive tokens",
                             buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)

    def watch(self, scheduler) -> None:
        self.queue.set_function(scheduler.waiting.qsize)
        self.busy.set_function(lambda: sum(r is not None for r in scheduler.requests))
        self.store_bytes.set_function(lambda: scheduler.store.bytes if scheduler.store is not None else 0)

    def token(self, request) -> None:
        """A request's new token (called by the scheduler)."""
        now = time.perf_counter()
        timing = request.timing
        if timing.last_token_at is None:
            self.ttft.observe(now - timing.arrived)
            timing.first_token_at = now
        else:
            self.itl.observe(now - timing.last_token_at)
        timing.last_token_at = now
        self.generated_tokens.inc()

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
