"""The transports: the inner connectors whose loads the canary verifies, by vLLM's name of
each, with the classes of its verifier's halves (`verifier`)."""

from __future__ import annotations

from dataclasses import dataclass

from . import disk, nixl
from .verifier import SchedulerVerifier, WorkerVerifier


@dataclass(frozen=True)
class Transport:
    """A verified transport: its worker half (whose class also holds the transport's
    refusals at start, `WorkerVerifier.check`), and its scheduler half, None where the
    worker half needs no plan."""

    worker: type[WorkerVerifier]
    scheduler: type[SchedulerVerifier] | None = None


TRANSPORTS: dict[str, Transport] = {
    "ExampleConnector": Transport(disk.DiskVerifier, disk.DiskScheduler),
    "NixlConnector": Transport(nixl.NixlWorker, nixl.NixlScheduler),
}
"""The inner connectors whose loads the canary verifies, by vLLM's name of each."""
