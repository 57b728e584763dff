"""The gauge of whether the canary is on (``vllm:kv_canary_enabled``, `connector.stats`): 1
from the engine's start, with the policy and the KV role as labels; 0 once a worker's canary
has turned itself off, whatever the other workers and the later steps report; and the
connector of a worker whose canary is off reports it at every step."""

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from torch_kvcanary.integrations.vllm import config  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import CanaryPromMetrics, CanaryStats  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.facade import KvCanaryConnector  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.guard import Guard  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.stats import OFF  # noqa: E402

LABELS = {"model_name": "tiny", "engine": "0"}


def _metrics(registry: CollectorRegistry, kv_role: str) -> CanaryPromMetrics:
    """The connector's metrics in ``registry``, as vLLM's API server builds them for one engine."""
    metric_types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=kv_role))
    return CanaryPromMetrics(vllm_config, metric_types, list(LABELS), {0: list(LABELS.values())})


def _step(off: bool = False) -> CanaryStats:
    stats = CanaryStats()
    stats.data["slots_verified"] = 10
    stats.data[OFF] = int(off)
    return stats


def test_the_gauge_is_on_from_the_start_and_off_for_good_once_a_worker_turns_off(monkeypatch):
    monkeypatch.setenv(config.POLICY_ENV, "quarantine")
    registry = CollectorRegistry()
    metrics = _metrics(registry, "kv_producer")
    labels = {**LABELS, "policy": "quarantine", "kv_role": "kv_producer"}

    def enabled():
        return registry.get_sample_value("vllm:kv_canary_enabled", labels)

    assert enabled() == 1
    metrics.observe(_step().aggregate(_step()).data)
    assert enabled() == 1
    metrics.observe(_step().aggregate(_step(off=True)).data)  # the second of two workers turned off
    assert enabled() == 0
    metrics.observe(_step().data)  # a step whose stats say nothing of it
    assert enabled() == 0
    assert registry.get_sample_value("vllm:kv_canary_slots_verified_total", LABELS) == 50  # 2 + 2 + 1 steps of 10


def test_a_worker_whose_canary_is_off_says_so_at_every_step():
    connector = object.__new__(KvCanaryConnector)  # the worker side's state that the stats read, without an engine
    connector.port, connector._verifier, connector.stats, connector.guard = SimpleNamespace(watching=False), None, CanaryStats(), Guard()
    for _ in range(2):
        taken = connector.get_kv_connector_stats()
        assert taken is not None and taken.data[OFF] == 1 and "kv_canary_off" in taken.reduce()
    connector.port = SimpleNamespace(watching=True, counters=lambda: {"slots_verified": 0, "slots_recorded": 0})
    connector._verified = connector._recorded = 0
    assert connector.get_kv_connector_stats() is None
