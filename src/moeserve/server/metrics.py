"""Prometheus metrics of the server, on a registry of its own (never the process-global one).

Counters and histograms are updated by the request path; the engine's figures (running and
waiting requests, KV slots) are read from `Engine.kv_stats()` when /metrics is scraped.

KV usage: `moeserve_kv_request_slots` counts the KV slots that requests hold for themselves;
slots that only the prefix cache holds (reusable, evicted on demand) are counted apart in
`moeserve_kv_prefix_cached_slots`. Once no request is in flight the first is 0, whatever the
prefix cache keeps; `moeserve_kv_used_slots` is their sum, `moeserve_kv_usage_ratio` that sum over
the pool.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "moeserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, int]], in_flight: Callable[[], int]) -> None:
        self.stats, self.in_flight = stats, in_flight

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        used, cached = s.get("used_slots", 0), s.get("prefix_cached_slots", 0)
        total = s.get("total_slots", 0)
        yield _gauge("num_requests_running", "Requests prefilling or decoding in the engine.",
                     s.get("running", 0))
        yield _gauge("num_requests_waiting", "Requests queued in the engine's schedulers.",
                     s.get("waiting", 0))
        yield _gauge("num_requests_in_flight", "Sequences the server has submitted and not yet "
                     "seen finish (n choices count n).", self.in_flight())
        yield _gauge("kv_request_slots", "KV slots held by requests (prefix-cache-only slots "
                     "excluded).", max(0, used - cached))
        yield _gauge("kv_prefix_cached_slots", "KV slots in the prefix cache.", cached)
        yield _gauge("kv_used_slots", "KV slots in use: requests and prefix cache.", used)
        yield _gauge("kv_total_slots", "KV slots in the pool.", total)
        yield _gauge("kv_usage_ratio", "Used over total KV slots.", used / total if total else 0.0)
        retracted = CounterMetricFamily(f"{PREFIX}_retracted_requests", "Requests preempted "
                                        "(KV given up, recomputed later) since the start.")
        retracted.add_metric([], s.get("retracted", 0))
        yield retracted


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
    g.add_metric([], value)
    return g


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by endpoint and status "
                                "code.", ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{PREFIX}_sequences_finished", "Sequences (one per choice) by "
                                "finish reason.", ["reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of submitted "
                                     "sequences.", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_prompt_cached_tokens", "Prompt tokens served "
                                     "from the prefix cache.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From submission to the "
                              "first generated token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between consecutive "
                             "generated tokens of a sequence.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "From submission to the "
                             "finish of a sequence.", buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats, in_flight))

    def render(self) -> bytes:
        return generate_latest(self.registry)
