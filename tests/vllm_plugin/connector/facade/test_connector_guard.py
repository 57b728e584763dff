"""The guard of the canary's own code in the connector's calls (`connector.guard.Guard`):
what it catches, what it lets through, what it logs and counts."""

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

import torch_kvcanary as kc  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.guard import Guard  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.stats import FAULT_PARTS, FAULTS, CanaryStats  # noqa: E402


def _fail(error: BaseException):
    raise error


def test_a_fault_is_caught_counted_by_part_and_logged_once_per_part(caplog):
    guard = Guard()
    with caplog.at_level(logging.ERROR, logger="vllm.torch_kvcanary"):
        for _ in range(3):
            with guard.guarding("mapping"):
                _fail(ZeroDivisionError("mapping"))
        with guard.guarding("repair"):
            _fail(KeyError("repair"))
        with guard.guarding("drill"):
            pass
    logged = [r for r in caplog.records if "failed in a KV connector call" in r.getMessage()]
    assert [r.getMessage().split("(")[1].split(")")[0] for r in logged] == ["mapping", "repair"]
    assert all(r.exc_info is not None for r in logged)  # with its traceback
    assert guard.take() == {"verifier": 0, "mapping": 3, "repair": 1, "drill": 0, "counters": 0}
    assert guard.take() == dict.fromkeys(FAULT_PARTS, 0)  # taken: counted once


def test_a_violation_under_raise_and_what_is_not_an_exception_go_through():
    guard = Guard()
    with pytest.raises(kc.KvCorruptionError):
        with guard.guarding("repair"):
            _fail(kc.KvCorruptionError(["kv-canary: 1 violation"], []))
    with pytest.raises(KeyboardInterrupt):
        with guard.guarding("repair"):
            _fail(KeyboardInterrupt())
    assert guard.take() == dict.fromkeys(FAULT_PARTS, 0)


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: 'mapping rule' is not a part"):
        with Guard().guarding("mapping rule"):
            pass


def test_the_faults_reach_the_stats_by_part():
    stats = CanaryStats()
    stats.add(FAULTS, {"verifier": 2})
    assert not stats.is_empty()
    assert stats.reduce()["kv_canary_canary_faults_verifier"] == 2
