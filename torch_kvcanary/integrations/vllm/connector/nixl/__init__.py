"""Verified transfers through vLLM's ``NixlConnector``: prefill/decode disaggregation, the
``NixlConnector`` transport of `transports.TRANSPORTS` (`NixlScheduler`, `NixlWorker`).

The prefill side (P) computes a request's prompt and hands its blocks to the decode side
(D), which reads them over NIXL. The canary's records are relocation-invariant (token,
position, chain and fold do not depend on the slot), so they can travel with the blocks:

- Each worker of either side holds a records region (`region.RecordsRegion`) indexed by
  block like a KV layer, which NixlConnector registers and moves as one more layer of the
  request's blocks (`adapter.nixl.add_transfer_layer`): NIXL's own read brings D the rows
  of the blocks it reads, each D rank's heads from the P ranks holding them.
- P, in the step that completes a request's prompt, writes the rows of the prompt's slots
  (`NixlWorker.after_save`, after the forward recorded them, on the device): their records
  and each slot's transfer digest over each of the rank's KV heads. Where P's own canary
  flagged a block the step read, vLLM rolls the request back and recomputes it, and the
  step that completes the prompt again writes the rows anew. The rows live as long as the
  blocks: once P's lease on them expires and they are reused, they hold their next owner's
  rows, or their former owner's beside a new owner's KV, and either differs from what D
  expects. P claims in the request's ``kv_transfer_params`` that its blocks carry records,
  with what D must match to compare them: the records' format, the fold mode, the KV layout
  and its tensor-parallel size (`RECORDS_KEY`, `claim`).
- D, when NIXL reports the read done (before vLLM marks the request's load done), records
  what landed with the request's prompt tokens and positions and compares with the rows
  that landed with it (`NixlWorker.land`): every block holding a slot that differs is a
  load error of that step, which vLLM recomputes (``"recompute"``) or fails the request for
  (``"fail"``); the bad slots' records are broken, so a forward reading them first is
  flagged too. A load whose params carry no claim, or a claim D's facts differ from, is
  taken unverified and counted (`claim.Claims`), or under `STRICT` is a load error too.

Both sides must run the canary: NixlConnector's handshake compares the layers each side
registers, and refuses a pair of which only one side moves the records region.

What is compared depends on how the two sides shard the KV heads (`Sharding`). Where a D
rank holds the heads of one P rank exactly (the same tensor-parallel size on both sides,
or MLA's latent, which every rank holds), the fold of each slot is a fingerprint of the
same bytes on both sides and the whole records compare. Where they split the heads
differently (NIXL's heterogeneous TP: a D rank reads part of a P rank's heads, or parts of
several), the token, position and chain compare, and in place of the fold the digest of
each of the D rank's heads, which `digest.kv_digest` numbers by global head so that a head
digests alike wherever it is held.
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
