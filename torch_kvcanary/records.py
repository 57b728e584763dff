"""The layout of a `KvCanary`'s device tables: a record's fields (`RECORD_FIELDS`), the
bytes it keeps per slot (`SLOT_BYTES`), and the tables a paged step reads and updates
(`StepTables`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

RECORD_FIELDS = ("token", "position", "chain", "fold")
"""The columns of `KvCanary.records`, SGLang's canary-buffer order."""
FOLD = RECORD_FIELDS.index("fold")
"""The records' fold column; those before it (token, position, chain) do not depend on how the KV heads are sharded."""

SLOT_BYTES = 8 * (len(RECORD_FIELDS) + 1)
"""Device bytes a `KvCanary` holds per tracked slot: its record (four int64 fields) and its
owner tag (one int64)."""


class StepTables(NamedTuple):
    """The tables of a `KvCanary` that a paged step reads and updates in place
    (`KvCanary.step_tables`, what `PagedStep` passes to `kvcanary::paged_step`)."""

    sources_table: torch.Tensor  # the bound sources' table (`SourceTable.table`)
    records: torch.Tensor  # int64 [capacity, 4]
    owner_tags: torch.Tensor  # int64 [capacity]
    counters: torch.Tensor  # int64 [counters]
    ring: torch.Tensor  # int64 [ring_capacity, 8]: the violation ring
    origins: torch.Tensor  # int64 [ring_capacity, 3]: each ring row's (step, group, row)
