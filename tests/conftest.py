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


# The markers. A test file (or folder) that needs more than the package and its test extras
# says so by one marker (`pytestmark`); where that is missing, its tests skip with the reason
# here (the files that import what they need at the top also skip as a whole, by
# `pytest.importorskip`). Which make target runs which markers: docs/development.md.
# marker: (what it is, whether this process has what it needs, the reason it skips otherwise)
MARKERS = {
    "vllm": (
        "needs vLLM's CPU build: runs in the vLLM venvs (make test-vllm, test-vllm-release)",
        lambda: _module("vllm"),
        "vLLM is not installed here: `make test-vllm` runs this in .venv-vllm",
    ),
    "nixl": (
        "needs NIXL beside vLLM: a prefill/decode pair (make test-vllm-pd)",
        lambda: _module("vllm") and _module("nixl"),
        "NIXL and vLLM are not both installed here: `make test-vllm-pd` installs NIXL into .venv-vllm and runs this",
    ),
    "prometheus": (
        "needs promtool and Prometheus beside vLLM: the operators' kit (make test-prometheus)",
        lambda: _module("vllm") and shutil.which("promtool") is not None,
        "vLLM and promtool are not both here: `make test-prometheus` installs Prometheus and runs this in .venv-vllm",
    ),
    "contract": (
        "the op contracts every torch of .ci/run's TORCH_VERSIONS must pass (opcheck, compile, export, the fold and the canary against the references)",
        lambda: True,
        "",
    ),
    "every_release": (
        "the vLLM plugin's essentials, run on every vLLM release it supports (make test-vllm-release); the rest of the vllm tests run on the newest CPU release",
        lambda: True,
        "",
    ),
    "dev_tool": (
        "a test of the checkout's own tools (benchmarks, CI checks, generators), not of the package",
        lambda: True,
        "",
    ),
}


def pytest_configure(config):
    for name, (meaning, _, _) in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    missing = {name: reason for name, (_, present, reason) in MARKERS.items() if reason and not present()}
    for item in items:
        for name in sorted(missing.keys() & {mark.name for mark in item.iter_markers()}):
            item.add_marker(pytest.mark.skip(reason=missing[name]))
