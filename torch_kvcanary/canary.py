"""`KvCanary`: SGLang's per-slot canary records, kept beside any engine's KV cache.

Each slot the engine writes gets four int64 fields, in SGLang's canary-buffer order:
the token id, the position, a hash chain through the same request's previous slot, and
the fold of the slot's bytes. ``record`` stores them after a write, ``verify`` checks them
before a read: changed bytes, a slot that now belongs to another request or position
(a block table pointing at the wrong page, a page freed and reused) and a broken chain
(an off-by-one position, a wrong previous page) each set their own reason bit. Flagged
entries go to a violation ring on the device; ``poll`` reads it, once per engine step,
and applies the policy (log, raise, a callable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .binding import SourceTable
from .canary_inputs import check_entry_input, check_roots, given_roots  # (importing it registers the ops' fake kernels)
from .host_reads import HostReader, others_count
from .ops import integer_view, may_check_bounds, refusal
from .policy import apply_policy, check_policy
from .records import FOLD, RECORD_FIELDS, SLOT_BYTES, StepTables
from .sources import HashMode, KvSource, active_sources, as_mode, as_sources, folded_bytes
from .violations import ORIGIN_FIELDS, VIOLATION_FIELDS, KvCorruptionError, Violation


def _counter_index() -> dict[str, int]:
    return {name: i for i, name in enumerate(torch.ops.kvcanary.canary_counters())}


class KvCanary:
    """SGLang's canary records for every slot of a KV cache, on the sources' device.

    Args:
        sources: the sources whose bytes each slot's fold covers (`layouts` builds them).
        mode: how much of each slot the fold reads (`HashMode`).
        capacity: slots ``[0, capacity)`` are tracked; at most the smallest source capacity.
        ring_capacity: rows of the violation ring; violations past it before a `poll` are
            dropped, and counted.
        on_violation: what `poll` does with violations: ``"log"`` (one WARNING line each on
            the ``torch_kvcanary`` logger), ``"raise"`` (`KvCorruptionError`), a callable
            (gets the list), or None.
        name: the ``launch_tag`` of the log lines.
        padding_slot: a slot the engine writes for padded entries (SGLang's 0): verify never
            checks it, and does not check a chain through it. Negative slots are always
            padding. Record stores it like any slot, as SGLang does.

    ``record`` and ``verify`` never synchronise with the host: both run inside
    ``torch.compile(fullgraph=True)`` and CUDA graphs. Eager calls raise IndexError for a
    slot or previous slot past the capacity; where they cannot raise (compiled or captured
    CUDA code) the entry is skipped and reported as SLOT_OUT_OF_RANGE.
    """

    def __init__(
        self,
        sources: KvSource | Iterable[KvSource],
        *,
        mode: HashMode = HashMode.ALL,
        capacity: int | None = None,
        ring_capacity: int = 1024,
        on_violation: str | Callable[[list[Violation]], object] | None = "log",
        name: str = "KV",
        padding_slot: int | None = None,
    ):
        self.sources = tuple(as_sources(sources))
        self.mode = as_mode(mode)
        if not self.sources:
            raise ValueError("kv-canary: KvCanary needs at least one source")
        devices = {s.as_view().device for s in self.sources}
        if len(devices) != 1:
            raise ValueError(f"kv-canary: KvCanary sources must share one device, got {sorted(map(str, devices))}")
        smallest = min(s.capacity for s in self.sources)
        if capacity is None:
            capacity = smallest
        if not 0 < capacity <= smallest:
            raise ValueError(f"kv-canary: KvCanary capacity must be in [1, {smallest}] (the smallest source capacity), got {capacity}")
        if isinstance(ring_capacity, bool) or not isinstance(ring_capacity, int) or ring_capacity < 1:
            raise ValueError(f"kv-canary: KvCanary ring_capacity must be an int >= 1, got {ring_capacity!r}")
        check_policy(on_violation, name="on_violation", choices="'log', 'raise', a callable taking a list of Violation, or None")
        if not isinstance(name, str):
            raise TypeError(f"kv-canary: KvCanary name must be a str, got {type(name).__name__}")
        if padding_slot is not None and (
            isinstance(padding_slot, bool) or not isinstance(padding_slot, int) or not 0 <= padding_slot < capacity
        ):
            raise ValueError(f"kv-canary: KvCanary padding_slot must be None or a slot in [0, {capacity}), got {padding_slot!r}")
        self.capacity = capacity
        self.device = devices.pop()
        self.ring_capacity = ring_capacity
        self.on_violation = on_violation
        self.name = name
        self.padding_slot = padding_slot
        active = active_sources(self.sources, self.mode)
        self._views = [integer_view(s.as_view()) for s in active]
        self._read_bytes = [folded_bytes(s, self.mode) for s in active]
        # The sources bound once: every eager call passes this table, at a host cost that
        # does not grow with the number of sources; compiled code passes the views.
        self._bound = SourceTable(self._views, self._read_bytes)
        self._counter = _counter_index()
        self._records = torch.zeros(capacity, len(RECORD_FIELDS), dtype=torch.int64, device=self.device)
        self._owner_tags = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._counters = torch.zeros(len(self._counter), dtype=torch.int64, device=self.device)
        self._ring = torch.zeros(ring_capacity, VIOLATION_FIELDS, dtype=torch.int64, device=self.device)
        self._origins = torch.full((ring_capacity, ORIGIN_FIELDS), -1, dtype=torch.int64, device=self.device)
        self._host = HostReader(self._counters, self._ring, self._origins)
        self._no_tag = torch.full((1,), -1, dtype=torch.int64, device=self.device)

    @staticmethod
    def device_bytes(capacity: int, ring_capacity: int = 1024) -> int:
        """Device bytes a `KvCanary` of ``capacity`` slots holds: `SLOT_BYTES` per slot, plus
        what does not grow with the capacity (its violation ring, its counters and the
        one-element "no tag"), its ring rows' origins among them."""
        return capacity * SLOT_BYTES + 8 * (ring_capacity * (VIOLATION_FIELDS + ORIGIN_FIELDS) + len(_counter_index()) + 1)

    @property
    def nbytes(self) -> int:
        """Device bytes this canary's tensors hold (`device_bytes` of its capacity and ring)."""
        return sum(t.nbytes for t in (self._records, self._owner_tags, self._counters, self._ring, self._origins, self._no_tag))

    @property
    def records(self) -> torch.Tensor:
        """int64 ``[capacity, 4]``: each slot's (token, position, chain, fold), zeros where
        never recorded; token and position are -1 where a record call did not give them."""
        return self._records

    @property
    def fingerprints(self) -> torch.Tensor:
        """The fold column of `records`."""
        return self._records[:, FOLD]

    def record(
        self,
        slots: torch.Tensor,
        tag: torch.Tensor | int = -1,
        *,
        positions: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        prev_slots: torch.Tensor | None = None,
        check_bounds: bool = True,
        roots: torch.Tensor | None = None,
    ) -> None:
        """Store the records of ``slots`` after the engine wrote them.

        ``positions`` and ``tokens`` (-1 when not given) and ``prev_slots`` (the slot of the
        same request's previous position, -1 at its first; all -1 when not given) are shaped
        like ``slots``; ``tag`` (an int, or int64 values shaped like ``slots``) is the owner a
        later ``verify(tag=...)`` expects. Entries are applied in order, so entry i may chain
        through the slot entry i - 1 wrote. Negative slots are skipped.

        ``roots`` (int64, shaped like ``slots``, on the canary's device) gives each entry the
        chain it stores where it has no previous slot (``prev_slots[i] < 0``, a request's
        first position) in place of the anchor: its request's identity, which then runs
        through every later link of the request (docs/spec.md). An entry without identity
        beside rooted ones takes the anchor's value as its root.

        On CUDA, runs of entries that chain through each other (``prev_slots[i] ==
        slots[i - 1]``) are applied concurrently: a run must not chain through a slot another
        run of the same call writes, and a slot is written at most once per call.

        ``check_bounds`` False skips the range check of ``slots`` and ``prev_slots``, which
        waits on a GPU, for slots in range by construction (the engine's own blocks); an
        entry out of range is then skipped and reported, as in captured CUDA code.
        """
        for value, name in ((slots, "slots"), (positions, "positions"), (tokens, "tokens"), (prev_slots, "prev_slots")):
            check_entry_input(value, name)
        check_roots(roots)
        try:
            self._call(
                torch.ops.kvcanary.record, slots, positions, tokens, prev_slots, self._tag_tensor(tag),
                self._records, self._owner_tags, self._counters, self._ring, check_bounds and may_check_bounds(slots),
                *given_roots(roots),
            )  # fmt: skip
        except (ValueError, RuntimeError) as error:
            raise refusal(error, {"slots": slots, "positions": positions, "tokens": tokens, "prev_slots": prev_slots}) from None

    def verify(
        self,
        slots: torch.Tensor,
        tag: torch.Tensor | int | None = None,
        *,
        positions: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        prev_slots: torch.Tensor | None = None,
        roots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Check ``slots`` before the engine reads them: a bool tensor shaped like ``slots``,
        True where a check failed. The fold is always checked; the position, the token
        (entries with ``tokens[i] == -1`` are not), the chain through ``prev_slots`` and the
        owner ``tag`` when given. Each flagged entry appends a row to the violation ring
        (read it with `poll`); padding entries are never flagged.

        With ``roots`` (as `record` takes them) an entry whose ``prev_slots`` value is
        negative expects ``roots[i]`` as its chain, and a mismatch there is
        VERIFY_IDENTITY_MISMATCH (the slot's KV was recorded under another identity) in place
        of VERIFY_CHAIN_HASH_MISMATCH; without ``roots`` every check is as before. ``roots``
        without ``prev_slots`` is refused (ValueError): no chain is checked then, so no root
        would be (the op itself takes them, unused: docs/spec.md, section 6)."""
        for value, name in ((slots, "slots"), (positions, "positions"), (tokens, "tokens"), (prev_slots, "prev_slots")):
            check_entry_input(value, name)
        check_roots(roots)
        if roots is not None and prev_slots is None:
            raise ValueError(
                "kv-canary: verify was given roots but no prev_slots, without which no chain is checked and so no root; "
                "pass prev_slots (negative at each request's first position, where its root is compared), or no roots"
            )
        tags = None if tag is None else self._tag_tensor(tag)
        padding = -1 if self.padding_slot is None else self.padding_slot
        try:
            return self._call(
                torch.ops.kvcanary.verify, slots, positions, tokens, prev_slots, tags,
                self._records, self._owner_tags, self._counters, self._ring, padding, may_check_bounds(slots), *given_roots(roots),
            )  # fmt: skip
        except (ValueError, RuntimeError) as error:
            raise refusal(error, {"slots": slots, "positions": positions, "tokens": tokens, "prev_slots": prev_slots}) from None

    def step_tables(self) -> StepTables:
        """The tables a paged step (`PagedStep`) binds once and updates in place: the bound
        sources, the records, owner tags, counters, violation ring and the ring rows' origins."""
        return StepTables(self._bound.table, self._records, self._owner_tags, self._counters, self._ring, self._origins)

    def _call(self, op: torch._ops.OpOverloadPacket, *args):
        """``op`` over this canary's sources: its bound overload over the bound table, or under
        torch.compile its ``Tensor[]`` form, whose schema names the sources it reads."""
        if torch.compiler.is_compiling():
            return op(self._views, self._read_bytes, *args)
        return op.bound(self._bound.table, *args)

    def check_sources(self) -> None:
        """Raises a ``kv-canary:`` ValueError when a source changed its data pointer, shape or
        strides since this canary was built (`SourceTable.check`); the canary then reads the
        old memory, so build a new one over the new cache. O(sources): for the places where
        an engine may have re-allocated its cache, not per step."""
        self._bound.check()

    def _tag_tensor(self, tag: torch.Tensor | int) -> torch.Tensor:
        if isinstance(tag, int) and tag == -1 and not isinstance(tag, bool):
            return self._no_tag
        if isinstance(tag, torch.Tensor):
            return tag if tag.dtype == torch.int64 else tag.to(torch.int64)
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"kv-canary: tag must be an int or an int64 tensor shaped like slots, got {type(tag).__name__}")
        return torch.full((1,), tag, dtype=torch.int64, device=self.device)

    def poll(self, *, group=None) -> list[Violation]:
        """The violations flagged since the last poll (eager; reads the ring), after applying
        ``on_violation`` to them.

        With a ``torch.distributed`` process group, every rank of it must call poll: the
        ranks all-reduce their counts, and when any rank saw a violation every rank applies
        its policy (under "raise" they all raise), so one rank never waits for another that
        stopped.
        """
        counters = self._host.counters()
        pending = counters[self._counter["ring_write"]]
        rows = self._host.ring_rows(min(pending, self.ring_capacity)) if pending else []
        origins = self._host.origins(len(rows)) if rows else []
        if pending:
            self._counters[self._counter["ring_write"]].zero_()
            self._origins[: len(rows)].fill_(-1)
        violations = [Violation.from_row(row, origin) for row, origin in zip(rows, origins)]
        dropped = pending - len(rows)
        local = pending
        elsewhere = others_count(local, group, self.device) if group is not None else 0
        if local + elsewhere > 0:
            apply_policy(
                self.on_violation,
                violations,
                lines=lambda: self._lines(violations, dropped, elsewhere),
                error=lambda lines: KvCorruptionError(lines, violations),
            )
        return violations

    def _lines(self, violations: list[Violation], dropped: int, elsewhere: int) -> list[str]:
        """One line per violation, then one for those dropped and one for those of other ranks."""
        lines = [v.line(self.name) for v in violations]
        if dropped:
            lines.append(
                f"kv_canary: launch_tag={self.name} {dropped} more violations dropped (ring of {self.ring_capacity} rows full); poll more often or raise ring_capacity"
            )
        if elsewhere:
            lines.append(f"kv_canary: launch_tag={self.name} {elsewhere} violations on other ranks of the process group")
        return lines

    def stats(self, *, wait: bool = True) -> dict[str, int]:
        """The device counters: ``record_calls``, ``verify_calls``, ``slots_recorded``,
        ``slots_verified``, ``violations`` (every one, including those dropped),
        ``ring_overflow`` (dropped because the ring was full) and ``ring_write`` (rows
        waiting for the next poll). With ``wait`` (eager) they are read as the device's
        work queued so far leaves them; without it the device is never waited for: on CUDA
        they are those of the latest copy to the host that has finished (a copy is queued
        at each call, so they lag the device by the calls whose copies are in flight; all
        zero before the first has finished), on the CPU the current ones. Each counter only
        grows, so a lagging read is an earlier value of it."""
        values = self._host.counters() if wait else self._host.counters_without_waiting()
        return {name: values[i] for name, i in self._counter.items()}

    def prometheus_collector(self):
        """A ``prometheus_client`` collector of `stats`, labelled with this canary's name:
        ``prometheus_client.REGISTRY.register(canary.prometheus_collector())``. Needs the
        ``prometheus`` extra (``pip install torch_kvcanary[prometheus]``)."""
        from .metrics import CanaryCollector

        return CanaryCollector(self)

    def copy_records(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Give ``dst_slots`` the records and owner tags of ``src_slots``, after the engine
        copied those slots' bytes (vLLM's copy-on-write of a partially hit block, a block
        moved between pools): a record holds the slot's token, position, chain and fold,
        none of which depends on where the bytes are. ``src_slots`` and ``dst_slots`` are
        int32 or int64 tensors of one shape on the canary's device, every slot in
        ``[0, capacity)``, the destinations distinct; the sources are read before any
        destination is written. Eager (the range check syncs); nothing is changed when an
        argument is refused."""
        for value, name in ((src_slots, "src_slots"), (dst_slots, "dst_slots")):
            self._check_slot_tensor(value, name)
        if src_slots.shape != dst_slots.shape:
            raise ValueError(
                f"kv-canary: src_slots and dst_slots must have one shape, got {tuple(src_slots.shape)} and {tuple(dst_slots.shape)}"
            )
        src, dst = src_slots.reshape(-1).long(), dst_slots.reshape(-1).long()
        if src.numel() == 0:
            return
        for value, name in ((src, "src_slots"), (dst, "dst_slots")):
            low, high = int(value.min()), int(value.max())
            if low < 0 or high >= self.capacity:
                raise IndexError(f"kv-canary: {name} must lie in [0, {self.capacity}), got values in [{low}, {high}]")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError("kv-canary: dst_slots must be distinct (each destination gets one source's record)")
        self._records[dst] = self._records[src]
        self._owner_tags[dst] = self._owner_tags[src]

    def refold(self, slots: torch.Tensor, *, check_bounds: bool = True) -> None:
        """Recompute the fold of ``slots`` after the engine changed their bytes on purpose,
        keeping each slot's token, position, chain and owner: a backend that packs a block's
        tokens together changes the bytes of the block's other slots when it writes one
        (`layouts.VLLM_BLOCK_PACKED_BACKENDS`). ``slots`` are int32 or int64 on the canary's
        device; negative ones are skipped, the others must lie in ``[0, capacity)``
        (IndexError; where a call cannot raise, in compiled or captured CUDA code, or with
        ``check_bounds`` False, which skips the check that waits on a GPU, a slot out of
        range is skipped)."""
        self._check_slot_tensor(slots, "slots")
        try:
            self._call(torch.ops.kvcanary.refold, slots, self._records, check_bounds and may_check_bounds(slots))
        except (ValueError, RuntimeError) as error:
            raise refusal(error, {"slots": slots}) from None

    def invalidate(self, slots: torch.Tensor, *, where: torch.Tensor | None = None, refold: bool = True) -> None:
        """Make `verify` flag ``slots`` (a fold mismatch) until a `record` call writes them
        again: for slots the engine knows to be bad or stale (blocks it was told to
        recompute, KV loaded that does not match what was stored with it). Each fold is
        recomputed from the slot's bytes as they are now (`refold`) and then changed, so it
        differs from the fold of those bytes however many times a slot is invalidated; the
        token, position, chain and owner are kept. ``slots`` are int32 or int64 on the
        canary's device; negative ones are skipped, the others must lie in
        ``[0, capacity)`` (IndexError). Eager (the range check syncs).

        With ``where``, a bool tensor shaped like ``slots`` on the canary's device, only the
        slots where it is True are invalidated, and nothing waits on the device (for a
        verdict the device has not handed to the host): ``slots`` must then be distinct and
        in ``[0, capacity)``, as the caller knows them to be (the engine's own blocks); they
        are not checked.

        ``refold`` False skips the refold, for slots the caller has just recorded from their
        bytes as they are (their folds are current): one pass over their bytes fewer."""
        if where is None:
            if refold:
                self.refold(slots)
            kept = slots.reshape(-1).long()
            self._records[torch.unique(kept[kept >= 0]), FOLD] ^= 1
            return
        self._check_slot_tensor(slots, "slots")
        if not isinstance(where, torch.Tensor) or where.dtype != torch.bool or where.shape != slots.shape:
            raise ValueError(
                f"kv-canary: where must be a bool tensor shaped like slots {tuple(slots.shape)}, got "
                f"{getattr(where, 'dtype', type(where).__name__)} {tuple(getattr(where, 'shape', ()))}"
            )
        if where.device != self.device:
            raise ValueError(f"kv-canary: where must be on the canary's device {self.device}, got {where.device}")
        if refold:
            self.refold(slots, check_bounds=False)
        flat = slots.reshape(-1).long()
        self._records[flat, FOLD] ^= where.reshape(-1).long()

    def _check_slot_tensor(self, value, name: str) -> None:
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"kv-canary: {name} must be an int32 or int64 tensor, got {getattr(value, 'dtype', type(value).__name__)}")
        if value.device != self.device:
            raise ValueError(f"kv-canary: {name} must be on the canary's device {self.device}, got {value.device}")

    def owners(self, slots: torch.Tensor) -> torch.Tensor:
        """The tags ``slots`` were last recorded under (-1: never, or padding)."""
        in_range = (slots >= 0) & (slots < self.capacity)
        return torch.where(in_range, self._owner_tags[torch.where(in_range, slots, 0).long()], -1)

    def violations(self, slots: torch.Tensor, tag: torch.Tensor | int | None = None) -> list[int]:
        """The slots of ``slots`` that `verify` flags, in order (eager; syncs)."""
        return slots[self.verify(slots, tag=tag)].tolist()
