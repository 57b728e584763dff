"""Verified transfers through vLLM's ``NixlConnector``: prefill/decode disaggregation, the
``NixlConnector`` transport of `transports.TRANSPORTS` (`NixlScheduler`, `NixlWorker`).

The prefill side (P) writes the records of a request's prompt slots into a records region
(`region.RecordsRegion`) that NIXL moves with the blocks, and claims them in the request's
``kv_transfer_params`` (`claim`); the decode side (D) records what landed under its own
request's tokens, positions and identity and compares (`NixlWorker`), every block holding a
differing slot a load error. The protocol, step by step, with how the two sides shard the
KV heads (`Sharding`), is written once, in docs/vllm_internals.md ("Prefill/decode through
NIXL"); this folder's guide is README.md.
"""

from .claim import Claims
from .config import PROGRESS_DELAY, RECORDS_KEY, STRICT, check_nixl, prepare_worker
from .orders import HandOverOrder, LoadOrder, NixlOrders, slots_of
from .region import RecordsRegion
from .scheduler import NixlScheduler
from .sharding import Sharding
from .worker import NixlWorker, PendingLoad

__all__ = [
    "PROGRESS_DELAY", "RECORDS_KEY", "STRICT", "Claims", "HandOverOrder", "LoadOrder", "NixlOrders", "NixlScheduler", "NixlWorker",
    "PendingLoad", "RecordsRegion", "Sharding", "check_nixl", "prepare_worker", "slots_of",
]  # fmt: skip
