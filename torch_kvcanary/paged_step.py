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
