"""D's side of a NIXL transfer as data: a load NIXL is reading (`PendingLoad`), one that
landed and awaits its first read (`LandedLoad`), the loads that landed together as the host
arrays of one comparison (`LandingBatch`), and the kind a failed load is counted under
(`fault_kind`). `worker.NixlWorker` compares and counts with them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..... import layouts
from ..port import landed_entries
from .orders import LoadOrder, slots_of
from .region import FIELDS
from .sharding import Sharding


@dataclass
class PendingLoad:
    """D: a load whose blocks NIXL is reading, and how the prefill side holds its heads
    (None: the load carries no records of P's to compare with, and ``why``; ``trusted``:
    its KV is taken as it landed, unverified, else every slot of it is bad)."""

    load: LoadOrder
    remote: Sharding | None  # the prefill side's
    why: str
    same_heads: bool  # this rank holds exactly the heads of its one source rank: the folds compare
    trusted: bool = False


@dataclass
class LandedLoad:
    """D: a load that landed and that no step has read yet: its slots from prompt position
    ``start`` on, the request's tokens of positions [0, end), and whether they were compared
    with records of P's."""

    slots: np.ndarray
    tokens: list[int]
    start: int
    compared: bool


class LandingBatch:
    """D: the loads that landed together, as host arrays with an entry per landed slot: the
    slot, its token and position, the slot of its request's position before it (-1 at
    position 0) and the root its request's chain starts from (``roots``: each load's
    `RecordPort.request_root`, given one per load; None: the anchor); and how each is
    compared with P's rows: ``whole_records`` (1: its records,
    the heads being sharded alike on both sides), ``digest_rows`` (the entries compared by
    token, position, chain and their heads' digests), ``compared`` (1: the load carries rows
    of P's, the slot is compared with them), ``no_records`` (1: the load carries no rows of
    P's and is not trusted unverified, the slot is bad)."""

    def __init__(self, landing: list[PendingLoad], block_size: int, roots: list[int] | None = None):
        self.block_size = block_size
        entries = [self._entries(pending.load, block_size) for pending in landing]
        self.request_slots = [slots for slots, *_ in entries]
        self.slots, self.tokens, self.positions, self.prev_slots = (np.concatenate(column) for column in zip(*entries))
        lengths = [len(slots) for slots in self.request_slots]
        self.roots = None if roots is None else np.repeat(np.asarray(roots, dtype=np.int64), lengths)
        has_records = np.repeat([pending.remote is not None for pending in landing], lengths)
        same_heads = np.repeat([pending.same_heads for pending in landing], lengths)
        trusted = np.repeat([pending.trusted for pending in landing], lengths)
        self.whole_records = (has_records & same_heads).astype(np.int64)
        self.compared = has_records.astype(np.int64)
        self.no_records = (~has_records & ~trusted).astype(np.int64)
        self.digest_rows = np.flatnonzero(has_records & ~same_heads).astype(np.int64)

    @staticmethod
    def _entries(load: LoadOrder, block_size: int) -> tuple[np.ndarray, ...]:
        """The load's `port.landed_entries`: its slots chain through that of the position before ``start``."""
        slots = slots_of(load.block_ids, load.end, block_size, start=max(load.start - 1, 0))
        prev_slot = int(slots[0]) if load.start else -1
        slots = slots[1:] if load.start else slots
        return landed_entries(slots, load.tokens[load.start : load.end], start=load.start, prev_slot=prev_slot)

    def unrecorded_block_slots(self) -> np.ndarray:
        """The slots of the landed blocks that hold no landed token (NIXL writes whole blocks)."""
        every = layouts.vllm_block_slots(np.unique(self.slots // self.block_size), self.block_size)
        return np.setdiff1d(every, self.slots, assume_unique=True)


def fault_kind(expected: list[int], theirs: list[int], tokens: list[int], expected_there: list[int] | None, *, first: bool = True) -> str:
    """The kind (`stats.FAILED_KINDS`) of a failed load, from its first differing slot:
    ``expected`` the request's record there and ``theirs`` P's row that landed there (each
    token, position and chain); ``tokens`` the request's tokens by position, and
    ``expected_there`` its record of P's position where D landed that position (else None).
    P's row equal to the request's: ``bytes``, the bytes changed after P recorded them. P's
    row all zeros: ``unknown``, a row P never wrote. P's row naming another position of
    the request that holds its token (and, where D landed that position, its chain):
    ``shifted``. P's row of the request's token and position under another chain at the
    load's ``first`` slot (where the chain comes from the request's root, or from D's own
    record of the position before): ``identity``, KV P computed for the same tokens under
    another identity (a LoRA adapter, a cache salt) than D's request has. Anything else:
    ``other_request``."""
    if theirs == expected:
        return "bytes"
    if not any(theirs):
        return "unknown"
    token, position = theirs[FIELDS.index("token")], theirs[FIELDS.index("position")]
    if first and token == expected[FIELDS.index("token")] and position == expected[FIELDS.index("position")]:
        return "identity"
    own_token = position != expected[FIELDS.index("position")] and 0 <= position < len(tokens) and tokens[position] == token
    if own_token and (expected_there is None or expected_there == theirs):
        return "shifted"
    return "other_request"
