"""The vLLM plugin without vLLM: its switches (KVCANARY_VLLM, KVCANARY_VLLM_MODE,
KVCANARY_VLLM_SUMMARY_S), what each policy needs of the engine, the vLLM versions it starts on, the one module that imports vLLM,
the canary's share of the KV cache memory, and how violations are logged."""

import ast
import dataclasses
import math
import re
import sys
from fractions import Fraction

import pytest
import torch
from helpers import REPO

import torch_kvcanary as kc
from torch_kvcanary import HashMode
from torch_kvcanary.canary import KvCanary
from torch_kvcanary.integrations.vllm import adapter, config, plugin
from torch_kvcanary.integrations.vllm.reports import Reports

# An engine each policy can serve: the canary's connector with the failure policy repair
# needs, Model Runner V1, synchronous scheduling, one KV cache group.
SERVABLE = config.EngineFacts(
    canary_connector=True, model_runner_v2=False, kv_load_failure_policy="recompute", async_scheduling=False,
    kv_cache_group_kinds=("FullAttentionSpec",),
)  # fmt: skip
CONNECTOR_CONFIG = (
    "vLLM's KV connector to be KvCanaryConnector (--kv-transfer-config "
    '\'{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": "%s"}\')'
)
V1 = "Model Runner V1 for the KV connector (VLLM_USE_V2_MODEL_RUNNER=0)"
SYNCHRONOUS = "synchronous scheduling (--no-async-scheduling, or async_scheduling=False)"
TWO_GROUPS = "a model with one KV cache group, this one has 2 (SlidingWindowSpec, FullAttentionSpec)"
DRILL_POLICY = (
    "KVCANARY_VLLM=repair or quarantine for fault drills (under log a drilled bit stays in the KV and feeds the answers, "
    "under raise it stops the engine), or KVCANARY_VLLM_DRILL unset"
)


@pytest.mark.parametrize(
    "policy, drill, changes, needs",
    [
        (
            "log",
            0.0,
            dict(canary_connector=False, async_scheduling=True, kv_cache_group_kinds=("SlidingWindowSpec", "FullAttentionSpec")),
            [],
        ),
        ("raise", 0.0, dict(canary_connector=False, model_runner_v2=True), []),
        ("log", 0.0, dict(model_runner_v2=True), [V1]),  # the connector's counters need V1
        ("log", 0.5, dict(canary_connector=False, kv_load_failure_policy=None), [CONNECTOR_CONFIG % "recompute", DRILL_POLICY]),
        ("log", 0.5, {}, [DRILL_POLICY]),  # a drilled bit would stay in the KV and feed the answers
        ("raise", 0.5, {}, [DRILL_POLICY]),  # a drill would stop the engine
        ("quarantine", 0.5, dict(kv_load_failure_policy="fail"), []),
        ("repair", 0.0, {}, []),
        ("repair", 0.0, dict(canary_connector=False, kv_load_failure_policy=None), [CONNECTOR_CONFIG % "recompute"]),
        ("quarantine", 0.0, dict(canary_connector=False, kv_load_failure_policy=None), [CONNECTOR_CONFIG % "fail"]),
        ("quarantine", 0.0, {}, ['"kv_load_failure_policy": "fail" in the kv_transfer_config, not "recompute"']),
        ("repair", 0.0, dict(async_scheduling=True), [SYNCHRONOUS]),
        ("repair", 0.0, dict(kv_cache_group_kinds=("SlidingWindowSpec", "FullAttentionSpec")), [TWO_GROUPS]),
        (
            "repair",
            0.1,
            dict(model_runner_v2=True, async_scheduling=True, kv_cache_group_kinds=("SlidingWindowSpec", "FullAttentionSpec")),
            [V1, SYNCHRONOUS, TWO_GROUPS],
        ),  # fmt: skip
    ],
)
def test_what_each_policy_needs_of_the_engine(policy, drill, changes, needs):
    engine = dataclasses.replace(SERVABLE, **changes)
    assert config.connector_needs(policy, drill, engine) == needs


def test_a_drill_under_log_is_refused_with_the_change_to_make():
    error = config.connector_refusal("log", 0.01, config.connector_needs("log", 0.01, SERVABLE))
    assert str(error) == (
        f"kv-canary: KVCANARY_VLLM=log with KVCANARY_VLLM_DRILL=0.01 needs {DRILL_POLICY}: "
        "change that, or unset KVCANARY_VLLM to serve without the canary"
    )


def test_a_policy_the_engine_cannot_serve_is_refused_with_every_change_to_make():
    error = config.connector_refusal("repair", 0.1, [SYNCHRONOUS, TWO_GROUPS])
    assert str(error) == (
        f"kv-canary: KVCANARY_VLLM=repair with KVCANARY_VLLM_DRILL=0.1 needs {SYNCHRONOUS}; {TWO_GROUPS}: "
        "change that, or unset KVCANARY_VLLM to serve without the canary"
    )


@pytest.mark.parametrize("value", [None, ""])
def test_off_unless_set(monkeypatch, value):
    _set_or_unset(monkeypatch, "KVCANARY_VLLM", value)
    monkeypatch.setenv("KVCANARY_VLLM_MODE", "nonsense")  # not read when the plugin is off
    assert config.settings() is None
    modules = set(sys.modules)
    plugin.register()
    assert not any(name == "vllm" or name.startswith("vllm.") for name in set(sys.modules) - modules)


@pytest.mark.parametrize(
    "policy, mode, expected",
    [("log", None, HashMode.ALL), ("raise", "all", HashMode.ALL), ("log", "partial", HashMode.PARTIAL), ("raise", "", HashMode.ALL)],
)
def test_settings(monkeypatch, policy, mode, expected):
    assert _settings_with(monkeypatch, policy, "KVCANARY_VLLM_MODE", mode) == config.Settings(policy, expected)


@pytest.mark.parametrize("policy, failure_policy", [("repair", "recompute"), ("quarantine", "fail")])
def test_the_connector_policies(monkeypatch, policy, failure_policy):
    monkeypatch.setenv("KVCANARY_VLLM", policy)
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    monkeypatch.delenv("KVCANARY_VLLM_DRILL", raising=False)
    assert config.settings() == config.Settings(policy, HashMode.ALL)
    assert config.CONNECTOR_POLICIES[policy] == failure_policy


def _settings_with(monkeypatch, policy: str, name: str, value: str | None) -> config.Settings:
    """The plugin's settings with KVCANARY_VLLM=policy and ``name`` set to ``value`` (None: unset)."""
    monkeypatch.setenv("KVCANARY_VLLM", policy)
    _set_or_unset(monkeypatch, name, value)
    return config.settings()


def _set_or_unset(monkeypatch, name: str, value: str | None) -> None:
    """Sets the variable ``name`` to ``value``, or unsets it for None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("value, probability", [(None, 0.0), ("", 0.0), ("0", 0.0), ("0.001", 0.001), ("1", 1.0)])
def test_drill_probability(monkeypatch, value, probability):
    assert _settings_with(monkeypatch, "repair", "KVCANARY_VLLM_DRILL", value).drill == probability


@pytest.mark.parametrize("version", ["0.30.0", "0.31.2", "0.32.0", "0.32.7", "0.33.0", "0.33.2+cpu", "0.33.0rc1", "0.33.1.dev5+g1234abc"])
def test_supported_vllm_versions(version):
    assert adapter.is_supported(version)


@pytest.mark.parametrize("version", ["0.29.9", "0.29.0+cpu", "0.34.0", "0.3.32", "0.320.0", "1.32.0", "dev"])
def test_another_vllm_version_is_refused(monkeypatch, version):
    assert not adapter.is_supported(version)
    monkeypatch.setattr(adapter, "vllm_version", lambda: version)
    monkeypatch.setenv("KVCANARY_VLLM", "log")
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    message = (
        f"^kv-canary: the vLLM plugin supports vLLM 0.30, 0.31, 0.32 and 0.33, this is vLLM {re.escape(version)}: .*unset KVCANARY_VLLM"
    )
    with pytest.raises(RuntimeError, match=message):
        plugin.register()


def test_another_vllm_version_is_not_read_while_off(monkeypatch):
    monkeypatch.delenv("KVCANARY_VLLM", raising=False)
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.29.0")
    plugin.register()


def _imports_vllm(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name == "vllm" or alias.name.startswith("vllm.") for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module == "vllm" or node.module.startswith("vllm."))


def test_only_the_adapter_and_the_connector_import_vllm():
    package = REPO / "torch_kvcanary"
    importers = {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if any(_imports_vllm(node) for node in ast.walk(ast.parse(path.read_text())))
    }
    # The connector subclasses vLLM's public KV connector base (its delegate and facade) and
    # checks vLLM's transfer configs; vLLM imports it when a kv_transfer_config names it,
    # never the plugin's entry point.
    assert importers == {
        "integrations/vllm/adapter/common.py",
        "integrations/vllm/adapter/connectors.py",
        "integrations/vllm/adapter/hooks.py",
        "integrations/vllm/adapter/identity.py",
        "integrations/vllm/adapter/versions.py",
        "integrations/vllm/connector/checks.py",
        "integrations/vllm/connector/delegate.py",
        "integrations/vllm/connector/facade.py",
        "integrations/vllm/connector/stats.py",
        # The test support's: vLLM's command line run as a script, and the chaos soaks'
        # injector, a plugin's source installed as text (neither is imported by the package).
        "testing/vllm_cli.py",
        "testing/soak/faults.py",
    }


@pytest.mark.parametrize("value, seconds", [(None, 60.0), ("", 60.0), ("0", 0.0), ("2.5", 2.5), ("600", 600.0)])
def test_summary_seconds(monkeypatch, value, seconds):
    assert _settings_with(monkeypatch, "log", "KVCANARY_VLLM_SUMMARY_S", value).summary_seconds == seconds


@pytest.mark.parametrize("value, every", [(None, 1), ("", 1), ("1", 1), ("8", 8)])
def test_every(monkeypatch, value, every):
    assert _settings_with(monkeypatch, "log", "KVCANARY_VLLM_EVERY", value).every == every


@pytest.mark.parametrize("value, repairs", [(None, 3), ("", 3), ("1", 1), ("10", 10)])
def test_max_repairs(monkeypatch, value, repairs):
    assert _settings_with(monkeypatch, "repair", "KVCANARY_VLLM_MAX_REPAIRS", value).max_repairs == repairs


@pytest.mark.parametrize("capacity", [1, 7, 4096])
@pytest.mark.parametrize("ring_capacity", [1, 1024])
def test_the_canary_memory(capacity, ring_capacity):
    # A record of four int64 fields and an int64 owner tag per slot; a ring row of eight
    # int64 and its origin of three; counters and the no-tag scalar, a few int64.
    source = kc.RealKvSource(tensor=torch.zeros(capacity, 64, dtype=torch.uint8), page_size=1, num_bytes_per_token=64, read_bytes=64)
    canary = kc.KvCanary(source, ring_capacity=ring_capacity)
    assert canary.nbytes == KvCanary.device_bytes(capacity, ring_capacity)
    assert KvCanary.device_bytes(capacity + 1, ring_capacity) - KvCanary.device_bytes(capacity, ring_capacity) == 40
    assert 0 < KvCanary.device_bytes(capacity, ring_capacity) - capacity * 40 - ring_capacity * 88 <= 16 * 8


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("kv_bytes_per_slot", [64, 1024, Fraction(1000, 3), 576 * 2 * 61])
@pytest.mark.parametrize("available", [0, 70_000, 10**6 + 7, 22 * 2**30 + 12345])
@pytest.mark.parametrize("fixed_bytes", [0, 256 * 4096 * 4])  # a device copy of a token history
def test_the_kv_cache_budget_leaves_room_for_the_canary(block_size, kv_bytes_per_slot, available, fixed_bytes):
    # vLLM sizes the cache in whole blocks of the budget; those blocks and the canary over
    # them fit in what was available, and one block more would not.
    budget = plugin.kv_cache_budget(available, kv_bytes_per_slot, fixed_bytes)
    assert 0 <= budget <= available
    blocks = math.floor(budget / (block_size * kv_bytes_per_slot))

    def needs(blocks: int) -> Fraction:
        return blocks * block_size * kv_bytes_per_slot + KvCanary.device_bytes(blocks * block_size) + fixed_bytes

    assert needs(blocks) <= available or blocks == 0
    assert needs(blocks + 1) > available


def test_each_corrupted_slot_is_logged_once_and_then_summed_up():
    reports = Reports(interval=10.0)
    assert reports.summary(100.0) is None  # the clock starts
    assert reports.first_detection(5) and reports.first_detection(9)
    assert not reports.first_detection(5) and not reports.first_detection(5) and not reports.first_detection(9)
    assert reports.summary(105.0) is None  # not yet
    reports.dropped(4)
    line = reports.summary(110.5)
    assert line == "kv_canary summary: launch_tag=vllm seconds=10.5 repeated_detections=3 repeated_slots=2 slots_logged=2 ring_dropped=4"
    assert reports.summary(130.0) is None  # nothing new to say
    reports.rewritten([9, 11])  # slot 9 written again: a violation there is a new one
    assert reports.first_detection(9) and not reports.first_detection(5)
    assert reports.summary(130.5) == (
        "kv_canary summary: launch_tag=vllm seconds=20.0 repeated_detections=1 repeated_slots=1 slots_logged=3 ring_dropped=0"
    )


def test_a_violation_line_names_its_requests_and_no_root():
    # A salted request's position 0 read under another salt: the row's stored and expected
    # chains are the two roots, unkeyed hashes of the salts. The line gives fingerprints,
    # one root's alike on every line of this process.
    from torch_kvcanary import identity
    from torch_kvcanary.integrations.vllm.reports import violation_line
    from torch_kvcanary.violations import FailReason, Violation, ViolationKind

    written, read = identity.request_root(cache_salt="tenant-7"), identity.request_root(cache_salt="tenant-8")
    violation = Violation(ViolationKind.VERIFY, 16, 0, 11, 11, written, read, FailReason.VERIFY_IDENTITY_MISMATCH)
    line = violation_line(violation, ["req-1-abc"])
    shown = re.fullmatch(
        r"kv_canary violation: launch_tag=vllm fail_reason=verify_identity slot_idx=16 position=0 stored_token=11 expected_token=11 "
        r"stored_chain_hash=fp:([0-9a-f]{8}) expected_aux=fp:([0-9a-f]{8}) request_id=req-1-abc",
        line,
    )
    assert shown is not None and shown[1] != shown[2], line
    for root in (written, read):
        assert f"{root % (1 << 64):016x}" not in line
    again = violation_line(dataclasses.replace(violation, slot=32, stored_chain=read), ["req-2-def"])
    assert f"stored_chain_hash=fp:{shown[2]} " in again
