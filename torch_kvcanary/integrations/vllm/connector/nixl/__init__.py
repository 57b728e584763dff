"""Verified transfers through vLLM's ``NixlConnector``: prefill/decode disaggregation, the
``NixlConnector`` transport of `verifier.TRANSPORTS` (`NixlScheduler`, `NixlWorker`).

The prefill side (P) computes a request's prompt and hands its blocks to the decode side
(D), which reads them over NIXL. The canary's records are relocation-invariant (token,
position, chain and fold do not depend on the slot), so:

- P, in the step that completes a request's prompt, snapshots what its rank holds of the
  prompt's slots (`NixlWorker.after_save`, after the forward recorded them): their records
  and each slot's transfer digest over each of the rank's KV heads (`channel.Snapshot`).
  Where P's own canary flagged a block the step read, vLLM rolls the request back and
  recomputes it, and the step that completes the prompt again takes the snapshot anew.
  It holds the snapshot until NIXL reports the request's blocks sent or their lease expired
  (`release`): a block freed and reused after the snapshot cannot change what is compared.
  A small TCP server on the loopback (`RecordsServer`) serves the snapshots, one per rank on
  consecutive ports; the address of rank 0's and P's tensor-parallel size ride in the
  request's ``kv_transfer_params`` (`RECORDS_KEY`), since vLLM builds those params before
  the worker's results of the step reach the scheduler.
- D fetches the snapshots of the P ranks holding its heads before NIXL starts reading the
  blocks (`NixlWorker.fetch`), and when NIXL reports the read done (before vLLM marks the
  request's load done) records what landed with the request's prompt tokens and positions
  and compares (`NixlWorker.land`): every block holding a slot whose records differ, or
  whose snapshot is missing (no address, no snapshot, a timeout, another request's
  snapshot), is a load error of that step, which vLLM recomputes (``"recompute"``) or fails
  the request for (``"fail"``); the bad slots' records are broken, so a forward reading them
  first is flagged too.

What is compared depends on how the two sides shard the KV heads (`Sharding`). Where a D
rank holds the heads of one P rank exactly (the same tensor-parallel size on both sides,
or MLA's latent, which every rank holds), the fold of each slot is a fingerprint of the
same bytes on both sides and the whole records compare. Where they split the heads
differently (NIXL's heterogeneous TP: a D rank reads part of a P rank's heads, or parts of
several), the token, position and chain compare, and in place of the fold the digest of
each of the D rank's heads, which `digest.kv_digest` numbers by global head so that a head
digests alike wherever it is held.
"""

from .config import CONNECTORS, PROGRESS_DELAY, RECORDS_KEY, RECORDS_PORT, check_nixl, prepare_worker
from .orders import LoadOrder, NixlOrders, SnapshotOrder, slots_of
from .scheduler import NixlScheduler
from .sharding import Sharding
from .worker import NixlWorker, PendingLoad

__all__ = [
    "CONNECTORS", "PROGRESS_DELAY", "RECORDS_KEY", "RECORDS_PORT", "LoadOrder", "NixlOrders", "NixlScheduler", "NixlWorker",
    "PendingLoad", "Sharding", "SnapshotOrder", "check_nixl", "prepare_worker", "slots_of",
]  # fmt: skip
