"""SGLang's own torch references of its kv-canary write and verify kernels, loaded from
the sglang wheel's files (``make sglang-reference`` unpacks them into .sglang/) with
stubs for the runtime they import, as an oracle for the canary records."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("KVCANARY_SGLANG", REPO / ".sglang"))
PACKAGE = "sglang.kernels.ops.kv_canary"
FILES = ("consts", "_dispatch", "verify", "write", "verify_ref", "write_ref")


def _stub(name: str, path: list[str] | None = None) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    if path is not None:
        module.__path__ = path
    sys.modules[name] = module
    return module


def _unavailable(*args, **kwargs):
    raise RuntimeError("kv-canary tests: SGLang's JIT kernels are not loaded here; use the torch references")


def load() -> types.SimpleNamespace:
    """SGLang's kv_canary modules (consts, verify, write, verify_ref, write_ref); skips the
    test, saying why, when the files are missing (CI fetches them, so there it fails)."""
    folder = ROOT / "sglang" / "kernels" / "ops" / "kv_canary"
    if not (folder / "write_ref.py").is_file():
        message = f"SGLang's kv-canary references not found under {ROOT}; run `make sglang-reference`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.jit"):
        _stub(name, [])
    utils = _stub("sglang.kernels.jit.utils")
    utils.cache_once = lambda fn: fn
    utils.load_jit = utils.make_cpp_args = _unavailable
    _stub(PACKAGE, [str(folder)])
    modules = {}
    for name in FILES:
        full = f"{PACKAGE}.{name}"
        if full not in sys.modules:
            spec = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
        modules[name] = sys.modules[full]
    return types.SimpleNamespace(**modules)
