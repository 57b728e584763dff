"""A vLLM plugin: SGLang's per-slot canary records kept beside vLLM's KV cache.

vLLM runs `register` in every process (the ``vllm.general_plugins`` entry point). It does
nothing unless ``KVCANARY_VLLM`` is set:

* ``KVCANARY_VLLM=log``: each violation is a WARNING line on the ``torch_kvcanary`` logger;
* ``KVCANARY_VLLM=raise``: the step raises `KvCorruptionError`;
* ``KVCANARY_VLLM_MODE=partial|all`` (default ``all``): how much of each slot is folded.

In each worker, once vLLM has allocated the KV caches, a `KvCanary` watches K and V of every
attention layer (zero-copy views, `layouts.vllm`). In every engine step, around the model
forward:

1. before it, every scheduled request's context (the positions already in the cache) is
   verified as the request's block table gives it: the slot's bytes, its position, its
   token, and its chain through the previous position's slot (a context slot this forward
   itself writes, for another request of the batch, is verified after the forward);
2. after it, the slots the forward wrote are recorded with their positions, tokens and
   previous slots;
3. the canary is polled once; each violation line names the vLLM request(s) whose block
   table holds the slot.

Prefix caching, chunked prefill, preemption and recompute need nothing special: a shared
block holds the same records for every request that reads it, and a recomputed slot is
recorded again when it is rewritten. Under a backend that packs a block's tokens together
(CPU_ATTN, `layouts.VLLM_BLOCK_PACKED_BACKENDS`) a slot's bytes are a row of its block, so
the unwritten rows of each request's last block are verified too, and every slot of a
block the forward wrote is recorded again. Under async scheduling the token check is skipped
(the runner's token history may lag the device by a step); the other checks stay.

Everything the plugin reads from or hooks into vLLM goes through `adapter`, which also says
which vLLM versions it supports: with ``KVCANARY_VLLM`` set, any other version is refused.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ... import layouts
from ...canary import KvCanary, KvCorruptionError, Violation, ViolationKind
from ...policy import apply_policy
from ...sources import HashMode
from . import adapter

logger = logging.getLogger("torch_kvcanary")

POLICY_ENV = "KVCANARY_VLLM"
MODE_ENV = "KVCANARY_VLLM_MODE"
POLICIES = ("log", "raise")
MODES = {"partial": HashMode.PARTIAL, "all": HashMode.ALL}
LAUNCH_TAG = "vllm"

_active: WorkerCanary | None = None


@dataclass(frozen=True)
class Settings:
    policy: str
    mode: HashMode


def settings() -> Settings | None:
    """The plugin's settings from the environment; None when ``KVCANARY_VLLM`` is unset or empty."""
    policy = os.environ.get(POLICY_ENV, "")
    if not policy:
        return None
    if policy not in POLICIES:
        raise ValueError(f"kv-canary: {POLICY_ENV} must be one of {', '.join(POLICIES)} (or unset to turn the plugin off), got {policy!r}")
    mode = os.environ.get(MODE_ENV, "all") or "all"
    if mode not in MODES:
        raise ValueError(f"kv-canary: {MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return Settings(policy, MODES[mode])


def active() -> WorkerCanary | None:
    """The canary of the model runner this process built last (in-process engines:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``)."""
    return _active


def register() -> None:
    """The ``vllm.general_plugins`` entry point: hooks vLLM's model runner when
    ``KVCANARY_VLLM`` is set, after checking that `adapter` supports this vLLM.
    vLLM may call it more than once in a process."""
    chosen = settings()
    if chosen is None:
        return
    version = adapter.vllm_version()
    if not adapter.is_supported(version):
        raise RuntimeError(
            f"kv-canary: the vLLM plugin supports vLLM {adapter.SUPPORTED}, this is vLLM {version}: "
            f"install a supported vLLM, or unset {POLICY_ENV} to serve without the canary"
        )
    if adapter.hook_model_runner(lambda model_runner: _start(model_runner, chosen)):
        logger.info("kv-canary: vLLM plugin on (policy %s, mode %s)", chosen.policy, chosen.mode.name)


def _start(model_runner, chosen: Settings) -> WorkerCanary:
    """The canary of a model runner that has just allocated its KV cache."""
    global _active
    _active = WorkerCanary(model_runner, chosen)
    return _active


@dataclass
class _Batch:
    """One step's scheduled requests and the entries the canary saw for them: the verified
    ones (each request's context, then under a block-packed backend the unwritten tail of
    its last block) and the written ones. ``*_rows`` are input-batch rows, on the host."""

    req_ids: list[str]
    num_tokens: int
    input_ids: torch.Tensor | None
    positions: torch.Tensor
    written_rows: np.ndarray
    written_slots: torch.Tensor
    verified_rows: np.ndarray | None = None
    verified_slots: torch.Tensor | None = None  # -1 where this forward writes the slot
    verified_positions: torch.Tensor | None = None  # -1 for a tail slot
    verified_prev_slots: torch.Tensor | None = None
    # The context slots this forward writes (verified after it), and their expected tokens.
    deferred_slots: torch.Tensor | None = None
    context_tokens: torch.Tensor | None = None
    # Each verify call's (slots, rows, answer), for naming the requests behind a violation.
    checks: list[tuple[torch.Tensor, np.ndarray, torch.Tensor]] = field(default_factory=list)


class WorkerCanary:
    """The canary of one vLLM model runner: `canary` (a `KvCanary` over K and V of every
    attention layer), `kv_caches` (the layer tensors it watches, in layer order), `runner`
    and `block_table` (vLLM's), and `policy` ("log" or "raise", read by each poll)."""

    def __init__(self, runner, chosen: Settings):
        self.runner = runner
        self.policy = chosen.policy
        self._vllm = adapter.Runner(runner)
        if self._vllm.uses_mrope:
            raise ValueError(
                f"kv-canary: the vLLM plugin does not watch M-RoPE models (positions are 3-D): unset {POLICY_ENV} to serve them"
            )
        layers = self._vllm.attention_layers()
        if layers is None:
            raise ValueError(
                f"kv-canary: the vLLM plugin watches models whose layers share one full-attention KV cache group; "
                f"this model has {self._vllm.kv_cache_group_kinds()}: unset {POLICY_ENV} to serve it without the canary"
            )
        self.layer_names = [layer.name for layer in layers]
        layout = self._vllm.kv_cache_layout
        self.block_table = self._vllm.block_table
        self.block_size = self._vllm.block_size
        self.kv_caches: list[torch.Tensor] = []
        sources, backends = [], set()
        for layer in layers:
            kv_cache = layer.kv_cache
            if any(kv_cache.data_ptr() == seen.data_ptr() for seen in self.kv_caches):
                continue  # a layer that shares another layer's cache
            if kv_cache.dim() != 4 or kv_cache.shape[2] != self.block_size:
                raise ValueError(
                    f"kv-canary: vLLM layer {layer.name} is {tuple(kv_cache.shape)}, not a packed "
                    f"[num_blocks, num_kv_heads, {self.block_size}, 2 * head_size] layer the plugin can watch"
                )
            self.kv_caches.append(kv_cache)
            backends.add(layer.backend)
            sources += layouts.vllm(kv_cache, layout=layout, backend=layer.backend)
        self.canary = KvCanary(sources, mode=chosen.mode, on_violation=self._report, name=LAUNCH_TAG)
        self._check_tokens = not self._vllm.async_scheduling
        # Tensor-parallel ranks poll together, so that under "raise" they all stop.
        self._group = self._vllm.tensor_parallel_group() if self._vllm.tensor_parallel_size > 1 else None
        self._blocks_packed = any(b in layouts.VLLM_BLOCK_PACKED_BACKENDS for b in backends)
        self._batch: _Batch | None = None
        logger.info(
            "kv-canary: watching %d vLLM layers (%d slots, %s) in mode %s",
            len(self.kv_caches),
            self.canary.capacity,
            layout,
            chosen.mode.name,
        )

    # The step -----------------------------------------------------------------------

    def begin_step(self, step: adapter.Step) -> _Batch:
        """Before the forward: verify every scheduled request's context."""
        req_ids, positions, written = step.request_ids, step.positions, step.slot_mapping
        rows = np.arange(len(req_ids), dtype=np.int64)
        batch = _Batch(req_ids, step.num_tokens, step.input_ids, positions, np.repeat(rows, step.num_scheduled), written)
        context = step.num_computed
        context_rows, context_positions = _ranges(rows, np.zeros_like(context), context)
        tail_rows = tail_positions = np.zeros(0, dtype=np.int64)
        if self._blocks_packed:
            tail_end = -(-context // self.block_size) * self.block_size
            tail_rows, tail_positions = _ranges(rows, context, tail_end)
        if len(context_rows) + len(tail_rows) == 0:
            self._batch = batch
            return batch
        device = positions.device
        batch.verified_rows = np.concatenate([context_rows, tail_rows])
        row_index = _to(batch.verified_rows, device)
        at = _to(np.concatenate([context_positions, tail_positions]), device)
        is_tail = _to(np.arange(len(batch.verified_rows)) >= len(context_rows), device)
        # A request may read, as context, a block another request of this batch writes in
        # this very forward (the scheduler caches a block's hash when it schedules its
        # tokens, so a later request of the same step hits it): such slots are verified
        # after the forward, once recorded.
        slots = self._vllm.slots(row_index, at)
        written_now = torch.isin(slots, written)
        batch.verified_slots = torch.where(written_now, -1, slots)
        batch.deferred_slots = torch.where(written_now & ~is_tail, slots, -1)
        batch.verified_positions = torch.where(is_tail, -1, at)
        batch.verified_prev_slots = torch.where(is_tail, -1, self._vllm.slots(row_index, at - 1))
        tokens = np.full(len(context_rows), -1, dtype=np.int64)
        if self._check_tokens:
            tokens = self._vllm.tokens(context_rows, context_positions)
        count = len(context_rows)
        batch.context_tokens = _to(tokens, device)
        self._verify_context(batch, batch.verified_slots[:count])
        if len(tail_rows):  # only their bytes: a tail slot may hold a rejected draft token's record
            tail_slots = batch.verified_slots[count:]
            batch.checks.append((tail_slots, tail_rows, self.canary.verify(tail_slots)))
        self._batch = batch
        return batch

    def end_step(self, batch: _Batch) -> None:
        """After the forward: record the slots it wrote, then poll once."""
        if batch.num_tokens:
            positions = batch.positions[: batch.num_tokens]
            row_index = _to(batch.written_rows, positions.device)
            tokens = batch.input_ids[: batch.num_tokens].to(torch.int64) if batch.input_ids is not None else torch.full_like(positions, -1)
            entries = (batch.written_slots, positions, tokens, self._vllm.slots(row_index, positions - 1))
            if self._blocks_packed:
                entries = self._with_block_neighbours(batch, entries)
            slots, positions, tokens, prev_slots = entries
            self.canary.record(slots, positions=positions, tokens=tokens, prev_slots=prev_slots)
            if batch.deferred_slots is not None:
                self._verify_context(batch, batch.deferred_slots[: len(batch.context_tokens)])
        self.canary.poll(group=self._group)
        self._batch = None

    def _verify_context(self, batch: _Batch, slots: torch.Tensor) -> None:
        """Every check of the context entries at ``slots`` (-1: skipped)."""
        count = len(batch.context_tokens)
        flagged = self.canary.verify(
            slots,
            positions=batch.verified_positions[:count],
            tokens=batch.context_tokens,
            prev_slots=batch.verified_prev_slots[:count],
        )
        batch.checks.append((slots, batch.verified_rows[:count], flagged))

    def _with_block_neighbours(self, batch: _Batch, written: tuple) -> tuple:
        """Under a block-packed backend writing a slot changes the fold of its block's other
        slots, so every slot of a block the forward wrote is recorded again, ahead of the
        written entries: those verified before the forward (and not flagged) with the records
        they hold (an unwritten tail slot holds -1s), the others (a new block's tail) with -1s."""
        written_slots = written[0]
        touched = torch.unique(written_slots[written_slots >= 0] // self.block_size)
        if batch.verified_slots is None:
            verified = torch.full((0,), -1, dtype=torch.int64, device=written_slots.device)
            again = (verified, verified, verified, verified)
        else:
            verified = batch.verified_slots
            # A flagged slot keeps its record, so that it is reported again while it is read.
            passed = ~torch.cat([answer for _, _, answer in batch.checks])
            in_touched = torch.isin(verified // self.block_size, touched) & (verified >= 0) & passed
            slots = torch.where(in_touched, verified, -1)
            held_tokens = self.canary.records[slots.clamp(min=0), 0]
            again = (slots, batch.verified_positions, held_tokens, batch.verified_prev_slots)
        block_slots = (touched[:, None] * self.block_size + torch.arange(self.block_size, device=touched.device)).reshape(-1)
        new_tail = block_slots[~torch.isin(block_slots, torch.cat([verified, written_slots]))]
        unknown = torch.full_like(new_tail, -1)
        return tuple(torch.cat(parts) for parts in zip((new_tail, unknown, unknown, unknown), again, written))

    # Reports ------------------------------------------------------------------------

    def requests_of(self, violation: Violation) -> list[str]:
        """The vLLM request ids of this step behind ``violation``: those whose context entry
        at its slot verify flagged, else every request whose block table holds the slot."""
        batch = self._batch
        if batch is None:
            return []
        flagged: set[int] = set()
        holding: set[int] = set()
        for slots, rows, answer in batch.checks:
            at_slot = (slots == violation.slot).cpu().numpy()
            holding.update(rows[at_slot].tolist())
            flagged.update(rows[at_slot & answer.cpu().numpy()].tolist())
        holding.update(batch.written_rows[(batch.written_slots == violation.slot).cpu().numpy()].tolist())
        rows = flagged if violation.kind == ViolationKind.VERIFY and flagged else holding
        return [batch.req_ids[row] for row in sorted(rows)]

    def line(self, violation: Violation) -> str:
        """The log line of docs/spec.md for ``violation``, then the ids of the vLLM requests behind it."""
        return f"{violation.line(LAUNCH_TAG)} request_id={','.join(self.requests_of(violation)) or 'none'}"

    def _report(self, violations: list[Violation]) -> None:
        lines = lambda: [self.line(v) for v in violations]  # noqa: E731
        apply_policy(self.policy, violations, lines=lines, error=lambda text: KvCorruptionError(text, violations))


def _ranges(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) for every position in ``[starts[i], ends[i])`` of each row, row by row."""
    counts = ends - starts
    total = int(counts.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(rows, counts), np.repeat(starts, counts) + offsets


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64) if array.dtype != bool else array).to(device, non_blocking=True)
