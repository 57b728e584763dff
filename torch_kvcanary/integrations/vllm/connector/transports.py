"""The transports: the inner connectors whose loads the canary verifies, by vLLM's name of
each, with how each half of its verifier is built (`verifier`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import disk, nixl
from .verifier import SchedulerVerifier, WorkerVerifier


@dataclass(frozen=True)
class Transport:
    """A verified transport: its refusals at start, and how each half is built. ``scheduler``
    is None where the worker half needs no plan."""

    check: Callable[[Any], None]  # (vllm_config) -> None, or a ValueError saying what to change
    scheduler: Callable[[Any, int], SchedulerVerifier] | None  # (vllm_config, block_size)
    worker: Callable[[Any, Any, int], WorkerVerifier]  # (vllm_config, inner connector, block_size)
    prepare_worker: Callable[[Any], None] | None = None  # (vllm_config), before the inner connector is built


TRANSPORTS: dict[str, Transport] = {
    "ExampleConnector": Transport(check=disk.check, scheduler=None, worker=disk.DiskVerifier.build),
    "NixlConnector": Transport(
        check=nixl.check_nixl, scheduler=nixl.NixlScheduler.build, worker=nixl.NixlWorker.build, prepare_worker=nixl.prepare_worker
    ),
}
"""The inner connectors whose loads the canary verifies, by vLLM's name of each."""
