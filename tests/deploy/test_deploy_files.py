"""The operators' files agree with what the plugin exports and with the docs: the promtool
tests' input series (deploy/prometheus/tests/kv_canary.rules.test.yml) are named and labelled
as in a real server's /metrics (deploy/prometheus/tests/vllm_metrics.txt, captured by
tools/vllm_metrics_capture.py); every metric the rules and the dashboard read is exported, and every label value they select
is one the exporter can give; every alert has a severity, a summary and a runbook link to a
heading of docs/operators.md."""

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed here: make test-prometheus runs these tests in the vLLM venv")
pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy/prometheus"
RULES = PROMETHEUS / "kv_canary.rules.yml"
RULE_TESTS = PROMETHEUS / "tests/kv_canary.rules.test.yml"
CAPTURED = PROMETHEUS / "tests/vllm_metrics.txt"
DASHBOARD = REPO / "deploy/grafana/kv_canary.json"
GUIDE = REPO / "docs/operators.md"
# The labels Prometheus adds to every scraped series, and the series it makes itself (a
# blackbox exporter's probe of /health: probe_success).
TARGET_LABELS = {"instance", "job"}
PROMETHEUS_SERIES = {"up": TARGET_LABELS, "probe_success": TARGET_LABELS}

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?(?: (\S+))?$")
LABEL = re.compile(r'\s*([a-zA-Z_]\w*)\s*=\s*"([^"]*)"\s*,?')
METRIC = re.compile(r"\bvllm:[a-z_:]+")
SELECTOR = re.compile(r"\b(vllm:[a-z_:]+)\{([^}]*)\}")


def _series(text: str) -> tuple[str, dict[str, str]]:
    match = SAMPLE.match(text.strip())
    assert match, text
    return match[1], dict(LABEL.findall(match[2] or ""))


def _captured() -> dict[str, list[dict[str, str]]]:
    """Each metric of the captured /metrics and the labels of each of its series."""
    found: dict[str, list[dict[str, str]]] = {}
    for line in CAPTURED.read_text().splitlines():
        if line and not line.startswith("#"):
            name, labels = _series(line)
            found.setdefault(name, []).append(labels)
    return found


def test_the_capture_is_a_canary_servers():
    captured = _captured()
    assert {labels["reason"] for labels in captured["vllm:kv_canary_violations_total"]} >= {"verify_real_kv_hash", "verify_token"}
    assert "vllm:kv_canary_drills_caught_total" in captured and "vllm:generation_tokens_total" in captured


def test_the_rule_tests_input_series_are_named_and_labelled_as_exported():
    captured = _captured()
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    inputs = [_series(series["series"]) for test in tests for series in test["input_series"]]
    assert inputs
    for name, labels in inputs:
        if name in PROMETHEUS_SERIES:
            assert set(labels) == PROMETHEUS_SERIES[name], (name, labels)
            continue
        assert name in captured, f"{name} is not in the captured /metrics"
        assert TARGET_LABELS <= set(labels), (name, labels)
        exported = {key: value for key, value in labels.items() if key not in TARGET_LABELS}
        assert any(set(exported) == set(series) for series in captured[name]), (name, labels, captured[name][0])
        if "reason" in exported:
            assert exported["reason"] in {series["reason"] for series in captured[name]}, (name, labels)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_rules_and_the_dashboard_read_only_exported_metrics():
    captured = set(_captured())
    exprs = [rule["expr"] for rule in _rules()] + _dashboard_exprs()
    read = {name for expr in exprs for name in METRIC.findall(expr)}
    assert read >= {"vllm:kv_canary_violations_total", "vllm:kv_canary_drills_caught_total"}
    assert read <= captured, read - captured


def _selectable_values(label: str, captured: dict[str, list[dict[str, str]]], metric: str) -> set[str]:
    """The values ``metric``'s ``label`` can take: the plugin's policies and vLLM's KV roles for
    the canary's gauge (the capture is one server's), else those of the captured series."""
    if (metric, label) == ("vllm:kv_canary_enabled", "policy"):
        from torch_kvcanary.integrations.vllm.config import POLICIES

        return set(POLICIES)
    if (metric, label) == ("vllm:kv_canary_enabled", "kv_role"):
        from typing import get_args

        from vllm.config.kv_transfer import KVRole

        return {role for literal in get_args(KVRole) for role in (get_args(literal) or (literal,))}
    return {series[label] for series in captured[metric] if label in series}


def test_every_label_value_the_rules_select_is_one_the_exporter_gives():
    pytest.importorskip("vllm", reason="vLLM is not installed here: make test-prometheus runs these tests in the vLLM venv")
    captured = _captured()
    selected = [selector for rule in _rules() for selector in SELECTOR.findall(rule["expr"])]
    assert {metric for metric, _ in selected} >= {"vllm:kv_canary_enabled", "vllm:kv_canary_violations_total"}
    for metric, matchers in selected:
        for label, value in re.findall(r'(\w+)\s*!?=\s*"([^"]*)"', matchers):
            assert value in _selectable_values(label, captured, metric), (metric, label, value)


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_alert_has_a_severity_a_summary_and_a_runbook_in_the_guide():
    anchors = _anchors(GUIDE.read_text())
    alerts = [rule for rule in _rules() if "alert" in rule]
    assert len(alerts) >= 8
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert alert["annotations"]["summary"].startswith("kv-canary: "), alert["alert"]
        page, anchor = alert["annotations"]["runbook_url"].split("#")
        assert page == "docs/operators.md" and anchor == alert["alert"].lower() and anchor in anchors, (alert["alert"], sorted(anchors))
