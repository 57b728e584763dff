"""Hypothesis profiles: "ci" (the default, bounded for CI) and "nightly" (long);
choose with HYPOTHESIS_PROFILE."""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The benchmarks and build tools live beside the package in the checkout (benchmarks/,
# build_tools/), not in it: the checkout is appended, so that an installed torch_kvcanary
# still comes first. What tests, tools and benchmarks share is the package's own
# (torch_kvcanary.testing).
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dev_tool: a test of the checkout's own tools (benchmarks, CI checks, generators), not of the package"
    )
