"""Verified transfers of KV through an inner connector that stores it on disk: `DiskVerifier`,
the worker half of the ``ExampleConnector`` transport (`transports.TRANSPORTS`); it needs no
scheduler half."""

from __future__ import annotations

import os

import safetensors.torch
import torch

from ....canary import RECORD_FIELDS
from .. import adapter
from .port import RecordPort, landed_entries, to_device
from .verifier import WorkerVerifier


class DiskVerifier(WorkerVerifier):
    """Verified transfers through a connector that stores a request's blocks in a folder of
    its own (vLLM's ``ExampleConnector``: one file per layer, in a folder named by the hash
    of the request's tokens). The canary's records are relocation-invariant (token,
    position, chain and fold do not depend on the slot), so the producer stores the records
    of the saved slots beside them (`SIDECAR`), and the consumer, once the inner connector
    has loaded a request's blocks, records the landed slots with the request's tokens and
    positions and compares them with what was stored: a slot whose fold, token, position or
    chain differs (a changed byte, blocks swapped, another request's file), or whose stored
    records are missing or unreadable, has its record's fold broken, so that the canary
    flags it before the forward reads it and the connector reports its block as a load error
    (recomputed under repair, failed under quarantine). ExampleConnector reads a request's
    files within ``start_load_kv``, so its loads are verified in `after_load`; the verifier
    holds nothing across steps."""

    SIDECAR = "kv_canary.safetensors"

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def build(cls, vllm_config, inner, block_size: int) -> DiskVerifier:
        return cls(inner)

    def _requests(self) -> list:
        """The inner connector's requests of this step (``is_store``, ``token_ids``, ``slot_mapping``)."""
        return adapter.example_connector_requests(self.inner)

    def _path(self, request) -> str:
        return os.path.join(adapter.example_connector_folder(self.inner, request), self.SIDECAR)

    def after_save(self, port: RecordPort, orders) -> None:
        """Stores the records of the slots each saved request's files hold, from the
        worker's canary (``port``)."""
        for request in self._requests():
            if request.is_store:
                records = port.records_of(request.slot_mapping)
                safetensors.torch.save_file({"records": records.cpu().contiguous()}, self._path(request))

    def after_load(self, port: RecordPort) -> tuple[int, int]:
        """Has the worker's canary (``port``) record every slot the inner connector loaded in
        this step, and break those whose records do not match the stored ones."""
        return self._land(port, failed=False)

    def after_failed_load(self, port: RecordPort) -> tuple[int, int]:
        """As `after_load`, every slot of the step's loads bad."""
        return self._land(port, failed=True)

    def _land(self, port: RecordPort, *, failed: bool) -> tuple[int, int]:
        """(slots verified, slots that failed) of the step's loads, all bad where the load ``failed``."""
        verified = bad_count = 0
        for request in self._requests():
            if request.is_store:
                continue
            count = len(request.slot_mapping)
            slots, tokens, positions, prev_slots = to_device(
                port.device, *landed_entries(request.slot_mapping.cpu().numpy(), request.token_ids[:count], start=0, prev_slot=-1)
            )
            landed = port.record_landed(slots, tokens=tokens, positions=positions, prev_slots=prev_slots)
            stored = None if failed else self._stored(request, count)
            if stored is None:
                bad = torch.ones(count, dtype=torch.bool, device=landed.device)
            else:
                bad = (landed != stored.to(landed.device)).any(dim=1)
            port.break_records(slots[bad.to(slots.device)])
            verified += count
            bad_count += int(bad.sum())
        return verified, bad_count

    def _stored(self, request, count: int) -> torch.Tensor | None:
        """The records stored with the request's blocks; None when missing, unreadable or of another length."""
        try:
            stored = safetensors.torch.load_file(self._path(request))["records"]
        except Exception:
            return None
        return stored if tuple(stored.shape) == (count, len(RECORD_FIELDS)) and stored.dtype == torch.int64 else None
