"""What every test shares: the Hypothesis profiles, the checkout's tool folders on the path,
and the markers that say what a test needs, by which the Makefile and .ci/run choose the
tests of each venv (`pytest -m`)."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis profiles: "ci" (the default, bounded for CI) and "nightly" (long); choose with
# HYPOTHESIS_PROFILE.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The benchmarks and build tools live beside the package in the checkout (benchmarks/,
# build_tools/), not in it: the checkout is appended, so that an installed torch_kvcanary
# still comes first. What tests, tools and benchmarks share is the package's own
# (torch_kvcanary.testing).
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# The markers, and what each is. A test file (or folder) that needs more than the package
# and its test extras says so by one marker (`pytestmark`). Which make target runs which
# markers: docs/development.md.
MARKERS = {
    "vllm": "needs vLLM's CPU build: runs in the vLLM venvs (make test-vllm, test-vllm-release)",
    "nixl": "needs NIXL beside vLLM: a prefill/decode pair (make test-vllm-pd)",
    "prometheus": "needs promtool and Prometheus beside vLLM: the operators' kit (make test-prometheus)",
    "contract": "the op contracts every torch of .ci/run's TORCH_VERSIONS must pass (opcheck, compile, export, the fold and the canary against the references)",
    "every_release": "the vLLM plugin's essentials, run on every vLLM release it supports (make test-vllm-release); the rest of the vllm tests run on the newest CPU release",
    "dev_tool": "a test of the checkout's own tools (benchmarks, CI checks, generators), not of the package",
}
# The markers of what a venv may lack: whether this process has it, and the reason its tests
# skip where it does not (files that import it at the top also skip as a whole, by
# `pytest.importorskip`).
NEEDS = {
    "vllm": (lambda: _module("vllm"), "vLLM is not installed here: `make test-vllm` runs this in .venv-vllm"),
    "nixl": (
        lambda: _module("vllm") and _module("nixl"),
        "NIXL and vLLM are not both installed here: `make test-vllm-pd` installs NIXL into .venv-vllm and runs this",
    ),
    "prometheus": (
        lambda: _module("vllm") and shutil.which("promtool") is not None,
        "vLLM and promtool are not both here: `make test-prometheus` installs Prometheus and runs this in .venv-vllm",
    ),
}


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    missing = {name: reason for name, (present, reason) in NEEDS.items() if not present()}
    for item in items:
        for name in sorted(missing.keys() & {mark.name for mark in item.iter_markers()}):
            item.add_marker(pytest.mark.skip(reason=missing[name]))
