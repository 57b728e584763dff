"""`KvCanary`: record each slot's fingerprint when it is written, verify it when it is read."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .ops import Source, _as_sources, fold
from .sources import HashMode, _as_mode


def _capacity(source: Source) -> int:
    view = source.as_view()
    return view.shape[0] * view.shape[1]


class KvCanary:
    """Fingerprints of every slot of a KV cache, kept on the sources' device.

    ``record(slots)`` after the engine writes slots, ``verify(slots)`` before it reads them
    again: True marks a slot whose bytes changed in between. Negative slots are padding (never
    recorded, never flagged). Neither call synchronises with the host, so both work inside
    ``torch.compile(fullgraph=True)`` and CUDA graphs; slots outside ``[0, capacity)`` are
    not recorded, and verify flags them (a caller bug, reported without a sync).

    A fingerprint only says the bytes are those last recorded. When two writers can both
    record a slot (a page freed while still read, then reused), pass ``tag`` (the owner:
    a request id, a position) to both calls: verify then also flags slots last recorded
    under another tag, as SGLang's canary does with its token and position fields.
    """

    def __init__(self, sources: Source | Iterable[Source], *, mode: HashMode = HashMode.ALL, capacity: int | None = None):
        self.sources = tuple(_as_sources(sources))
        self.mode = _as_mode(mode)
        if not self.sources:
            raise ValueError("kv-canary: KvCanary needs at least one source")
        devices = {s.as_view().device for s in self.sources}
        if len(devices) != 1:
            raise ValueError(f"kv-canary: KvCanary sources must share one device, got {sorted(map(str, devices))}")
        smallest = min(_capacity(s) for s in self.sources)
        if capacity is None:
            capacity = smallest
        if not 0 < capacity <= smallest:
            raise ValueError(f"kv-canary: KvCanary capacity must be in [1, {smallest}] (the smallest source capacity), got {capacity}")
        self.capacity = capacity
        self.device = devices.pop()
        # One spare entry at the end takes the writes of padding and out-of-range slots.
        self._fingerprints = torch.zeros(capacity + 1, dtype=torch.int64, device=self.device)
        self._tags = torch.full((capacity + 1,), -1, dtype=torch.int64, device=self.device)

    @property
    def fingerprints(self) -> torch.Tensor:
        """The recorded fingerprint of every slot (0 where never recorded)."""
        return self._fingerprints[: self.capacity]

    def _fold(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fingerprints now, table index, in-range mask) for ``slots``."""
        in_range = (slots >= 0) & (slots < self.capacity)
        index = torch.where(in_range, slots, self.capacity).long()
        current = fold(self.sources, torch.where(in_range, slots, -1), mode=self.mode, check_bounds=False)
        return current, index, in_range

    def record(self, slots: torch.Tensor, tag: torch.Tensor | int = -1) -> None:
        """Store the current fingerprints of ``slots`` (after the engine wrote them), and
        ``tag`` (an int, or int64 values shaped like ``slots``) as their owner."""
        current, index, _ = self._fold(slots)
        index = index.reshape(-1)
        self._fingerprints.index_put_((index,), current.reshape(-1))
        self._tags.index_put_((index,), torch.as_tensor(tag, dtype=torch.int64, device=self.device).expand(slots.shape).reshape(-1))

    def verify(self, slots: torch.Tensor, tag: torch.Tensor | int | None = None) -> torch.Tensor:
        """A bool tensor shaped like ``slots``: True where the slot's bytes changed since
        `record`, where it was last recorded under another ``tag`` (when given), or where the
        slot is past the capacity; False for padding."""
        current, index, in_range = self._fold(slots)
        flagged = current != self._fingerprints[index]
        if tag is not None:
            flagged |= self._tags[index] != tag
        return torch.where(in_range, flagged, slots >= self.capacity)

    def owners(self, slots: torch.Tensor) -> torch.Tensor:
        """The tags ``slots`` were last recorded under (-1: never, or padding)."""
        in_range = (slots >= 0) & (slots < self.capacity)
        return torch.where(in_range, self._tags[torch.where(in_range, slots, self.capacity).long()], -1)

    def violations(self, slots: torch.Tensor, tag: torch.Tensor | int | None = None) -> list[int]:
        """The slots of ``slots`` that `verify` flags, in order (eager; syncs)."""
        return slots[self.verify(slots, tag)].tolist()
