"""`WorkerPort`: the worker's canary as its KV connector sees it (`connector.CanaryPort`,
`connector.RecordPort`)."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from ... import digest, layouts
from ...violations import FailReason, Violation
from . import adapter
from .config import MAX_REPAIRS_ENV

logger = logging.getLogger(adapter.LOGGER)


class WorkerPort:
    """`connector.CanaryPort` and `connector.RecordPort` over the worker's canary (``worker``,
    a `worker.WorkerCanary`): the records of the slots a transfer moves, the breaking of
    records the step or a transfer found bad, and the drills' targets. ``head_views`` are the watched caches' per-head views
    (`digest.vllm_head_views`), ``mla`` whether they are MLA's latent.

    Where the connector needs each request's blocks it reads Model Runner V1's input batch
    (`adapter.RunnerV1.context`), the runner the connector is served on."""

    def __init__(self, worker, *, head_views: list, mla: bool):
        self._worker = worker
        self._canary = worker.canary
        self._head_views = head_views
        self._mla = mla
        self._head_digests: dict[tuple[range, int], digest.HeadDigests] = {}  # by (heads, num_kv_heads), built at first use
        self._repairs: dict[tuple[str, int], int] = {}  # (request id, block): the times it was reported for that request
        self._given_up: set[tuple[str, int]] = set()  # (request id, block): past the repairs the request is given
        self._readers: set[int] = set()  # the blocks the current step's `misread_blocks` reported

    @property
    def policy(self) -> str:
        return self._worker.policy

    @property
    def drill_probability(self) -> float:
        return self._worker.drill

    @property
    def watching(self) -> bool:
        return self._worker.on

    def counters(self) -> dict[str, int]:
        # Read at every step (vLLM's connector stats): without waiting for the device.
        return self._canary.stats(wait=False)

    def flagged_slots(self) -> torch.Tensor:
        return self._worker.step_flagged_slots()

    def break_from_flagged_blocks(self, flagged: torch.Tensor) -> None:
        """The repair rule of `connector.CanaryPort.break_from_flagged_blocks`, over the
        step's block-table rows of every watched group."""
        worker = self._worker
        block_size = worker.block_size
        flagged_blocks = np.unique((flagged // block_size).cpu().numpy())
        forward = worker.step_forward
        stale = []
        for group in worker.groups:
            for row, request_id in enumerate(forward.request_ids):
                blocks = group.row_blocks(row)
                bad = np.flatnonzero(np.isin(blocks, flagged_blocks))
                if self._given_up and len(bad):  # a request past its repairs of a block goes on with what it read there
                    bad = bad[np.array([(request_id, int(block)) not in self._given_up for block in blocks[bad]], dtype=bool)]
                if not len(bad):
                    continue
                if worker.every > 1:
                    stale.append(layouts.vllm_block_slots(blocks[bad[0] :], block_size))
                    continue
                stale.append(layouts.vllm_block_slots(blocks[bad], block_size))
                written = np.arange(forward.num_computed[row], forward.num_computed[row] + forward.num_scheduled[row])
                stale.append(blocks[written // block_size] * block_size + written % block_size)
        if not stale:
            return
        slots = torch.from_numpy(np.unique(np.concatenate(stale)).astype(np.int64)).to(self._canary.device)
        self._canary.invalidate(slots[(slots != adapter.NULL_SLOT) & (slots < self._canary.capacity)])

    def misread_blocks(self, block_size: int) -> tuple[set[int], set[int]]:
        """For each request of the step with a read through a wrong mapping (a violation that
        is not byte-only, of a request whose block-table row differs from the blocks the
        scheduler gave it, which Model Runner V1's request state keeps), the slots so read,
        and the block to report in their place: the request's last block of context before
        the step, which vLLM's load-error rule looks at (a running request's blocks below
        its context before the step) and which fails or rolls back this request.

        When the context ends inside that block the block is the request's alone (vLLM
        shares full blocks only). When it ends at a block boundary the block may be a
        prefix-cache hit other requests hold. Under repair it is reported all the same: the
        others are rolled back to their context and compute the step again, which changes
        no answer. Under quarantine reporting it would fail them too, so it is left for the
        request's next step: its row still holds the wrong entry, the next read through it
        is flagged again, and by then its context ends past that block.

        Under repair the request's row is set back to the scheduler's blocks, so that vLLM's
        recompute reads the right ones. Where the row equals the scheduler's blocks the
        request read what vLLM gave it, so the flagged block itself is wrong (its bytes or
        records), and it is reported as flagged, like a byte fault, but for KV of another
        identity that requests of that identity hold (`_held_by_its_identity`). The records
        of what each request with a wrong row wrote in the step are broken: it computed them
        from the wrong context."""
        misreads = self._worker.step_misreads()
        self._readers = set()
        if not misreads:
            return set(), set()
        worker = self._worker
        forward = worker.step_forward
        states = worker.model_runner.requests
        by_reader: dict[tuple[int, int], list[Violation]] = {}
        for violation in misreads:
            by_reader.setdefault((violation.group, violation.row), []).append(violation)
        misread, readers, spoiled = set(), set(), []
        for (group_index, row), found in by_reader.items():
            group = worker.groups[group_index]
            request_id = forward.request_ids[row]
            own = [int(block) for block in states[request_id].block_ids[group.index]]
            if group.row_blocks(row).tolist() == own:
                misread.update(self._held_by_its_identity(request_id, group.index, found, block_size))
                continue
            misread.update(violation.slot for violation in found)
            if self.policy == "repair":
                group.block_table.add_row(own, row)
            context, written = int(forward.num_computed[row]), int(forward.num_scheduled[row])
            positions = np.arange(context, context + written)
            spoiled.append(np.asarray(own, dtype=np.int64)[positions // block_size] * block_size + positions % block_size)
            if context == 0:
                continue  # nothing of the cache was read but what the step wrote; its next read is checked again
            last = own[(context - 1) // block_size]
            if self.policy == "quarantine" and _held_by_others(states, request_id, group.index, last):
                continue
            readers.add(last)
        if spoiled:
            self.break_records(torch.from_numpy(np.concatenate(spoiled)))
        self._readers = readers
        return misread, readers

    def overflow_blocks(self, block_size: int) -> set[int]:
        """Where the current step's violations overflowed the ring (`worker.WorkerCanary.step_overflowed`),
        the rule of `connector.CanaryPort.overflow_blocks`: every block of every request of
        the step up to its context before the step, as the scheduler gave them (Model Runner
        V1's request state), with their rows set back to those blocks under repair and the
        records of what the step wrote for them broken; empty otherwise."""
        worker = self._worker
        if not worker.step_overflowed():
            return set()
        forward, states = worker.step_forward, worker.model_runner.requests
        blocks, spoiled = set(), []
        for group in worker.groups:
            for row, request_id in enumerate(forward.request_ids):
                own = [int(block) for block in states[request_id].block_ids[group.index]]
                if self.policy == "repair" and group.row_blocks(row).tolist() != own:
                    group.block_table.add_row(own, row)
                context, written = int(forward.num_computed[row]), int(forward.num_scheduled[row])
                if context == 0:
                    continue  # nothing of the cache was read but what the step wrote
                blocks.update(own[: (context - 1) // block_size + 1])
                positions = np.arange(context, context + written)
                spoiled.append(np.asarray(own, dtype=np.int64)[positions // block_size] * block_size + positions % block_size)
        if spoiled:
            self.break_records(torch.from_numpy(np.concatenate(spoiled)))
        return blocks

    def ration_repairs(self, blocks: set[int], block_size: int, *, drilled: set[int] = frozenset()) -> tuple[set[int], int]:
        """The rule of `connector.CanaryPort.ration_repairs` over the requests of the step,
        their blocks as the scheduler gave them: ``blocks`` less those every request of the
        step holding them in its context has had reported more than ``max_repairs`` times,
        and how many (request, block) pairs passed that limit in this step, each logged. A
        report counts where the block has a slot flagged for the first time since a forward
        wrote it (`worker.WorkerCanary.step_first_detections`) that is not a drill's
        (``drilled``), or is a block `misread_blocks` reported in this step."""
        worker = self._worker
        forward, states = worker.step_forward, worker.model_runner.requests
        counted = {slot // block_size for slot in worker.step_first_detections() - drilled} | self._readers
        self._repairs = {key: n for key, n in self._repairs.items() if key[0] in states}
        self._given_up = {key for key in self._given_up if key[0] in states}
        kept, held = set(), set()
        passed = []
        for row, request_id in enumerate(forward.request_ids):
            context = int(forward.num_computed[row])
            for group in worker.groups:
                for block in blocks.intersection(states[request_id].block_ids[group.index][: -(-context // block_size)]):
                    held.add(block)
                    key = (request_id, block)
                    if key in self._given_up:
                        continue
                    self._repairs[key] = self._repairs.get(key, 0) + (block in counted)
                    if self._repairs[key] <= worker.max_repairs:
                        kept.add(block)
                        continue
                    self._given_up.add(key)
                    passed.append(key)
        for request_id, block in passed:
            holders = sorted(r for r, state in states.items() if any(block in ids for ids in state.block_ids))
            logger.error(
                "kv-canary: request %s was repaired %d times for block %d (%s) and the block is flagged again: the canary "
                "stops reporting it for that request, which goes on with the KV as read there (vLLM's kv_load_failure_policy "
                '"recompute" can fail no single request; KVCANARY_VLLM=quarantine fails it); the block\'s holders: %s',
                request_id, worker.max_repairs, block, MAX_REPAIRS_ENV, ", ".join(holders),
            )  # fmt: skip
        return kept | (blocks - held), len(passed)

    def _held_by_its_identity(self, request_id: str, group: int, violations: list[Violation], block_size: int) -> set[int]:
        """The slots of ``violations`` (reads of request ``request_id`` in blocks the scheduler
        gave it) that hold KV of another identity alone (VERIFY_IDENTITY_MISMATCH; at a first
        position the stored chain is its writer's root) in a block another request of that
        identity holds: an adapter reloaded in place, whose old weights' requests still run,
        beside a new request that hit their blocks. vLLM recomputes a shared block in place
        for all its holders, so reporting it would roll them back to recompute it under their
        identity, and the reader would read another identity there again, step after step,
        neither going on. Such a read is logged and not reported: the reader goes on with the
        KV vLLM served it, and its next read once no holder of that identity is left reports
        the block."""
        worker = self._worker
        states = worker.model_runner.requests
        held = set()
        for violation in violations:
            if violation.reasons != FailReason.VERIFY_IDENTITY_MISMATCH:
                continue
            block = violation.slot // block_size
            holders = [other for other, state in states.items() if other != request_id and block in state.block_ids[group]]
            if any(worker.request_roots.root(other) == violation.stored_chain for other in holders):
                held.add(violation.slot)
        return held

    def drill_target(self, rng: random.Random) -> tuple[int, torch.Tensor] | None:
        """A context slot of a request of the input batch in the first watched group, and the
        first element of its bytes in the canary's first source (a view into the KV cache)."""
        _, context = self._worker.runner_view.context()
        rows = np.flatnonzero(context > 0)
        if not len(rows):
            return None
        row = int(rng.choice(rows))
        group = self._worker.groups[0]
        position = rng.randrange(int(group.first_attended(context[row : row + 1])[0]), int(context[row]))
        device = self._canary.device
        slot = int(group.slots(torch.tensor([row], device=device), torch.tensor([position], device=device))[0])
        view = self._canary.sources[0].as_view()
        token = view[slot // view.shape[1], slot % view.shape[1]]
        return slot, token[(0,) * token.dim()]

    def step_requests(self) -> list[str]:
        forward = self._worker.step_forward
        return list(forward.request_ids) if forward is not None else []

    def records_of(self, slots: torch.Tensor) -> torch.Tensor:
        return self._canary.records[slots.to(self._canary.device, torch.int64)]

    @property
    def blocks_packed(self) -> bool:
        return self._worker.blocks_packed

    @property
    def device(self) -> torch.device:
        return self._canary.device

    def request_root(self, request_id: str) -> int | None:
        """`RequestRoots.root` of a request Model Runner V1 holds (None: it holds none of that id)."""
        if request_id not in self._worker.model_runner.requests:
            return None
        return self._worker.request_roots.root(request_id)

    def record_landed(
        self,
        slots: torch.Tensor,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        prev_slots: torch.Tensor,
        roots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._canary.record(slots, positions=positions, tokens=tokens, prev_slots=prev_slots, check_bounds=False, roots=roots)
        return self.records_of(slots)

    def head_digests(self, slots: torch.Tensor, heads: range, num_kv_heads: int, *, positions: torch.Tensor) -> torch.Tensor:
        key = (heads, num_kv_heads)
        if key not in self._head_digests:
            self._head_digests[key] = digest.HeadDigests(self._head_views, heads, num_kv_heads=num_kv_heads, mla=self._mla)
        # The slots are the scheduler's own blocks, in range: no range check, which syncs on a GPU.
        return self._head_digests[key](slots, positions=positions, check_bounds=False)

    def refold(self, slots: torch.Tensor) -> None:
        """`KvCanary.refold`, records kept; the slots are the scheduler's own, in range."""
        self._canary.refold(slots, check_bounds=False)

    def break_records(self, slots: torch.Tensor, where: torch.Tensor | None = None, *, just_recorded: bool = False) -> None:
        self._canary.invalidate(slots.to(self._canary.device, torch.int64), where=where, refold=not just_recorded)


def _held_by_others(states: dict, request_id: str, group: int, block: int) -> bool:
    """Whether a request other than ``request_id`` holds ``block`` in KV cache group ``group``
    (``states``: Model Runner V1's request states, by request id)."""
    return any(block in state.block_ids[group] for other, state in states.items() if other != request_id)
