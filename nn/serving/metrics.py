"""Prometheus metrics of the serving stack (``GET /metrics``), on a private registry.

Counters and histograms are fed by the HTTP layer as requests run (requests by endpoint
and status, prompt and generated tokens, time to first token, inter-token latency,
request duration); the engine's occupancy (running requests, queue depth, batch
occupancy, KV slots / blocks / tokens in use, cached KV blocks, steps, prefix-cache hit and
miss tokens) is read from
:meth:`~deviceops.nn.Engine.stats` at every scrape.

With one engine per device (``serve --devices``) every engine series carries a
``device`` label (``deviceops_kv_slots_in_use{device="cuda:1"}``; same metric names), and
two more per-device gauges say whether the engine serves
(``deviceops_engine_up``, 0 once it failed) and the work the router compares
(``deviceops_engine_pending_tokens``). With Ray replicas (``serve --ray``) the label is
``replica`` instead (``deviceops_kv_slots_in_use{replica="r1"}``). The HTTP series
(requests, tokens, latencies) are for the whole server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "DeviceStats", "ServeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass(frozen=True)
class DeviceStats:
    """One per-device engine at scrape time (``serve --devices``).

    Attributes:
        device: the device's name, the ``device`` label (``"cuda:0"``, ``"cpu:1"``).
        stats: the engine's :class:`~.requests.EngineStats`, or ``None`` when it never
            loaded.
        up: the engine serves (not failed, not closed).
        pending_tokens: the engine's queued and running work in tokens (routing load).
        label: the label's name: ``"device"``, or ``"replica"`` for Ray replicas
            (``serve --ray``, :mod:`.ray_front`).
    """

    device: str
    stats: Any
    up: bool
    pending_tokens: int
    label: str = "device"


def _gauges(st: Any) -> dict[str, tuple[str, float]]:
    return {
        "deviceops_engine_running_requests": ("requests holding a KV slot", st.running),
        "deviceops_engine_queued_requests": ("requests waiting for a slot", st.queued),
        "deviceops_engine_batch_occupancy": (
            "running requests / max_batch", st.running / max(1, st.max_batch)),
        "deviceops_engine_max_batch": ("KV slots (max concurrent requests)", st.max_batch),
        "deviceops_kv_slots_in_use": ("KV-cache slots (batch rows) held", st.slots_in_use),
        "deviceops_kv_blocks_in_use": (
            "KV blocks held by running requests (paged cache; reserved at admission; a block "
            "shared through the prefix cache counts once)", st.kv_blocks_in_use),
        "deviceops_kv_blocks_cached": (
            "KV blocks in the prefix cache, in use by requests or idle (idle ones are evicted, "
            "least recently used first, when admission needs blocks)",
            getattr(st, "kv_blocks_cached", 0)),
        "deviceops_kv_blocks_total": (
            "KV blocks of the pool (0: a step model without paged memory)",
            getattr(st, "kv_blocks_total", 0)),
        "deviceops_kv_tokens_in_use": (
            "KV positions written by the sequences holding slots", st.kv_tokens_in_use),
    }


def _counters(st: Any) -> dict[str, tuple[str, float]]:
    return {
        "deviceops_engine_steps": ("engine steps run", st.steps),
        "deviceops_engine_decode_rows": ("decode rows computed (sum of batch sizes)",
                                         st.decode_rows),
        "deviceops_engine_prefill_tokens": ("prompt tokens prefilled", st.prefill_tokens),
        "deviceops_prefix_cache_hit_tokens": (
            "prompt tokens whose KV blocks came from the prefix cache (not prefilled)",
            getattr(st, "prefix_cache_hit_tokens", 0)),
        "deviceops_prefix_cache_miss_tokens": (
            "prompt tokens prefilled by requests that looked the prefix cache up (its misses; "
            "the block holding a prompt's last token is always prefilled)",
            getattr(st, "prefix_cache_miss_tokens", 0)),
    }


class _EngineCollector(Collector):
    """Engine series read from the engines' stats at scrape time (none before loading).

    ``stats()`` returns ``None`` (loading), one engine's stats (unlabelled series), or a
    sequence of :class:`DeviceStats` (series labelled by ``device``).
    """

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        got = self._stats()
        if got is None:
            return
        if not isinstance(got, Sequence):
            for name, (doc, v) in _gauges(got).items():
                yield GaugeMetricFamily(name, doc, value=float(v))
            for name, (doc, v) in _counters(got).items():
                yield CounterMetricFamily(name, doc, value=float(v))
            yield from _phases([("", got)], None)
            return
        rows: list[DeviceStats] = list(got)
        label = rows[0].label if rows else "device"
        up = GaugeMetricFamily("deviceops_engine_up",
                               "1 while the device's engine serves, 0 once it failed or closed",
                               labels=[label])
        pending = GaugeMetricFamily(
            "deviceops_engine_pending_tokens",
            "queued and running work in tokens (prompt left to prefill + max tokens left to "
            "generate); requests go to the device where it is smallest", labels=[label])
        for row in rows:
            up.add_metric([row.device], 1.0 if row.up else 0.0)
            pending.add_metric([row.device], float(row.pending_tokens))
        yield up
        yield pending
        loaded = [r for r in rows if r.stats is not None]
        if not loaded:
            return
        for kind, table in ((GaugeMetricFamily, _gauges), (CounterMetricFamily, _counters)):
            fams: dict[str, Any] = {}
            for row in loaded:
                for name, (doc, v) in table(row.stats).items():
                    fam = fams.get(name)
                    if fam is None:
                        fam = fams[name] = kind(name, doc, labels=[label])
                    fam.add_metric([row.device], float(v))
            yield from fams.values()
        yield from _phases([(r.device, r.stats) for r in loaded], label)


def _phases(rows: Sequence[tuple[str, Any]], label: str | None) -> Iterator[Any]:
    """``deviceops_engine_host_seconds{phase}``: the steps' host time by phase."""
    labels = ["phase"] if label is None else [label, "phase"]
    fam = CounterMetricFamily(
        "deviceops_engine_host_seconds",
        "host seconds of the engine's steps by phase: admit, enqueue (build and launch the "
        "decode and prompt chunks), wait (for the device's results), deliver (tokens to "
        "requests), and an engine core's recv (front messages) and send (step messages)",
        labels=labels)
    seen = False
    for dev, st in rows:
        for phase, secs in getattr(st, "host_phases", ()):
            fam.add_metric([phase] if label is None else [dev, phase], float(secs))
            seen = True
    if seen:
        yield fam


class ServeMetrics:
    """The server's metrics; :meth:`render` gives the Prometheus text exposition.

    Args:
        stats: returns the engine's :class:`~.requests.EngineStats`, or ``None`` while
            the model is loading, or (one engine per device) a sequence of
            :class:`DeviceStats`, whose series get a ``device`` label.
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
