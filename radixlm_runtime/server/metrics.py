"""Counters, gauges and histograms rendered in the Prometheus text exposition format.

Small enough to write by hand, which keeps prometheus_client out of the dependencies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


@dataclass
class ServerMetrics:
    requests_total: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    requests_rejected_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_inflight: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    def render(self) -> str:
        hit_rate = self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines])

        metric(
            "radixlm_requests_total",
            "counter",
            "Generation requests accepted (each of n samples).",
            [f"radixlm_requests_total {self.requests_total}"],
        )
        metric(
            "radixlm_requests_finished_total",
            "counter",
            "Finished requests by finish reason.",
            [
                f'radixlm_requests_finished_total{{reason="{k}"}} {v}'
                for k, v in sorted(self.requests_finished.items())
            ],
        )
        metric(
            "radixlm_requests_rejected_total",
            "counter",
            "Requests refused because the queue was full.",
            [f"radixlm_requests_rejected_total {self.requests_rejected_total}"],
        )
        for name, value, help_text in (
            ("radixlm_prompt_tokens_total", self.prompt_tokens_total, "Prompt tokens of finished requests."),
            ("radixlm_generation_tokens_total", self.generation_tokens_total, "Generated tokens."),
            (
                "radixlm_cached_tokens_total",
                self.cached_tokens_total,
                "Prompt tokens served from the radix cache.",
            ),
        ):
            metric(name, "counter", help_text, [f"{name} {value}"])
        for name, value, help_text in (
            ("radixlm_cache_hit_rate", hit_rate, "cached_tokens_total / prompt_tokens_total."),
            ("radixlm_num_queue_reqs", self.num_waiting, "Requests waiting in the scheduler queue."),
            ("radixlm_num_running_reqs", self.num_running, "Requests in the running (decode) batch."),
            (
                "radixlm_num_inflight_reqs",
                self.num_inflight,
                "Requests accepted by the server and not finished.",
            ),
        ):
            metric(name, "gauge", help_text, [f"{name} {value}"])
        for name, hist, help_text in (
            ("radixlm_time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
            (
                "radixlm_inter_token_latency_seconds",
                self.itl,
                "Time between consecutive tokens of a request.",
            ),
            ("radixlm_e2e_request_latency_seconds", self.e2e, "Time from arrival to the last token."),
        ):
            metric(name, "histogram", help_text, hist.render(name))
        return "\n".join(out) + "\n"
