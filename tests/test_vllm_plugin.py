"""The vLLM plugin's switches (no vLLM needed): KVCANARY_VLLM and KVCANARY_VLLM_MODE."""

import sys

import pytest

from torch_kvcanary import HashMode
from torch_kvcanary.integrations.vllm import plugin


@pytest.mark.parametrize("value", [None, ""])
def test_off_unless_set(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("KVCANARY_VLLM", raising=False)
    else:
        monkeypatch.setenv("KVCANARY_VLLM", value)
    monkeypatch.setenv("KVCANARY_VLLM_MODE", "nonsense")  # not read when the plugin is off
    assert plugin.settings() is None
    modules = set(sys.modules)
    plugin.register()
    assert not any(name == "vllm" or name.startswith("vllm.") for name in set(sys.modules) - modules)


@pytest.mark.parametrize(
    "policy, mode, expected",
    [("log", None, HashMode.ALL), ("raise", "all", HashMode.ALL), ("log", "partial", HashMode.PARTIAL), ("raise", "", HashMode.ALL)],
)
def test_settings(monkeypatch, policy, mode, expected):
    monkeypatch.setenv("KVCANARY_VLLM", policy)
    if mode is None:
        monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    else:
        monkeypatch.setenv("KVCANARY_VLLM_MODE", mode)
    assert plugin.settings() == plugin.Settings(policy, expected)


@pytest.mark.parametrize(
    "policy, mode, message",
    [
        ("warn", "all", "KVCANARY_VLLM must be one of log, raise (or unset to turn the plugin off), got 'warn'"),
        ("LOG", "all", "KVCANARY_VLLM must be one of log, raise"),
        ("log", "full", "KVCANARY_VLLM_MODE must be one of partial, all, got 'full'"),
    ],
)
def test_bad_settings_are_refused(monkeypatch, policy, mode, message):
    monkeypatch.setenv("KVCANARY_VLLM", policy)
    monkeypatch.setenv("KVCANARY_VLLM_MODE", mode)
    with pytest.raises(ValueError, match="^kv-canary: " + message.replace("(", r"\(").replace(")", r"\)")):
        plugin.settings()
    with pytest.raises(ValueError, match="^kv-canary: "):
        plugin.register()
