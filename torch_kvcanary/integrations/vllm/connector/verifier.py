"""Transfer verifiers: how the canary verifies the KV an inner connector moves, one per
transport, behind one interface, chosen by the inner connector's name (`TRANSPORTS`).

The canary's records are relocation-invariant (token, position, chain and fold do not
depend on the slot), so a transport's verifier stores the records of what the inner
connector saves beside it, and checks what it loads against them: the slots that differ
have their records broken, and their blocks become the step's load errors (recomputed under
repair, failed under quarantine). A verifier has a worker half (`WorkerVerifier`) and, where
it plans per step on the scheduler, a scheduler half (`SchedulerVerifier`); the facade calls
them at the matching connector calls and passes the scheduler half's plan (its ``orders``)
to the workers in its own metadata. A new transport is a module with its halves and its
entry in `TRANSPORTS`; the facade does not change.
"""

from __future__ import annotations

from typing import Any, Protocol

from .port import CanaryPort


class SchedulerVerifier(Protocol):
    """The scheduler half: what each step's workers verify (`plan`), from what vLLM's
    scheduler tells the connector."""

    def bind_kv_cache_manager(self, kv_cache_manager) -> None: ...

    def on_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Before the inner connector's ``update_state_after_alloc``."""

    def plan(self, scheduler_output) -> Any:
        """The step's orders for the worker halves (None: nothing to do)."""

    def on_finished(self, request, params: dict | None) -> None:
        """After the inner connector's ``request_finished``, with the params it hands on."""

    def on_output(self, connector_output) -> None:
        """After the inner connector's ``update_connector_output``, with the workers' output of a step."""


class WorkerVerifier(Protocol):
    """The worker half. ``port`` is the worker's canary (`port.CanaryPort`); ``orders`` the
    scheduler half's plan of the step (None without a scheduler half)."""

    LOADS_IN_STEP: bool
    """Whether the inner connector's loads land within its ``start_load_kv`` (verified by
    `after_load`; a load that raises is a failed load), or later (verified by `on_done`)."""

    def transfer_caches(self, kv_caches: dict):
        """The caches the inner connector registers (``kv_caches``, with any layer of the
        verifier's own it moves with the KV)."""

    def before_load(self, port: CanaryPort, orders) -> None: ...

    def after_load(self, port: CanaryPort, *, failed: bool = False) -> tuple[int, int]:
        """(slots verified, slots that failed) of the loads that landed in ``start_load_kv``."""

    def after_save(self, port: CanaryPort, orders) -> None:
        """After the inner connector's ``wait_for_save``: the forward's slots are recorded."""

    def on_done(self, port: CanaryPort, sent, landed, failed) -> tuple[int, int]:
        """The requests the inner connector finished sending and loading (and failed to
        load): (slots verified, slots that failed) of the loads verified as they are done."""

    def on_flagged(self, port: CanaryPort, flagged: set[int]) -> int:
        """After each forward, with the slots the step's verify flagged: how many of them
        are slots a transfer landed that this step read for the first time (counted by
        kind in `take_counts`)."""

    def forget(self, request_ids) -> None:
        """Requests vLLM finished: whatever the verifier holds for them."""

    def take_counts(self) -> dict[str, int]:
        """Counters of `stats.COUNTS` since the last call (those of `stats.LABELLED` by label value)."""

    def close(self) -> None: ...
