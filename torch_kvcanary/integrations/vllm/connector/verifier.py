"""Transfer verifiers: how the canary verifies the KV an inner connector moves, one per
transport, behind two base classes (`SchedulerVerifier`, `WorkerVerifier`), chosen by the
inner connector's name (`transports.TRANSPORTS`).

The canary's records are relocation-invariant (token, position, chain and fold do not
depend on the slot), so a transport's verifier stores the records of what the inner
connector saves beside it, and checks what it loads against them: the slots that differ
have their records broken, and their blocks become the step's load errors (recomputed under
repair, failed under quarantine). A verifier has a worker half (`WorkerVerifier`) and, where
it plans per step on the scheduler, a scheduler half (`SchedulerVerifier`); the facade calls
them at the matching connector calls and passes the scheduler half's plan (its ``orders``)
to the workers in its own metadata.

As vLLM's ``KVConnectorBase_V1`` does, each base class declares what every transport must
write as abstract methods and every optional hook as a documented no-op: a new transport is
a module with a subclass of each half it needs and its entry in `transports.TRANSPORTS`;
the facade does not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from .port import RecordPort


class SchedulerVerifier(ABC):
    """The scheduler half: what each step's workers verify (`plan`), from what vLLM's
    scheduler tells the connector. A transport writes `build` and `plan`; the other hooks
    do nothing unless it overrides them."""

    @classmethod
    @abstractmethod
    def build(cls, vllm_config, block_size: int) -> SchedulerVerifier:
        """The scheduler half of a server configured by ``vllm_config``; ``block_size`` is the scheduler's."""

    @abstractmethod
    def plan(self, scheduler_output) -> Any:
        """The step's orders for the worker halves (None: nothing to do)."""

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """With vLLM's KV cache manager, once. Default: not needed."""
        return None

    def on_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Before the inner connector's ``update_state_after_alloc``. Default: nothing to note."""
        return None

    def on_finished(self, request, params: dict | None) -> None:
        """After the inner connector's ``request_finished``, with the params it hands on. Default: nothing to note."""
        return None

    def on_output(self, connector_output) -> None:
        """After the inner connector's ``update_connector_output``, with the workers' output of a step. Default: nothing to note."""
        return None


class WorkerVerifier(ABC):
    """The worker half. ``port`` is the worker's canary (`port.RecordPort`); ``orders`` the
    scheduler half's plan of the step (None without a scheduler half).

    A transport writes `build` and `after_save`, and verifies its loads where they land: in
    `after_load` where the inner connector lands them within its ``start_load_kv`` (and
    `after_failed_load` where that call raises), else in `on_done` where the inner connector
    reports them finished. The other hooks do nothing unless it overrides them."""

    @classmethod
    def check(cls, vllm_config) -> None:
        """The transport's refusals at start, in either role: a ValueError saying what to
        change. Default: every setting is verified."""
        return None

    @classmethod
    def prepare(cls, vllm_config) -> None:
        """Before the inner connector's worker is built. Default: nothing to prepare."""
        return None

    @classmethod
    @abstractmethod
    def build(cls, vllm_config, inner, block_size: int) -> WorkerVerifier:
        """The worker half over ``inner`` (the inner connector); ``block_size`` is the scheduler's."""

    @abstractmethod
    def after_save(self, port: RecordPort, orders) -> None:
        """After the inner connector's ``wait_for_save``: the forward's slots are recorded, and
        the verifier stores or hands over the records of what the inner connector saved."""

    def transfer_caches(self, kv_caches: dict) -> dict:
        """The caches the inner connector registers (``kv_caches``, with any layer of the
        verifier's own it moves with the KV). Default: the KV caches as they are."""
        return kv_caches

    def before_forward(self, port: RecordPort) -> None:
        """Once the step's metadata is bound, before its forward (vLLM starts an inner
        connector's asynchronous loads after it), with the runner holding the step's
        requests. Default: nothing to do."""
        return None

    def before_load(self, port: RecordPort, orders) -> None:
        """Before the inner connector's ``start_load_kv``. Default: nothing to prepare."""
        return None

    def land_unwatched(self, orders) -> None:
        """The worker's canary is off (a fault of its own): the inner connector's loads of
        ``orders`` land without this worker's comparison. Default: nothing counted."""
        return None

    def after_load(self, port: RecordPort) -> tuple[int, int]:
        """After the inner connector's ``start_load_kv`` returned: (slots verified, slots that
        failed) of the loads that landed within it. Default: (0, 0), the loads land later
        (`on_done`)."""
        return 0, 0

    def after_failed_load(self, port: RecordPort) -> tuple[int, int] | None:
        """The inner connector's ``start_load_kv`` raised: (slots verified, slots that failed)
        of the loads it was landing, every block of which is a load error; None: not the
        verifier's to judge, and the exception goes on. Default: None, the loads land later."""
        return None

    def on_done(self, port: RecordPort, sent, landed, failed) -> tuple[int, int]:
        """The requests the inner connector finished sending and loading (and failed to
        load): (slots verified, slots that failed) of the loads verified as they are done.
        Default: (0, 0), every load was verified as it landed."""
        return 0, 0

    def on_flagged(self, port: RecordPort, flagged: set[int]) -> int:
        """After each forward, with the slots the step's verify flagged: how many of them
        are slots a transfer landed that this step read for the first time (counted by
        kind in `take_counts`). Default: 0, the loads' failures were counted as they landed."""
        return 0

    def forget(self, request_ids) -> None:
        """Requests vLLM finished: whatever the verifier holds for them. Default: nothing held across steps."""
        return None

    def take_counts(self) -> dict:
        """Counts since the last call by their names in `stats.COUNTERS` (a labelled one's by label value). Default: none."""
        return {}

    def close(self) -> None:
        """At shutdown. Default: nothing held."""
        return None
