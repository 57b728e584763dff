"""The ``NixlConnector`` transport of `verifier.TRANSPORTS`: P/D disaggregation verified by
the canary (`worker`), with the side channel of P's records (`channel`)."""

from .worker import (
    CONNECTORS, FOLD, PROGRESS_DELAY, RECORDS_KEY, RECORDS_PORT, LoadOrder, NixlOrders, NixlScheduler, NixlWorker, PendingLoad,
    Sharding, SnapshotOrder, check_nixl, prepare_worker, slots_of,
)  # fmt: skip

__all__ = [
    "CONNECTORS", "FOLD", "PROGRESS_DELAY", "RECORDS_KEY", "RECORDS_PORT", "LoadOrder", "NixlOrders", "NixlScheduler", "NixlWorker",
    "PendingLoad", "Sharding", "SnapshotOrder", "check_nixl", "prepare_worker", "slots_of",
]  # fmt: skip
