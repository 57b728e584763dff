"""What the log says: the line each worker starts with (`start_line`), and about violations:
one line per corrupted slot at its first detection (`Reports`), later detections counted
into a summary line, and the policy applied to a step's lines (`report`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ... import __version__, layouts
from ...policy import apply_policy
from ...records import SLOT_BYTES
from ...violations import FailReason, KvCorruptionError, Violation, ViolationKind
from . import adapter
from .config import CONNECTOR, CONNECTOR_POLICIES, POLICY_ENV

logger = logging.getLogger(adapter.LOGGER)

LAUNCH_TAG = "vllm"


class Reports:
    """What the log says about violations: each corrupted slot once, at its first detection
    (until a forward rewrites it); its later detections are counted, and `summary` gives a
    line of them at most every ``interval`` seconds (0: whenever there are any)."""

    def __init__(self, interval: float):
        self.interval = interval
        self.logged: set[int] = set()  # slots logged and not rewritten since
        self.slots_logged = 0
        self.repeats = 0  # later detections since the last summary
        self.repeated_slots: set[int] = set()
        self.ring_dropped = 0  # violations lost to a full ring since the last summary
        self._since: float | None = None  # when the last summary came

    def first_detection(self, slot: int) -> bool:
        """Whether ``slot`` is to be logged now; counted as a later detection if not."""
        if slot in self.logged:
            self.repeats += 1
            self.repeated_slots.add(slot)
            return False
        self.logged.add(slot)
        self.slots_logged += 1
        return True

    def dropped(self, count: int) -> None:
        self.ring_dropped += count

    def rewritten(self, slots: list[int]) -> None:
        """Slots a forward has written: a violation there again is a new one."""
        self.logged.difference_update(slots)

    def summary(self, now: float) -> str | None:
        """The summary line, when there is something to say and ``interval`` has passed."""
        if self._since is None:
            self._since = now
        if not (self.repeats or self.ring_dropped) or now - self._since < self.interval:
            return None
        line = (
            f"kv_canary summary: launch_tag={LAUNCH_TAG} seconds={now - self._since:.1f} "
            f"repeated_detections={self.repeats} repeated_slots={len(self.repeated_slots)} "
            f"slots_logged={self.slots_logged} ring_dropped={self.ring_dropped}"
        )
        self.repeats, self.ring_dropped, self._since = 0, 0, now
        self.repeated_slots.clear()
        return line


_UNREPAIRABLE = (
    "kv-canary: {setting} hands vLLM the blocks whose bytes alone are wrong, the blocks of the requests of the step "
    "that read through a wrong mapping, and where the ring overflowed in a step every block of the step's requests; a "
    "violation of no request of the step (a wrong position, token, chain or owner outside the step's reads, or one the "
    "ring dropped outside a step) names no request vLLM's scheduler could fail or recompute, so the step stops"
)


def byte_only(violation: Violation) -> bool:
    """Whether only the slot's bytes failed (its fold), with its token, position and chain intact."""
    return violation.kind == ViolationKind.VERIFY and violation.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH


def violation_line(violation: Violation, requests: list[str]) -> str:
    """The log line of docs/spec.md for ``violation`` (its chains as keyed fingerprints, so no
    request's root, a hash of its cache salt, is logged), then the ids of the vLLM requests behind it."""
    return f"{violation.line(LAUNCH_TAG)} request_id={','.join(requests) or 'none'}"


def slot_lines(violations: list[Violation], requests_of: Callable[[Violation], list[str]]) -> dict[int, str]:
    """One line per slot of ``violations`` (`violation_line`): its first violation, with the
    reasons of all of them and every request behind any of them (``requests_of``)."""
    by_slot: dict[int, list[Violation]] = {}
    for violation in violations:
        by_slot.setdefault(violation.slot, []).append(violation)
    lines = {}
    for slot, found in by_slot.items():
        reasons = found[0].reasons
        requests: list[str] = []
        for violation in found:
            reasons |= violation.reasons
            requests += [r for r in requests_of(violation) if r not in requests]
        lines[slot] = violation_line(dataclasses.replace(found[0], reasons=reasons), requests)
    return lines


def report(
    policy: str,
    violations: list[Violation],
    lines: dict[int, str],
    dropped: int,
    reports: Reports,
    *,
    misreads_taken: bool = False,
    overflow_taken: bool = False,
) -> set[int]:
    """The policy over one line per slot (``lines``, by slot) of a poll's ``violations``,
    ``dropped`` of them lost to a full ring: under "log" only the slots detected for the
    first time, the others counted into ``reports``. Under repair and quarantine the
    connector reports blocks to vLLM (the flagged blocks of byte-only violations; for a
    read through a wrong mapping, a block of the request that read, which the connector
    took on: ``misreads_taken``; where the ring overflowed in an engine step, every block
    of the step's requests, which the connector took on: ``overflow_taken``), and the
    violations are logged as under "log"; a violation that is not byte-only and was not
    taken on (or ``dropped`` ones not taken on, which might be such) names no request vLLM's
    scheduler could act on, so it stops the step as under "raise". With no violation (another
    tensor-parallel rank found some; the ranks poll together), under "raise" this rank stops
    too, with a line saying where to look. Returns the slots logged now: their first
    detection since a forward last wrote them (`Reports.first_detection`)."""
    if not violations:
        if policy == "raise":
            line = (
                f"kv_canary: launch_tag={LAUNCH_TAG} violations on another tensor-parallel rank (see its lines); this rank's checks passed"
            )
            raise KvCorruptionError([line], violations)
        return set()
    applied = policy
    if policy in CONNECTOR_POLICIES:
        unrepairable = (dropped and not overflow_taken) or not (misreads_taken or all(byte_only(v) for v in violations))
        applied = "raise" if unrepairable else "log"
        if unrepairable:
            lines = {-1: _UNREPAIRABLE.format(setting=f"{POLICY_ENV}={policy}"), **lines}
    if applied == "log":
        reports.dropped(dropped)
        if dropped and overflow_taken:
            logger.warning(
                "kv-canary: %d violations of this step lost to a full ring (%s=%s): every request of the step is "
                "reported to vLLM, which %s each",
                dropped, POLICY_ENV, policy, "recomputes" if policy == "repair" else "fails",
            )  # fmt: skip
        lines = {slot: line for slot, line in lines.items() if reports.first_detection(slot)}
    apply_policy(
        applied,
        violations,
        lines=lambda: list(lines.values()),
        error=lambda text: KvCorruptionError(text, violations),
        log=logger,
    )
    return {slot for slot in lines if slot >= 0}


def start_line(worker, layout: str, *, token_copy_bytes: int, scratch_bytes: int) -> str:
    """The line a worker (a `worker.WorkerCanary`) logs at start: what it watches (``layout``:
    vLLM's KV cache layout), its step path, and the memory the canary holds: the canary's, a
    device copy of the token history (``token_copy_bytes``, 0: none) and the step kernels'
    scratch (``scratch_bytes``); the request identity it reads (`request_roots.RequestRoots.describe`);
    last, the package's version."""
    kinds = worker.runner_view.kv_cache_group_kinds()
    budget = worker.runner_view.kv_cache_budget
    if budget is None:
        source = "not counted in vLLM's KV cache sizing (vLLM did not ask this worker for its KV cache memory)"
    else:
        source = f"taken from the {_size(budget[0])} this worker found for the KV cache"
    watched = sum(layer.drafter for group in worker.groups for layer in group.layers)
    unwatched = len(worker.runner_view.drafter_layer_names()) - watched
    drafter = f"; {watched} of them the speculative drafter's, recorded once it has proposed" if watched else ""
    if unwatched:
        if worker.watches_drafter:
            why = "in a KV cache group of the drafter's own"
        elif worker.connector is not None:
            why = f"{CONNECTOR} needs each step's verdict right after the forward"
        else:
            why = "it proposes after the step"
        drafter += f"; {unwatched} layers of the speculative drafter not watched: {why}"
    copy = f" and {_size(token_copy_bytes)} for a device copy of the token history" if token_copy_bytes else ""
    copy += f" and {_size(scratch_bytes)} of scratch for the step's kernels (not taken from the KV cache budget)" if scratch_bytes else ""
    return (
        f"kv-canary: watching {worker.runner_view.name}: {len(kinds)} KV cache group{'s' * (len(kinds) != 1)} "
        f"({', '.join(kinds)}), {len(worker.layer_names)} layers ({len(worker.kv_caches)} caches, {layout}{drafter}), "
        f"{worker.canary.capacity} slots in blocks of {worker.block_size}; mode {worker.canary.mode.name}, policy {worker.policy}"
        f"{f' through {CONNECTOR}' if worker.connector is not None else ''}{f', drills with probability {worker.drill} per step' if worker.drill else ''}; "
        f"the canary holds {_size(worker.canary.nbytes)} ({SLOT_BYTES} B per slot){copy}, {source}; {step_path(worker)}; "
        f"{worker.request_roots.describe()}; torch_kvcanary {__version__}"
    )


def step_path(worker) -> str:
    """What each engine step runs, for the start line."""
    if worker.blocks_packed:
        packed = ", ".join(sorted(layouts.VLLM_BLOCK_PACKED_BACKENDS))
        calls = f"two kvcanary::paged_step calls a step, before and after the forward ({packed} packs a block's tokens)"
    else:
        calls = "one kvcanary::paged_step call a step, after the forward"
    groups = f"{len(worker.groups)} KV cache group{'s' * (len(worker.groups) != 1)}"
    now = worker.waits_for_verdicts or worker.canary.device.type == "cpu"
    return f"step path: {calls}, over {groups}; verdicts read {'at once' if now else 'once the device has finished the step'}"


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} GiB"
