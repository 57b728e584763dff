"""The Prometheus rules (deploy/prometheus/kv_canary.rules.yml) and the Grafana dashboard
(deploy/grafana/kv_canary.json) against a real Prometheus (Debian's `prometheus`, on
127.0.0.1) scraping a real `vllm serve` with the plugin under ``repair`` and
`KvCanaryConnector`: the server exports the canary's gauge as on, under ``repair``; a byte
flipped in a cached block (`testing.metrics_capture`'s fault), which ``repair``
heals, takes KvCanaryCorruptionRepaired, a warning, from inactive to firing while every other
alert stays inactive (nothing pages), the recording rules give the counts the server
exported, and every dashboard panel's PromQL answers with data; then a block-table entry
pointed at another request's block (the chaos injector's ``table`` fault) leaves the server
serving and pages once, KvCanaryMappingViolation. `make test-prometheus` runs it.

Prometheus (`prometheus_driver.Prometheus`) scrapes and evaluates every second and loads a
copy of the rules whose alerts' ``for`` is one second (the shipped durations are minutes); the
expressions are the shipped ones.
"""

import concurrent.futures
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-prometheus runs these tests in the vLLM venv")
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed here: make test-prometheus runs these tests in the vLLM venv")
pytestmark = pytest.mark.prometheus

from prometheus_driver import RULES, Prometheus  # noqa: E402

from torch_kvcanary.testing.metrics_capture import PROMPT, connector_server, flip, read_flipped  # noqa: E402
from torch_kvcanary.testing.serve import collective_rpc, install_flip_plugin  # noqa: E402
from torch_kvcanary.testing.soak.harness import install_chaos_plugin  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy/grafana/kv_canary.json"
# What Grafana puts in the dashboard's variables: every instance, a window of 60 scrapes.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".+"}
# increase() extrapolates a counter's rise to the end of its window, by up to 1.1 scrape
# intervals over the span of its samples: with `HISTORY` scrapes before the fault, the
# recorded counts may exceed the exported ones by this.
HISTORY = 15
EXTRAPOLATION = 1.25


def _if_firing(states: dict[str, str], names: set[str]) -> dict[str, str] | None:
    """``states`` (`Prometheus.alert_states`) if every alert of ``names`` fires there, else None."""
    return states if all(states[name] == "firing" for name in names) else None


def _recorded(prometheus: Prometheus, record: str, exported: float) -> float:
    """The recording rule ``record``'s value once it has reached ``exported``, the count the
    server exported: the recording group evaluates on its own schedule, so its last value
    may predate the scrape the alerting group already saw."""
    prometheus.wait_for(lambda: prometheus.value(record) >= exported, f"{record} reaching {exported}")
    return prometheus.value(record)


def _alert_names() -> set[str]:
    return {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule}


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    """A `vllm serve` with the fault plugins and a Prometheus scraping it, both stopped after the module."""
    site = install_chaos_plugin(install_flip_plugin(tmp_path_factory.mktemp("site")))
    with (
        connector_server(tiny_llama, site) as server,
        Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.port}") as prometheus,
    ):
        yield server, prometheus


def test_a_flipped_byte_fires_the_alerts_and_is_recorded(stack):
    server, prometheus = stack
    assert "error" not in server.complete(PROMPT, 4)  # its blocks stay in the prefix cache
    prometheus.wait_for(lambda: prometheus.query("vllm:kv_canary_slots_verified_total > 0"), "the server's verified slots scraped")
    history = f"count_over_time(vllm:kv_canary_slots_verified_total[1m]) >= {HISTORY}"
    prometheus.wait_for(lambda: prometheus.query(history), f"{HISTORY} scrapes")
    states = prometheus.wait_for(lambda: prometheus.alert_states(), "the alerting rules loaded")
    assert set(states) == _alert_names() and set(states.values()) == {"inactive"}, states
    enabled = prometheus.query("vllm:kv_canary_enabled")
    assert [(dict(labels)["policy"], dict(labels)["kv_role"], value) for labels, value in enabled.items()] == [("repair", "kv_both", 1)]

    flip(server)
    assert all("error" not in answer for answer in read_flipped(server))
    violations = server.metric("vllm:kv_canary_violations_total", reason="verify_real_kv_hash")
    repaired = server.metric("vllm:kv_canary_blocks_repaired_total")
    assert violations >= 1 and repaired >= 1

    firing = {"KvCanaryCorruptionRepaired"}
    states = prometheus.wait_for(lambda: _if_firing(prometheus.alert_states(), firing), f"{firing} firing")
    assert {name for name, state in states.items() if state != "inactive"} == firing, states
    severities = {dict(labels)["severity"] for labels in prometheus.query('ALERTS{alertstate="firing"}')}
    assert severities == {"warning"}, severities

    recorded = _recorded(prometheus, 'model_name_reason:vllm_kv_canary_violations:increase10m{reason="verify_real_kv_hash"}', violations)
    assert violations <= recorded <= violations * EXTRAPOLATION, (recorded, violations)
    recorded = _recorded(prometheus, "model_name:vllm_kv_canary_blocks_repaired:increase1h", repaired)
    assert repaired <= recorded <= repaired * EXTRAPOLATION, (recorded, repaired)
    assert prometheus.value('model_name_reason:vllm_kv_canary_violations:increase10m{reason="verify_token"}') == 0
    assert prometheus.value("model_name:vllm_kv_canary_slots_verified:rate5m") > 0


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _expr(target: dict) -> str:
    expr = target["expr"]
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable the test does not fill: {target['expr']}"
    return expr


def test_every_dashboard_panel_answers_with_data(stack):
    server, prometheus = stack
    assert "error" not in server.complete(list(range(300, 340)), 8)
    # rate() and increase() need two samples in their window.
    prometheus.wait_for(lambda: prometheus.query("count_over_time(vllm:kv_canary_slots_verified_total[1m]) >= 2"), "two scrapes")
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(panel["title"], target) for panel in _panels(dashboard) for target in panel.get("targets", [])]
    assert len(targets) >= 5
    for title, target in targets:
        answer = prometheus.query(_expr(target))
        assert answer, f"panel {title!r}: no data for {target['expr']}"
        assert all(math.isfinite(value) for value in answer.values()), (title, answer)


def test_a_mapping_fault_pages_once(stack):
    server, prometheus = stack
    collective_rpc(server, "chaos_arm", "table")
    prompts = [list(range(120 + 90 * i, 160 + 90 * i)) for i in range(4)]  # past a block each: a full block to point elsewhere
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: server.complete(prompt, 16), prompts))
    assert all("error" not in answer for answer in answers), answers  # repair recomputes the reader
    assert "error" not in server.complete(PROMPT[:20], 4) and server.alive()
    mapped = lambda: sum(server.metric("vllm:kv_canary_violations_total", reason=r) for r in ("verify_token", "verify_chain_hash"))  # noqa: E731
    prometheus.wait_for(lambda: mapped() >= 1, "the server counting the mapping violation")

    firing = {"KvCanaryMappingViolation"}
    prometheus.wait_for(lambda: _if_firing(prometheus.alert_states(), firing), f"{firing} firing")
    pages = prometheus.query('ALERTS{alertstate="firing", severity="critical"}')
    assert [dict(labels)["alertname"] for labels in pages] == ["KvCanaryMappingViolation"], pages
