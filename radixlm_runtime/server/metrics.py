"""The server's Prometheus metrics (prometheus-client), recorded by the TokenizerManager.

Each ServerMetrics owns its registry: tests run several servers and apps in one process, and the
global default registry would refuse the second app's metric names.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from radixlm_runtime.io.finish import FinishKind

# generate_latest writes the 0.0.4 text format whatever prometheus-client's CONTENT_TYPE_LATEST says.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TTFT_BUCKETS += (20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1)
ITL_BUCKETS += (0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# The KV memory as the scheduler process counts it (scheduler.info()): (info key, metric, help).
KV_GAUGES = (
    ("cached_tokens_in_tree", "radixlm_kv_pool_cached_tokens", "Tokens the radix tree holds in the KV pool."),
    ("free_tokens", "radixlm_kv_pool_free_tokens", "Free KV pool slots."),
    ("host_tier_tokens", "radixlm_kv_host_tier_size_tokens", "Slots of the host KV tier (0: none)."),
    ("cached_tokens_on_host", "radixlm_kv_host_tier_cached_tokens", "Tokens cached in the host tier."),
    ("disk_tier_tokens", "radixlm_kv_disk_tier_size_tokens", "Slots of the disk KV tier (0: none)."),
    ("cached_tokens_on_disk", "radixlm_kv_disk_tier_cached_tokens", "Tokens cached in the disk tier."),
)
KV_COUNTERS = (
    ("device_hit_tokens", "radixlm_kv_pool_hit_tokens", "Prompt tokens admitted from the KV pool."),
    ("host_hit_tokens", "radixlm_kv_host_tier_hit_tokens", "Prompt tokens loaded back from the host tier."),
    ("host_stored_tokens", "radixlm_kv_host_tier_stored_tokens", "Tokens copied to the host tier."),
    ("host_loaded_tokens", "radixlm_kv_host_tier_loaded_tokens", "Tokens copied back from the host tier."),
    ("host_evicted_tokens", "radixlm_kv_host_tier_evicted_tokens", "Tokens dropped from the host tier."),
    ("host_stored_bytes", "radixlm_kv_host_tier_stored_bytes", "KV bytes copied to the host tier."),
    ("host_loaded_bytes", "radixlm_kv_host_tier_loaded_bytes", "KV bytes copied back from the host tier."),
    ("disk_hit_tokens", "radixlm_kv_disk_tier_hit_tokens", "Prompt tokens read back from the disk tier."),
    ("disk_stored_tokens", "radixlm_kv_disk_tier_stored_tokens", "Tokens written to the disk tier."),
    ("disk_loaded_tokens", "radixlm_kv_disk_tier_loaded_tokens", "Tokens read back from the disk tier."),
    ("disk_evicted_tokens", "radixlm_kv_disk_tier_evicted_tokens", "Tokens dropped from the disk tier."),
    (
        "disk_failed_tokens",
        "radixlm_kv_disk_tier_failed_tokens",
        "Tokens dropped: disk entry corrupt.",
    ),
    ("disk_stored_bytes", "radixlm_kv_disk_tier_stored_bytes", "KV bytes written to the disk tier."),
    ("disk_loaded_bytes", "radixlm_kv_disk_tier_loaded_bytes", "KV bytes read back from the disk tier."),
)
# (count key, sum key, metric, help): summaries of latencies the scheduler process totals.
KV_SUMMARIES = (
    (
        "disk_reads",
        "disk_read_seconds",
        "radixlm_kv_disk_tier_load_seconds",
        "Wall time of reading a request's prefix from the disk tier into the host tier.",
    ),
)


class KVCollector:
    """The scheduler process's KV counters, as of the last `observe` (each /metrics scrape asks the
    scheduler for them first): they live in another process, so they are collected, not counted here."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def observe(self, info: dict[str, Any]) -> None:
        self.info = info

    def collect(self) -> Iterator[Metric]:
        for key, name, help_text in KV_GAUGES:
            if key in self.info:
                yield GaugeMetricFamily(name, help_text, value=self.info[key])
        for key, name, help_text in KV_COUNTERS:
            if key in self.info:
                yield CounterMetricFamily(name, help_text, value=self.info[key])
        for count, total, name, help_text in KV_SUMMARIES:
            if count in self.info:
                yield SummaryMetricFamily(
                    name, help_text, count_value=self.info[count], sum_value=self.info[total]
                )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.kv = KVCollector()
        self.registry.register(self.kv)
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        # Counter names omit `_total`: prometheus-client appends it to the exposed sample.
        self.requests = counter(
            "radixlm_requests",
            "Generation requests accepted (each of n samples), and requests whose client hung up while "
            "sending the body.",
        )
        self.finished = counter(
            "radixlm_requests_finished",
            "Ended requests by finish reason; abort includes requests whose client went away.",
            ["finish_reason"],
        )
        for kind in get_args(FinishKind):
            self.finished.labels(kind)
        self.rejected = counter("radixlm_requests_rejected", "Requests refused because the queue was full.")
        self.prompt_tokens = counter("radixlm_prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("radixlm_generation_tokens", "Generated tokens.")
        self.cached_tokens = counter(
            "radixlm_cached_tokens", "Prompt tokens of ended requests served from the radix cache."
        )
        self.cache_hit_rate = gauge("radixlm_cache_hit_rate", "cached_tokens_total / prompt_tokens_total.")
        self.num_running = gauge("radixlm_num_running_reqs", "Requests in the running (decode) batch.")
        self.num_waiting = gauge("radixlm_num_queue_reqs", "Requests waiting in the scheduler queue.")
        self.num_inflight = gauge(
            "radixlm_num_inflight_reqs", "Requests accepted by the server and not ended."
        )
        self.ttft = histogram(
            "radixlm_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS,
        )
        self.itl = histogram(
            "radixlm_inter_token_latency_seconds",
            "Time between consecutive tokens of a request (one observation per token after the first).",
            buckets=ITL_BUCKETS,
        )
        self.e2e = histogram(
            "radixlm_e2e_request_latency_seconds",
            "Time from arrival to the end of the request, whatever its finish reason.",
            buckets=E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "radixlm_queue_time_seconds",
            "Time from the scheduler receiving a request to its first scheduled step.",
            buckets=QUEUE_BUCKETS,
        )
        self.spec_verify_steps = counter(
            "radixlm_spec_verify_steps",
            "Speculative decoding: decode forwards that verified a prompt-lookup draft (ended requests).",
        )
        self.spec_draft_tokens = counter(
            "radixlm_spec_draft_tokens", "Speculative decoding: draft tokens proposed (ended requests)."
        )
        self.spec_accepted_tokens = counter(
            "radixlm_spec_accepted_tokens",
            "Speculative decoding: draft tokens accepted, each an output token without a forward of its own.",
        )
        self.spec_accept_rate = gauge(
            "radixlm_spec_accept_rate", "spec_accepted_tokens_total / spec_draft_tokens_total."
        )
        # Running totals for the rates: reading a Counter back is not part of its API.
        self._prompt_total = 0
        self._cached_total = 0
        self._drafted_total = 0
        self._accepted_total = 0

    def tokens_out(self, n: int, since_arrival: float, since_last: float | None) -> None:
        """n new tokens of one request: its first token's TTFT, then the gap per token since its
        previous output (several tokens arrive at once after a jump-forward)."""
        self.generation_tokens.inc(n)
        if n and since_last is None:
            self.ttft.observe(since_arrival)
            n, since_last = n - 1, 0.0
        for _ in range(n):
            self.itl.observe(since_last / n)

    def request_ended(self, kind: FinishKind, prompt_tokens: int, cached_tokens: int, e2e: float) -> None:
        """Called exactly once per accepted request, including those abandoned by their client."""
        self.finished.labels(kind).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        if self._prompt_total:
            self.cache_hit_rate.set(self._cached_total / self._prompt_total)
        self.e2e.observe(e2e)

    def disconnected_before_admission(self) -> None:
        """A client that hung up while still sending its body: one request, ended by abort. Nothing
        ran for it, so no latency is observed."""
        self.requests.inc()
        self.finished.labels("abort").inc()

    def speculation_ended(self, verify_steps: int, drafted: int, accepted: int) -> None:
        """An ended request's speculative decoding totals."""
        self.spec_verify_steps.inc(verify_steps)
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        self._drafted_total += drafted
        self._accepted_total += accepted
        if self._drafted_total:
            self.spec_accept_rate.set(self._accepted_total / self._drafted_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
