"""The vLLM plugin's switches (`integrations.vllm.config`): each bad value refused, by the
settings and by the plugin's registration, with what to change (no vLLM needed)."""

import pytest

from torch_kvcanary.integrations.vllm import config, plugin


@pytest.mark.parametrize(
    "policy, mode, message",
    [
        ("warn", "all", "KVCANARY_VLLM must be one of log, raise, repair, quarantine (or unset to turn the plugin off), got 'warn'"),
        ("LOG", "all", "KVCANARY_VLLM must be one of log, raise, repair, quarantine"),
        ("log", "full", "KVCANARY_VLLM_MODE must be one of partial, all, got 'full'"),
    ],
)
def test_vllm_plugin_refuses_bad_settings(monkeypatch, policy, mode, message):
    monkeypatch.setenv("KVCANARY_VLLM", policy)
    monkeypatch.setenv("KVCANARY_VLLM_MODE", mode)
    with pytest.raises(ValueError, match="^kv-canary: " + message.replace("(", r"\(").replace(")", r"\)")):
        config.settings()
    with pytest.raises(ValueError, match="^kv-canary: "):
        plugin.register()


def _assert_vllm_settings_refused(monkeypatch, environ: dict[str, str], message: str) -> None:
    """Both the plugin's settings and its registration refuse ``environ`` with ``message``."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        config.settings()
    with pytest.raises(ValueError, match=message):
        plugin.register()


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_vllm_plugin_refuses_bad_summary_seconds(monkeypatch, value):
    message = f"^kv-canary: KVCANARY_VLLM_SUMMARY_S must be a number of seconds >= 0 \\(0: after every step\\), got '{value}'$"
    _assert_vllm_settings_refused(monkeypatch, {"KVCANARY_VLLM": "log", "KVCANARY_VLLM_SUMMARY_S": value}, message)


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan", "often"])
def test_vllm_plugin_refuses_a_drill_probability_out_of_range(monkeypatch, value):
    message = rf"^kv-canary: KVCANARY_VLLM_DRILL must be a probability per step in \[0, 1\] \(0 or unset: no drills\), got '{value}'$"
    _assert_vllm_settings_refused(monkeypatch, {"KVCANARY_VLLM": "repair", "KVCANARY_VLLM_DRILL": value}, message)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_vllm_plugin_refuses_bad_every(monkeypatch, value):
    monkeypatch.setenv("KVCANARY_VLLM", "log")
    monkeypatch.setenv("KVCANARY_VLLM_EVERY", value)
    message = f"^kv-canary: KVCANARY_VLLM_EVERY must be an int >= 1 \\(1: every context slot at every step\\), got '{value}'$"
    with pytest.raises(ValueError, match=message):
        config.settings()
