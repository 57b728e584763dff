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


# Each number setting, the policy it is set under, its bad values and what its refusal says.
NUMBER_SETTINGS = [
    ("KVCANARY_VLLM_SUMMARY_S", "log", ["-1", "soon", "nan", "inf"], r"a number of seconds >= 0 \(0: after every step\)"),
    ("KVCANARY_VLLM_DRILL", "repair", ["-0.1", "1.5", "nan", "often"], r"a probability per step in \[0, 1\] \(0 or unset: no drills\)"),
    ("KVCANARY_VLLM_EVERY", "log", ["0", "-2", "two", "1.5"], r"an int >= 1 \(1: every context slot at every step\)"),
    (
        "KVCANARY_VLLM_MAX_REPAIRS",
        "repair",
        ["0", "-1", "three", "2.5"],
        r"an int >= 1 \(the recomputes of one block a request is given under repair\)",
    ),
]


@pytest.mark.parametrize(
    "name, policy, value, must", [(name, policy, value, must) for name, policy, values, must in NUMBER_SETTINGS for value in values]
)
def test_vllm_plugin_refuses_a_bad_number(monkeypatch, name, policy, value, must):
    message = f"^kv-canary: {name} must be {must}, got '{value}'$"
    _assert_vllm_settings_refused(monkeypatch, {"KVCANARY_VLLM": policy, name: value}, message)
