"""Prometheus export of `KvCanary.stats` (the ``prometheus`` extra)."""

from __future__ import annotations

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("kv-canary: the Prometheus export needs prometheus_client; pip install 'torch_kvcanary[prometheus]'") from error

_HELP = {
    "record_calls": "KvCanary.record calls",
    "verify_calls": "KvCanary.verify calls",
    "slots_recorded": "slots recorded",
    "slots_verified": "slots verified (padding not counted)",
    "violations": "violations flagged, including those dropped from a full ring",
    "ring_overflow": "violations dropped because the ring was full",
}
_GAUGES = {"ring_write": "violation rows waiting for the next poll"}


class CanaryCollector(Collector):
    """Reads the canary's device counters at each scrape: ``kvcanary_<name>_total`` counters
    and the ``kvcanary_ring_pending`` gauge, labelled ``canary=<name>``."""

    def __init__(self, canary):
        self._canary = canary

    def collect(self):
        stats = self._canary.stats()
        label = [self._canary.name]
        for key, text in _HELP.items():
            family = CounterMetricFamily(f"kvcanary_{key}", text, labels=["canary"])
            family.add_metric(label, stats[key])
            yield family
        for key, text in _GAUGES.items():
            family = GaugeMetricFamily("kvcanary_ring_pending", text, labels=["canary"])
            family.add_metric(label, stats[key])
            yield family
