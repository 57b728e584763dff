"""`PagedStep`: `kvcanary::paged_step` bound once to a canary and a paged engine's KV cache
groups, beside the op's fake kernel; `StepPhase` and `MailboxWord` name the op's phases and
mailbox words."""

from __future__ import annotations

import enum

import torch

from .ops import check_index_dtype, refusal


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
    num_reqs, num_tokens, block_size, phase, step, every=1, padding_slot=-1, roots=None,
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
        if value is not None:
            _check_step_device(value, name, records)
    if roots is not None:
        if roots.dtype != torch.int64:
            raise ValueError(f"kv-canary: roots must be an int64 tensor (64-bit hashes), got {roots.dtype}; pass roots as int64")
        _check_step_buffer(roots, "roots", num_reqs, "one per request", records)


def _check_step_buffer(value: torch.Tensor, name: str, needed: int, entries: str, records: torch.Tensor) -> None:
    # check_step_buffer's shape, size and device checks (csrc/plan/paged_step_plan.cpp), with its messages.
    if value.dim() != 1 or not value.is_contiguous():
        raise ValueError(
            f"kv-canary: {name} must be a contiguous 1-D tensor, got shape {list(value.shape)} and strides {list(value.stride())}"
        )
    if value.numel() < needed:
        raise ValueError(
            f"kv-canary: {name} has {value.numel()} entries but the step needs {needed} ({entries}); pass the engine's whole buffer"
        )
    _check_step_device(value, name, records)


def _check_step_device(value: torch.Tensor, name: str, records: torch.Tensor) -> None:
    if value.device != records.device:
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
        tables = canary.step_tables()
        self._groups = (tables.sources_table, list(block_tables), list(slot_mappings), sliding_windows, chunk_sizes)
        self.scratch = torch.empty(scratch_size(canary, block_tables, slot_mappings), dtype=torch.int64, device=canary.device)
        self._tables = (tables.records, tables.owner_tags, tables.counters, tables.ring, tables.origins, self.mailbox, self.scratch)
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
        roots: torch.Tensor | None = None,
    ) -> None:
        """Step ``step``'s canary work in phase ``phase`` (the contract is the schema's,
        csrc/ops.cpp): request ``r < num_reqs`` runs tokens ``[query_start_loc[r],
        query_start_loc[r + 1])`` and has ``seq_lens[r]`` tokens once the step is done;
        token ``t`` has ``positions[t]`` and ``input_ids[t]``. The token history
        (``history[history_rows[r], p]`` where ``history_known``) is checked as
        `KvCanary.verify` checks a token, and under ``every`` > 1 a rotating sample of the
        context's blocks (the turn of ``step``). ``roots`` (int64 ``[>= num_reqs]``, one per
        request in the rows' order; None: the anchor) is request ``r``'s identity: the chain of
        its position 0 where the step records it, and what the context check expects there
        (a mismatch is VERIFY_IDENTITY_MISMATCH), as `KvCanary.record` and `KvCanary.verify`
        take ``roots``. Pass the engine's whole buffers: no slicing."""
        if roots is not None and (not isinstance(roots, torch.Tensor) or roots.dtype != torch.int64):
            got = roots.dtype if isinstance(roots, torch.Tensor) else type(roots).__name__
            raise TypeError(f"kv-canary: roots must be an int64 tensor with one value per request, got {got}; pass roots as int64")
        try:
            self._op(
                *self._groups, query_start_loc, seq_lens, positions, input_ids, history, history_known, history_rows,
                *self._tables, num_reqs, num_tokens, self.block_size, phase, step, every, self._padding,
                *(() if roots is None else (roots,)),
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
