"""What the KV connector asks of its worker's canary, split by caller: `CanaryPort`, what
the facade and its drills use, and `RecordPort`, what the transfer verifiers use. The
connector owns these interfaces; the plugin's worker implements both in one object
(`worker_port.WorkerPort`) and hands it to the connector once its canary is built
(`KvCanaryConnector.attach`).

This module holds the repair rule: what the connector breaks when a step's verify flags
slots (`CanaryPort.break_from_flagged_blocks`), what it reports when the step's violations
overflow the canary's ring (`CanaryPort.overflow_blocks`), and how many recomputes of a
block a request is given (`CanaryPort.ration_repairs`)."""

from __future__ import annotations

import random
from typing import Protocol

import numpy as np
import torch


def landed_entries(slots: np.ndarray, tokens, *, start: int, prev_slot: int) -> tuple[np.ndarray, ...]:
    """What `RecordPort.record_landed` takes for a request's positions from ``start`` on,
    which a transfer landed in ``slots`` holding ``tokens``: the slots, tokens and positions,
    and the slot each position chains through (``prev_slot`` for the first: -1 at position
    0), int64 host arrays."""
    slots = np.asarray(slots, dtype=np.int64)
    prev_slots = np.concatenate([np.full(1, prev_slot, dtype=np.int64), slots])[: len(slots)]
    return slots, np.asarray(tokens, dtype=np.int64), np.arange(start, start + len(slots), dtype=np.int64), prev_slots


def to_device(device: torch.device, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Each of the host ``arrays`` as a flat int64 tensor on ``device`` (`RecordPort.device`),
    all in one copy that does not wait on the device: from pinned memory on a GPU (a copy
    from pageable memory waits for the stream's work first)."""
    sizes = [array.size for array in arrays]
    host = torch.from_numpy(np.concatenate([np.asarray(array, dtype=np.int64).reshape(-1) for array in arrays]))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True).split(sizes)


class CanaryPort(Protocol):
    """The worker's canary as the connector's facade and its drills use it: the policy, the
    step's verdict and what it breaks, the counters, the drills' targets. Slots are the
    canary's (block * block_size + offset); tensors of slots are int64 on any device."""

    @property
    def policy(self) -> str:
        """The worker's policy (`config.POLICIES`)."""

    @property
    def drill_probability(self) -> float:
        """The fault drills' probability per step (0: no drills)."""

    @property
    def watching(self) -> bool:
        """Whether the canary still watches (False once a fault of its own turned it off)."""

    def counters(self) -> dict[str, int]:
        """The canary's counters, read at every step without waiting for the device
        (`KvCanary.stats` with ``wait=False``): each an earlier value of the counter where the
        device's copies are in flight, caught up by the next reads."""

    def flagged_slots(self) -> torch.Tensor:
        """The distinct slots verify flagged in the current step (empty before its forward ended)."""

    def break_from_flagged_blocks(self, flagged: torch.Tensor) -> None:
        """The repair rule: breaks the records of what the step's flagged slots spoiled, as
        vLLM recomputes it, so that verify flags them until a forward rewrites them. In every
        watched group, for each request of the step whose blocks hold a slot of ``flagged``:
        the flagged blocks, and what the step's forward wrote after reading them (the
        request's new slots); where the canary verifies a request's reads only every few
        steps (``KVCANARY_VLLM_EVERY`` > 1), everything from its first flagged block on,
        since the steps in between may have read the bad block unverified.

        This follows what vLLM recomputes: the first request it finds reading a bad block is
        rolled back to that block, and every later reader of the block keeps what it
        computed before the step (the first recomputes the block) and drops the step's
        tokens. Verified at every step, those earlier blocks were computed from intact KV;
        breaking them would report intact slots and roll their request back again. The
        step's own new slots are broken for every reader: one completed in the step is in
        the prefix cache already, and another request could read it before it is written
        again.

        A request past its repairs of a block (`ration_repairs`) breaks nothing for its
        reads of that block: it goes on with what it read there."""

    def overflow_blocks(self, block_size: int) -> set[int]:
        """The blocks to report where the current step's violations overflowed the canary's
        ring (more than its rows between two polls; the ring keeps the first, and the op
        counts the rest in ``ring_overflow`` without saying which slots or requests they
        were): every block of every request of the step up to its context before the step,
        as vLLM's scheduler gave them (``block_size``: the scheduler's), so that vLLM
        recomputes (repair) or fails (quarantine) each request of the step, whichever of its
        reads went bad. vLLM acts on every running request that holds one of them, which
        under quarantine fails a request outside the step that shares a block with one in
        it. Under repair the worker's block-table rows of the step's requests are set back
        to the scheduler's blocks first, and for every request of the step the records of
        what its forward wrote are broken, computed from reads that may have gone bad. The
        violations the ring kept are reported by the other rules as well. Empty when the ring
        did not overflow in the step."""

    def ration_repairs(self, blocks: set[int], block_size: int, *, drilled: set[int] = frozenset()) -> tuple[set[int], int]:
        """Under repair, ``blocks`` (the step's, to report for recompute) less those no
        request may be rolled back for again: each request of the step holding a block of
        ``blocks`` in its context before the step (as vLLM's scheduler gave it) has it counted
        as one repair where the fault is new: a slot of the block flagged for the first time
        since a forward wrote it (the fault came back after a recompute; a block still bad
        while another holder recomputes it counts once), or the block reported in place of a
        read through a wrong mapping (`misread_blocks`); never for the slots of ``drilled``,
        a fault drill's flips caught in the step (each a fault of its own). A request whose
        repairs of one block
        pass ``KVCANARY_VLLM_MAX_REPAIRS``
        (a block whose bytes keep going bad, or that two requests write) is given up for
        that block: the block is no longer reported for it (it is still reported while
        another request of the step holds it within its limit), the request goes on with the
        KV as read there, and a line names it, the block and every request holding the
        block. vLLM's ``kv_load_failure_policy="recompute"`` rolls back every request holding
        a reported block and can fail none, so a request is not failed for it; quarantine
        fails it at its first report. Blocks no request of the step holds in its context are
        kept. Also returns how many (request, block) pairs were given up in this step."""

    def misread_blocks(self, block_size: int) -> tuple[set[int], set[int]]:
        """The current step's reads through a wrong mapping (a request's block-table entry
        pointing at a block vLLM's scheduler did not give it there; ``block_size``: the
        scheduler's): the slots so read, which belong to other requests and are not to be
        reported, and the blocks to report in their place, each a block the scheduler gave
        the request that read, so that vLLM fails or recomputes that request and no other.
        Under repair the worker's block-table rows of those requests are set back to the
        scheduler's blocks first. The records of what those requests wrote in the step are
        broken. Empty sets when the step read through no wrong mapping."""

    def drill_target(self, rng: random.Random) -> tuple[int, torch.Tensor] | None:
        """A slot a request of the step reads as context, chosen with ``rng``, and a view of
        the first element of its bytes (which every fold reads); None when no request has context."""


class RecordPort(Protocol):
    """The worker's canary as the transfer verifiers use it: the records of the slots a
    transfer moves, recording what landed and breaking what differs. Slots are the canary's
    (block * block_size + offset); tensors of slots are int64 on any device."""

    @property
    def device(self) -> torch.device:
        """The canary's device, where the verifiers' tensors go (`to_device`)."""

    def records_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The records of ``slots`` (int64 ``[len(slots), RECORD_FIELDS]``), a copy on the canary's device."""

    def step_requests(self) -> list[str]:
        """The vLLM request ids of the current step's forward, in batch order."""

    @property
    def blocks_packed(self) -> bool:
        """Whether the backend packs a block's tokens, so that a write of whole blocks changes
        the bytes of slots that hold no recorded token (`refold` them)."""

    def request_root(self, request_id: str) -> int | None:
        """The root of request ``request_id``'s chain: its identity (LoRA adapter, cache
        salt) as this worker derives it from the request itself (`identity.request_root`;
        `identity.ANCHOR` without one), never a value a transfer brought. None while the
        runner holds no such request yet (a load that landed before the request's first
        step)."""

    def record_landed(
        self,
        slots: torch.Tensor,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        prev_slots: torch.Tensor,
        roots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Records ``slots``, which a transfer has just landed, each holding its token and
        position (``tokens``, ``positions``) and chained through ``prev_slots`` (-1 at a
        request's position 0, whose chain is its request's root in ``roots``, the
        `request_root` of each entry's request; without ``roots``, the anchor; entries in
        order, so an entry may chain through the one before): their records. All on the
        canary's device; the slots are the scheduler's own, in range, and distinct: nothing
        waits on the device."""

    def head_digests(self, slots: torch.Tensor, heads: range, num_kv_heads: int, *, positions: torch.Tensor) -> torch.Tensor:
        """`digest.kv_digest_by_head` of ``slots`` holding ``positions`` in the watched caches, on the canary's device."""

    def refold(self, slots: torch.Tensor) -> None:
        """Recomputes the folds of ``slots`` (on the canary's device, in range), records kept:
        slots of blocks a transfer wrote whole that hold no recorded token (`blocks_packed`)."""

    def break_records(self, slots: torch.Tensor, where: torch.Tensor | None = None, *, just_recorded: bool = False) -> None:
        """Breaks the records of ``slots`` (with ``where``, a bool tensor shaped like them on
        the canary's device, of those where it is True, without waiting on the device):
        verify flags each until a forward writes it again. ``just_recorded``: the slots were
        recorded from their bytes as they are (`record_landed`), so their folds are not
        recomputed first."""
