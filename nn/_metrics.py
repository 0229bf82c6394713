"""Prometheus metrics of the serving stack (``GET /metrics``), on a private registry.

Counters and histograms are fed by the HTTP layer as requests run (requests by endpoint
and status, prompt and generated tokens, time to first token, inter-token latency,
request duration); the engine's occupancy (running requests, queue depth, batch
occupancy, KV slots / blocks / tokens in use, steps) is read from
:meth:`~deviceops.nn.Engine.stats` at every scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


class _EngineCollector(Collector):
    """Gauges read from the engine's stats at scrape time (none before it is loaded)."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        st = self._stats()
        if st is None:
            return
        gauges = {
            "deviceops_engine_running_requests": ("requests holding a KV slot", st.running),
            "deviceops_engine_queued_requests": ("requests waiting for a slot", st.queued),
            "deviceops_engine_batch_occupancy": (
                "running requests / max_batch", st.running / max(1, st.max_batch)),
            "deviceops_engine_max_batch": ("KV slots (max concurrent requests)", st.max_batch),
            "deviceops_kv_slots_in_use": ("KV-cache slots (batch rows) held", st.slots_in_use),
            "deviceops_kv_blocks_in_use": (
                "KV blocks held by running requests (paged cache; reserved at admission)",
                st.kv_blocks_in_use),
            "deviceops_kv_blocks_total": (
                "KV blocks of the pool (0: a step model without paged memory)",
                getattr(st, "kv_blocks_total", 0)),
            "deviceops_kv_tokens_in_use": (
                "KV positions written by the sequences holding slots", st.kv_tokens_in_use),
        }
        for name, (doc, v) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(v))
        counters = {
            "deviceops_engine_steps": ("engine steps run", st.steps),
            "deviceops_engine_decode_rows": ("decode rows computed (sum of batch sizes)",
                                             st.decode_rows),
            "deviceops_engine_prefill_tokens": ("prompt tokens prefilled", st.prefill_tokens),
        }
        for name, (doc, v) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(v))


class ServeMetrics:
    """The server's metrics; :meth:`render` gives the Prometheus text exposition.

    Args:
        stats: returns the engine's :class:`~._requests.EngineStats`, or ``None`` while
            the model is loading.
    """

    def __init__(self, stats: Callable[[], Any]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "deviceops_http_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r)
        self.finished = Counter(
            "deviceops_generations", "generations by finish reason (stop, length, cancelled)",
            ["reason"], registry=r)
        self.prompt_tokens = Counter(
            "deviceops_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter(
            "deviceops_generated_tokens", "tokens generated and sent", registry=r)
        self.ttft = Histogram(
            "deviceops_time_to_first_token_seconds",
            "request arrival to first generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "deviceops_inter_token_latency_seconds",
            "time between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram(
            "deviceops_request_duration_seconds", "request arrival to last token",
            buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
