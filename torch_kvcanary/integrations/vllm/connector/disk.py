"""Verified transfers of KV through an inner connector that stores it on disk, the
``ExampleConnector`` transport (`transports.TRANSPORTS`): `DiskVerifier`, its worker half,
and `DiskScheduler`, which tells the workers which request each load is of."""

from __future__ import annotations

import logging
import os

import numpy as np
import safetensors.torch
import torch

from ....identity import ANCHOR
from ....records import RECORD_FIELDS
from .. import adapter
from .port import RecordPort, landed_entries, to_device
from .stats import FAILED
from .verifier import SchedulerVerifier, WorkerVerifier

logger = logging.getLogger(adapter.LOGGER)

CHAIN = RECORD_FIELDS.index("chain")


class DiskScheduler(SchedulerVerifier):
    """The scheduler half: the blocks of each request the inner connector loads for in a step
    (its orders: request id -> the request's blocks of the first KV cache group), so that a
    worker knows whose identity each load is of. ExampleConnector's loads name no request;
    a load's blocks hold the tokens it loads into blocks the scheduler allocated for them, no
    other request's, so they name it."""

    def __init__(self):
        self._loads: dict[str, list[int]] = {}

    @classmethod
    def build(cls, vllm_config, block_size: int) -> DiskScheduler:
        return cls()

    def on_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """A request the inner connector loads external tokens for (as ExampleConnector decides)."""
        if num_external_tokens > 0:
            self._loads[request.request_id] = list(blocks.get_block_ids()[0])

    def plan(self, scheduler_output) -> dict[str, list[int]] | None:
        loads, self._loads = self._loads, {}
        return loads or None


def identity_differs(landed: list[int], stored: list[int]) -> bool:
    """Whether a slot's records as the request landed them (``landed``) and as stored
    (``stored``) differ in the chain alone: the same token, position and bytes, chained from
    another root, which is KV computed under another identity (a LoRA adapter, a cache salt)
    for the same tokens (`identity`)."""
    return [i for i, (mine, theirs) in enumerate(zip(landed, stored)) if mine != theirs] == [CHAIN]


class DiskVerifier(WorkerVerifier):
    """Verified transfers through a connector that stores a request's blocks in a folder of
    its own (vLLM's ``ExampleConnector``: one file per layer, in a folder named by the hash
    of the request's tokens). The canary's records are relocation-invariant (token,
    position, chain and fold do not depend on the slot), so the producer stores the records
    of the saved slots beside them (`SIDECAR`), and the consumer, once the inner connector
    has loaded a request's blocks, records the landed slots with the request's tokens and
    positions, chained from the request's own root (its identity, as this worker derives it:
    never a value read from the files), and compares them with what was stored: a slot whose
    fold, token, position or chain differs (a changed byte, blocks swapped, another
    request's file, KV stored under another identity), or whose stored records are missing
    or unreadable, has its record's fold broken, so that the canary flags it before the
    forward reads it and the connector reports its block as a load error (recomputed under
    repair, failed under quarantine). ExampleConnector keys its files on the prompt's tokens
    alone, so a request under one LoRA adapter or cache salt finds the files another stored
    (vLLM #53495): such a load differs in every slot's chain alone, and is named and counted
    as ``identity``. ExampleConnector reads a request's files within ``start_load_kv``, so
    its loads are verified in `after_load`; the verifier holds nothing across steps."""

    SIDECAR = "kv_canary.safetensors"

    def __init__(self, inner, block_size: int):
        self.inner = inner
        self.block_size = block_size
        self._loads: dict[str, list[int]] = {}  # the step's orders (`DiskScheduler`)
        self._identity = 0  # slots that failed as KV of another identity, since `take_counts`

    @classmethod
    def build(cls, vllm_config, inner, block_size: int) -> DiskVerifier:
        return cls(inner, block_size)

    def _requests(self) -> list:
        """The inner connector's requests of this step (``is_store``, ``token_ids``, ``slot_mapping``)."""
        return adapter.example_connector_requests(self.inner)

    def _path(self, request) -> str:
        return os.path.join(adapter.example_connector_folder(self.inner, request), self.SIDECAR)

    def before_load(self, port: RecordPort, orders) -> None:
        """Notes the step's loads by request (`DiskScheduler.plan`)."""
        self._loads = orders or {}

    def after_save(self, port: RecordPort, orders) -> None:
        """Stores the records of the slots each saved request's files hold, from the
        worker's canary (``port``)."""
        for request in self._requests():
            if request.is_store:
                records = port.records_of(request.slot_mapping)
                safetensors.torch.save_file({"records": records.cpu().contiguous()}, self._path(request))

    def after_load(self, port: RecordPort) -> tuple[int, int]:
        """Has the worker's canary (``port``) record every slot the inner connector loaded in
        this step, and break those whose records do not match the stored ones: (slots
        verified, slots that failed of no kind told apart); those of KV stored under another
        identity are counted as ``identity`` (`take_counts`)."""
        return self._land(port, failed=False)

    def after_failed_load(self, port: RecordPort) -> tuple[int, int]:
        """As `after_load`, every slot of the step's loads bad."""
        return self._land(port, failed=True)

    def _land(self, port: RecordPort, *, failed: bool) -> tuple[int, int]:
        """(slots verified, slots that failed unclassified) of the step's loads, all bad where the load ``failed``."""
        verified = unclassified = 0
        for request in self._requests():
            if request.is_store:
                continue
            count = len(request.slot_mapping)
            host_slots = request.slot_mapping.cpu().numpy()
            request_id = self._request_of(host_slots)
            root = port.request_root(request_id) if request_id is not None else None
            entries = landed_entries(host_slots, request.token_ids[:count], start=0, prev_slot=-1)
            slots, tokens, positions, prev_slots, roots = to_device(
                port.device, *entries, np.full(count, ANCHOR if root is None else root, dtype=np.int64)
            )
            landed = port.record_landed(slots, tokens=tokens, positions=positions, prev_slots=prev_slots, roots=roots)
            stored = None if failed else self._stored(request, count)
            if stored is None:
                bad = torch.ones(count, dtype=torch.bool, device=landed.device)
            else:
                bad = (landed != stored.to(landed.device)).any(dim=1)
            port.break_records(slots[bad.to(slots.device)])
            verified += count
            bad_count = int(bad.sum())
            if bad_count and stored is not None and self._other_identity(request_id, host_slots, landed, stored, bad):
                self._identity += bad_count
            else:
                unclassified += bad_count
        return verified, unclassified

    def _other_identity(self, request_id, host_slots: np.ndarray, landed: torch.Tensor, stored: torch.Tensor, bad: torch.Tensor) -> bool:
        """Whether the load's first differing slot differs from what was stored in its chain
        alone (`identity_differs`); if so, says so, naming the request and the slot (read on
        the host: a failure's path alone)."""
        first = int(bad.nonzero()[0])
        mine, theirs = landed[first].tolist(), stored[first].tolist()
        if not identity_differs(mine, theirs):
            return False
        logger.warning(
            "kv-canary: request %s: %d of the %d slots ExampleConnector loaded were stored under another identity (first at "
            "slot %d, position %d): their token, position and bytes are as stored and their chain is not the request's, KV "
            "computed under another LoRA adapter or cache salt for the same tokens; their blocks are load errors (counted as identity)",
            request_id, int(bad.sum()), len(host_slots), int(host_slots[first]), mine[RECORD_FIELDS.index("position")],
        )  # fmt: skip
        return True

    def _request_of(self, slot_mapping: np.ndarray) -> str | None:
        """The request whose blocks a load's slots are in (`DiskScheduler`); None where the step's orders name none."""
        blocks = slot_mapping[:: self.block_size] // self.block_size
        for request_id, block_ids in self._loads.items():
            if block_ids[: len(blocks)] == blocks.tolist():
                return request_id
        return None

    def _stored(self, request, count: int) -> torch.Tensor | None:
        """The records stored with the request's blocks; None when missing, unreadable or of another length."""
        try:
            stored = safetensors.torch.load_file(self._path(request))["records"]
        except Exception:
            return None
        return stored if tuple(stored.shape) == (count, len(RECORD_FIELDS)) and stored.dtype == torch.int64 else None

    def take_counts(self) -> dict:
        """The slots of loads that failed as KV of another identity since the last call."""
        counts, self._identity = {FAILED: {"identity": self._identity}}, 0
        return counts
