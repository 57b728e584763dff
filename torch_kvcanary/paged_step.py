"""The paged serving step's helpers: `context_slots`, the slots of one range of positions
per row of a block table, and `step_plan`, the host's plan of a step's ranges (the vLLM
plugin's), each beside its op's fake kernel."""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from .ops import c10_dtype_name, check_index_dtype, may_check_bounds, refusal


def _check_offsets_dtype(offsets: torch.Tensor) -> None:
    if offsets.dtype != torch.int64:
        raise TypeError(f"kv-canary: offsets must be an int64 tensor, got {c10_dtype_name(offsets.dtype)}")


@torch.library.register_fake("kvcanary::context_slots")
def _context_slots_fake(block_table, offsets, starts, block_size, num_entries, cut_slot=-1, check_bounds=True):
    # The checks of make_context_slots_plan (csrc/plan/context_slots_plan.cpp) that need no
    # data nor guards on symbolic sizes, with its messages.
    check_index_dtype(block_table, "block_table")
    check_index_dtype(starts, "starts")
    _check_offsets_dtype(offsets)
    if block_table.dim() != 2:
        raise ValueError(f"kv-canary: block_table must be [num_table_rows, max_blocks], got shape {list(block_table.shape)}")
    if offsets.dim() != 1:
        raise ValueError(f"kv-canary: offsets must be 1-D with num_rows + 1 entries, got shape {list(offsets.shape)}")
    for name, value in (("offsets", offsets), ("starts", starts)):
        if value.device != block_table.device:
            raise ValueError(f"kv-canary: {name} is on {value.device} but block_table is on {block_table.device}; put them on one device")
    return tuple(block_table.new_empty((num_entries,), dtype=torch.int64) for _ in range(4))


class ContextSlots(NamedTuple):
    """`context_slots`' entries, int64 ``[num_entries]`` each."""

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    rows: torch.Tensor


def context_slots(
    block_table: torch.Tensor,
    offsets: torch.Tensor,
    starts: torch.Tensor,
    *,
    block_size: int,
    num_entries: int,
    cut_slot: int = -1,
    check_bounds: bool = True,
) -> ContextSlots:
    """The slots of one range of positions per row of a paged block table, planned on the
    table's device from a few values per row: what a serving step verifies and records.

    Args:
        block_table: int32 or int64 ``[num_table_rows, max_blocks]``, any strides; row ``r``
            of the ranges reads its row ``r``.
        offsets: int64 ``[R + 1]``: row ``r``'s entries are ``offsets[r]`` to
            ``offsets[r + 1]``; 0 first, nondecreasing, ``num_entries`` last.
        starts: int32 or int64 ``[R]``: the position of each row's first entry.
        block_size: tokens per block.
        num_entries: ``offsets[R]``, known to the caller (the outputs' size).
        cut_slot: when >= 0, the previous slot of each row's first entry at a position
            > 0 (a window whose earlier blocks may be freed: the canary's padding slot).
        check_bounds: raise for offsets out of order (ValueError), a negative start or a
            position past the table (IndexError). With False such entries get slot and
            previous slot -1; nothing is read out of bounds. On CUDA the check costs a
            host sync, so it is skipped under torch.compile and CUDA-graph capture.

    Returns:
        `ContextSlots`: per entry at position ``p`` of row ``r``, the slot
        ``block_table[r, p // block_size] * block_size + p % block_size``, ``p``, the slot
        of ``p - 1`` (-1 at position 0, ``cut_slot`` as above) and ``r``.
    """
    for name, value in (("block_table", block_table), ("starts", starts)):
        check_index_dtype(value, name)
    _check_offsets_dtype(offsets)
    check_bounds = check_bounds and may_check_bounds(block_table)
    try:
        found = torch.ops.kvcanary.context_slots(block_table, offsets, starts, block_size, num_entries, cut_slot, check_bounds)
    except (ValueError, RuntimeError) as error:
        raise refusal(error, {"block_table": block_table, "starts": starts}) from None
    return ContextSlots(*found)


@torch.library.register_fake("kvcanary::step_plan")
def _step_plan_fake(computed, scheduled, firsts, block_size, blocks_packed):
    # The plan's length depends on the rows' values (its index sets' entries).
    for name, value in (("computed", computed), ("scheduled", scheduled), ("firsts", firsts)):
        if value.dtype != torch.int64:
            raise TypeError(f"kv-canary: {name} must be an int64 tensor, got {c10_dtype_name(value.dtype)}")
    for name, value in (("computed", computed), ("scheduled", scheduled), ("firsts", firsts)):
        if value.device.type != "cpu":
            raise ValueError(f"kv-canary: {name} is on {value.device}; the step's plan is host work: pass CPU tensors (torch.from_numpy)")
    if firsts.dim() != 2:
        raise ValueError(f"kv-canary: firsts must be [num_groups, num_rows] (one row per KV cache group), got shape {list(firsts.shape)}")
    plan = computed.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64)
    num_sets = STEP_SETS + firsts.shape[0]
    return plan, computed.new_empty((2, num_sets), dtype=torch.int64), computed.new_empty((), dtype=torch.bool)


class StepSet(enum.IntEnum):
    """The sets of `step_plan` before the KV cache groups' contexts, in the plan's order: the
    C++ enum StepSet (csrc/cpu/kernels/step_plan_cpu.h), name for name. KV cache group ``g``'s
    context is set ``STEP_SETS + g``."""

    WRITTEN = 0  # the positions the step writes
    TAIL = 1  # the rest of the last block before the step, not written (blocks_packed only)
    BLOCKS_WRITTEN = 2  # every position of the blocks the step writes into (blocks_packed only)
    RECORD_ORDER = 3  # the written tokens' indices in record order (an index set)


STEP_SETS = len(StepSet)
"""The number of `StepSet` sets, which come before the KV cache groups' contexts."""


class StepPlan(NamedTuple):
    """`step_plan`'s answer: ``plan`` (int64, on the CPU) and, per set, its ``bases`` in it
    and its ``counts`` of entries; whether the record order is the batch's."""

    plan: torch.Tensor
    bases: list[int]
    counts: list[int]
    in_batch_order: bool


def step_plan(computed: torch.Tensor, scheduled: torch.Tensor, firsts: torch.Tensor, *, block_size: int, blocks_packed: bool) -> StepPlan:
    """The host's plan of a paged serving step in one call: per request, the ranges of
    positions it writes, reads and refolds, packed as `context_slots` and `verify_context`
    take them (the contract is the schema's, csrc/ops.cpp).

    Args:
        computed: int64 ``[R]`` (CPU): each request's tokens in the KV cache before the step.
        scheduled: int64 ``[R]`` (CPU): the tokens the step runs for it.
        firsts: int64 ``[G, R]`` (CPU): the first position each KV cache group attends to
            (0 for full attention; a sliding window's first position), ``<= computed``.
        block_size: tokens per block.
        blocks_packed: the backend packs a block's tokens together, so a write to one
            slot changes its block's others (the tail and blocks-written sets are filled).
    """
    for name, value in (("computed", computed), ("scheduled", scheduled), ("firsts", firsts)):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
            got = c10_dtype_name(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"kv-canary: {name} must be an int64 tensor (torch.from_numpy of an int64 array), got {got}")
    try:
        plan, sets, in_batch_order = torch.ops.kvcanary.step_plan(computed, scheduled, firsts, block_size, blocks_packed)
    except (ValueError, RuntimeError) as error:
        raise refusal(error, {}) from None
    bases, counts = sets.tolist()
    return StepPlan(plan, bases, counts, bool(in_batch_order))


class StepPhase(enum.IntEnum):
    """Where a `PagedStep` call stands in the engine step: the C++ enum PagedStepPhase
    (csrc/core/paged_step.h), name for name. A backend whose write to a slot changes its
    block's other slots (``blocks_packed``) calls before and after the forward; any other
    calls once, after it."""

    WHOLE_STEP = 0
    BEFORE_FORWARD = 1
    AFTER_FORWARD = 2


class MailboxWord(enum.IntEnum):
    """The words of `PagedStep.mailbox`: the C++ enum MailboxWord (csrc/core/paged_step.h)."""

    STEP = 0  # the step of the last call that finished (-1: none yet)
    PHASE = 1  # and its phase
    VIOLATIONS = 2  # the canary's violations counter after it
    RING_START = 3  # the ring's write index when that step's first call began


@torch.library.register_fake("kvcanary::paged_step")
def _paged_step_fake(
    sources_table, block_tables, slot_mappings, sliding_windows, chunk_sizes, query_start_loc, seq_lens, positions,
    input_ids, history, history_known, history_rows, records, owner_tags, counters, ring, origins, mailbox, scratch,
    num_reqs, num_tokens, block_size, phase, step, every=1, padding_slot=-1,
):  # fmt: skip
    # The checks of make_paged_step_plan (csrc/plan/paged_step_plan.cpp) that need no data.
    if not len(block_tables) == len(slot_mappings) == len(sliding_windows) == len(chunk_sizes) >= 1:
        raise ValueError("kv-canary: pass one block table, slot mapping, sliding window and chunk size per KV cache group")
    for name, value in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("positions", positions)):
        check_index_dtype(value, name)
    for value in (*block_tables, *slot_mappings):
        check_index_dtype(value, "block_tables and slot_mappings")
    if scratch.dtype != torch.int64 or scratch.dim() != 1 or not scratch.is_contiguous() or scratch.device != records.device:
        raise ValueError(
            f"kv-canary: paged_step's scratch must be a contiguous 1-D int64 tensor on the canary's device ({records.device}), "
            f"got {scratch.dtype} of shape {list(scratch.shape)} on {scratch.device}"
        )
    buffers = {"query_start_loc": query_start_loc, "seq_lens": seq_lens, "positions": positions, "input_ids": input_ids}
    for name, value in buffers.items():
        if value is not None and value.device != records.device:
            raise ValueError(
                f"kv-canary: {name} is on {value.device} but the canary is on {records.device}; pass the step's buffers on the canary's device"
            )


def scratch_size(canary, block_tables: list[torch.Tensor], slot_mappings: list[torch.Tensor]) -> int:
    """The int64 values of scratch `kvcanary::paged_step` needs on the canary's device for
    any call on these buffers: as many requests as the block tables have rows and tokens as
    the slot mappings have entries (0 on the CPU, whose kernel needs none)."""
    if canary.device.type == "cpu":
        return 0
    num_reqs = min(table.shape[0] for table in block_tables)
    num_tokens = min(mapping.shape[0] for mapping in slot_mappings)
    return torch.ops.kvcanary.paged_step_scratch_size(len(block_tables), num_tokens, num_reqs, canary.capacity)


class PagedStep:
    """`kvcanary::paged_step` bound once to a canary and a paged engine's KV cache groups:
    each call is one step's canary work for every group, read from the engine's own step
    buffers, with no host work per layer, request or token and no wait on the device.

    Args:
        canary: the `KvCanary` whose records, counters and ring the step updates.
        block_tables: per KV cache group, the engine's block table (int32 or int64
            ``[>= requests, max_blocks]``; row ``r`` is request ``r``'s), a tensor it refills
            in place each step.
        slot_mappings: per group, the engine's slot mapping (``[>= tokens]``), likewise.
        block_size: tokens per block.
        sliding_windows, chunk_sizes: per group, its sliding window or attention chunk (0:
            none); a group attends from the first position they leave (`StepPhase`).

    ``mailbox`` (int64 ``[4]``, `MailboxWord`; pinned host memory on CUDA) is written last by
    each call; `finished` and `violations` read it through a NumPy view, without a copy.
    ``scratch`` is the kernels' working memory, allocated here once for the most requests
    and tokens the buffers hold (`scratch_size`; none on the CPU), so that a call allocates nothing."""

    def __init__(
        self,
        canary,
        block_tables: list[torch.Tensor],
        slot_mappings: list[torch.Tensor],
        *,
        block_size: int,
        sliding_windows: list[int] | None = None,
        chunk_sizes: list[int] | None = None,
    ):
        groups = len(block_tables)
        sliding_windows = [0] * groups if sliding_windows is None else [int(w or 0) for w in sliding_windows]
        chunk_sizes = [0] * groups if chunk_sizes is None else [int(c or 0) for c in chunk_sizes]
        self.canary = canary
        self.block_size = block_size
        pinned = canary.device.type == "cuda"
        self.mailbox = torch.full((len(MailboxWord),), -1, dtype=torch.int64, pin_memory=pinned)
        self._mail = self.mailbox.numpy()
        self._op = torch.ops.kvcanary.paged_step.default
        self._groups = (canary._bound.table, list(block_tables), list(slot_mappings), sliding_windows, chunk_sizes)
        self.scratch = torch.empty(scratch_size(canary, block_tables, slot_mappings), dtype=torch.int64, device=canary.device)
        self._tables = (canary._records, canary._owner_tags, canary._counters, canary._ring, canary._origins, self.mailbox, self.scratch)
        self._padding = -1 if canary.padding_slot is None else canary.padding_slot

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        positions: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        *,
        num_reqs: int,
        num_tokens: int,
        step: int,
        phase: StepPhase = StepPhase.WHOLE_STEP,
        every: int = 1,
        history: torch.Tensor | None = None,
        history_known: torch.Tensor | None = None,
        history_rows: torch.Tensor | None = None,
    ) -> None:
        """Step ``step``'s canary work in phase ``phase`` (the contract is the schema's,
        csrc/ops.cpp): request ``r < num_reqs`` runs tokens ``[query_start_loc[r],
        query_start_loc[r + 1])`` and has ``seq_lens[r]`` tokens once the step is done;
        token ``t`` has ``positions[t]`` and ``input_ids[t]``. The token history
        (``history[history_rows[r], p]`` where ``history_known``) is checked as
        `KvCanary.verify_context` checks it, and under ``every`` > 1 a rotating sample of the
        context's blocks (the turn of ``step``). Pass the engine's whole buffers: no slicing."""
        try:
            self._op(
                *self._groups, query_start_loc, seq_lens, positions, input_ids, history, history_known, history_rows,
                *self._tables, num_reqs, num_tokens, self.block_size, phase, step, every, self._padding,
            )  # fmt: skip
        except (ValueError, RuntimeError) as error:
            raise refusal(error, {"query_start_loc": query_start_loc, "seq_lens": seq_lens, "positions": positions}) from None

    def finished(self, step: int) -> bool:
        """Whether the call of ``step`` (its last phase) has finished on the device."""
        return self._mail[MailboxWord.STEP] >= step

    @property
    def violations(self) -> int:
        """The canary's violations counter when the last finished call ended."""
        return int(self._mail[MailboxWord.VIOLATIONS])
