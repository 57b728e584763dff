"""The engine of the KV connector's tests: a tiny engine of vLLM's CPU build started in-process
with the plugin and `KvCanaryConnector` in float32 (`connector_engine`) and the error of one
that refuses to start (`refused_start`), a clean run's answers (`clean_answers`), what the worker's
connector reports as load errors step by step (`Reported`), the worker's connector, and
vLLM's Prometheus metrics of the canary (of the running engine, or of given stats: `exported`)."""

import contextlib
import functools
from types import SimpleNamespace

import pytest
import vllm
from engine_driver import BLOCK_SIZE, CANARY_BYTES_PER_SLOT, KV_BYTES_PER_SLOT, NUM_BLOCKS, started_engine

from torch_kvcanary.integrations.vllm import config, connector, plugin

# K and V of float32, twice bf16's bytes; the canary's records beside them.
FLOAT32_BUDGET = NUM_BLOCKS * BLOCK_SIZE * (2 * KV_BYTES_PER_SLOT + CANARY_BYTES_PER_SLOT) + 1024 * 11 * 8 + 4096
FAILURE_POLICY = {"repair": "recompute", "quarantine": "fail"}


@contextlib.contextmanager
def connector_engine(model, policy: str, *, failure_policy: str | None = None, environ: dict[str, str] | None = None, **options):
    """An in-process float32 engine with the plugin under ``policy`` and `KvCanaryConnector`
    configured with ``failure_policy`` (by default the one ``policy`` needs), vLLM's stats
    on (its Prometheus metrics in ``prometheus_client.REGISTRY``)."""
    transfer = {
        "kv_connector": config.CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": failure_policy or FAILURE_POLICY.get(policy, "recompute"),
    }
    settings = dict(dtype="float32", async_scheduling=False, disable_log_stats=False, kv_transfer_config=transfer)
    with started_engine(model, kv_budget=FLOAT32_BUDGET, policy=policy, environ=environ, **{**settings, **options}) as started:
        yield started


def refused_start(model, policy: str, **options) -> ValueError:
    """The ValueError behind the exception `connector_engine` raised starting with ``options``."""
    with pytest.raises(Exception) as raised:
        with connector_engine(model, policy, **options):
            pass
    error = raised.value
    while error is not None and not isinstance(error, ValueError):
        error = error.__cause__ or error.__context__
    assert error is not None, f"{type(raised.value).__name__}: {raised.value}"
    return error


class Reported:
    """What the worker's connector returned from get_block_ids_with_load_errors, step by step."""

    def __init__(self, monkeypatch, worker_connector):
        self.steps: list[set[int]] = []
        original = worker_connector.get_block_ids_with_load_errors

        def recording():
            blocks = original()
            self.steps.append(set(blocks))
            return blocks

        monkeypatch.setattr(worker_connector, "get_block_ids_with_load_errors", recording)

    def take(self) -> set[int]:
        blocks = set().union(*self.steps)
        self.steps.clear()
        return blocks


def _greedy(max_tokens: int):
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def clean_answers(llm, prompts: list[list[int]], max_tokens: int) -> list:
    """The greedy tokens of ``prompts`` run through ``llm`` without a fault, the prefix cache
    then emptied (the runs after it compute their KV again)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens), use_tqdm=False)
    llm.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in outputs]


def _worker_connector():
    state = plugin.active()
    assert isinstance(state.connector, connector.KvCanaryConnector)
    return state.connector


def _metric(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return sum(
        sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def summed_counts(name: str, label: str, *counts: dict) -> tuple[dict, dict[str, float]]:
    """Workers' `CanaryStats` of ``counts`` each (`CanaryStats.add_counts`; none empty),
    summed as vLLM's output aggregator sums them: the line vLLM's stats log prints of the sum
    (`CanaryStats.reduce`), and the samples of counter ``name`` that `exported` shows of it,
    by their value of ``label`` (each of engine "0" and model "tiny")."""
    from prometheus_client.parser import text_string_to_metric_families

    from torch_kvcanary.integrations.vllm.connector import stats

    workers = [stats.CanaryStats() for _ in counts]
    for worker, count in zip(workers, counts):
        worker.add_counts(count)
        assert not worker.is_empty(), count
    for worker in workers[1:]:
        workers[0].aggregate(worker)
    by = {}
    for family in text_string_to_metric_families(exported(workers[0].data)):
        for sample in family.samples:
            if sample.name == name:
                assert {k: v for k, v in sample.labels.items() if k != label} == {"engine": "0", "model_name": "tiny"}, sample
                by[sample.labels[label]] = sample.value
    return workers[0].reduce(), by


def exported(data: dict, kv_role: str = "kv_consumer") -> str:
    """The text /metrics shows of one engine's canary stats ``data`` (`CanaryStats.data`),
    exported by the plugin's `CanaryPromMetrics` into a registry of its own (engine "0",
    model "tiny")."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from torch_kvcanary.integrations.vllm.connector import stats

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role=kv_role))
    metrics = stats.CanaryPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    metrics.observe(data, 0)
    return generate_latest(registry).decode()
