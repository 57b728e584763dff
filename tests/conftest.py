"""Hypothesis profiles: "ci" (the default, bounded for CI) and "nightly" (long);
choose with HYPOTHESIS_PROFILE."""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The benchmarks, build tools and tools live beside the package in the checkout
# (benchmarks/, build_tools/, tools/), not in it: appended, so that an installed
# torch_kvcanary still comes first. Tests import tools/'s modules (random_models,
# vllm_serve, make_golden) by their names; benchmarks.engine_step imports the tests' fake
# runner from the checkout's root, as tests.vllm_plugin.fake_runner.
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))
sys.path.append(str(REPO / "tools"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dev_tool: a test of the checkout's own tools (benchmarks, CI checks, generators), not of the package"
    )
