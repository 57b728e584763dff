"""The vLLM plugin without vLLM: its switches KVCANARY_VLLM and KVCANARY_VLLM_MODE, the vLLM
versions it starts on, and the one module that imports vLLM."""

import ast
import re
import sys

import pytest
from helpers import REPO

from torch_kvcanary import HashMode
from torch_kvcanary.integrations.vllm import adapter, plugin


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


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.33.0", "0.33.2+cpu", "0.33.0rc1", "0.33.1.dev5+g1234abc"])
def test_supported_vllm_versions(version):
    assert adapter.is_supported(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.3.32", "0.320.0", "1.32.0", "dev"])
def test_another_vllm_version_is_refused(monkeypatch, version):
    assert not adapter.is_supported(version)
    monkeypatch.setattr(adapter, "vllm_version", lambda: version)
    monkeypatch.setenv("KVCANARY_VLLM", "log")
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    message = f"^kv-canary: the vLLM plugin supports vLLM 0.32 and 0.33, this is vLLM {re.escape(version)}: .*unset KVCANARY_VLLM"
    with pytest.raises(RuntimeError, match=message):
        plugin.register()


def test_another_vllm_version_is_not_read_while_off(monkeypatch):
    monkeypatch.delenv("KVCANARY_VLLM", raising=False)
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.31.0")
    plugin.register()


def _imports_vllm(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name == "vllm" or alias.name.startswith("vllm.") for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module == "vllm" or node.module.startswith("vllm."))


def test_only_the_adapter_imports_vllm():
    package = REPO / "torch_kvcanary"
    importers = {
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if any(_imports_vllm(node) for node in ast.walk(ast.parse(path.read_text())))
    }
    assert importers == {"integrations/vllm/adapter.py"}
