"""`KvCanaryConnector`: the canary as a vLLM KV connector.

vLLM's KV connectors are how a worker tells the scheduler that blocks of the KV cache hold
bad bytes: ``get_block_ids_with_load_errors``, read right after the forward of the same
step. With ``kv_load_failure_policy="recompute"`` the scheduler recomputes the bad blocks
in place (which requests it rolls back, and so which records the canary breaks, is the
repair rule of `port.CanaryPort.break_from_flagged_blocks`); with ``"fail"`` it ends the
requests that read them with an error and drops the bad blocks and those after them from
the prefix cache. Under ``KVCANARY_VLLM=repair`` or ``quarantine`` this connector reports the blocks of the
slots the canary flagged in the step where their bytes alone are wrong, and for a request
that read through a wrong mapping (a block-table entry pointing at a block vLLM's scheduler
did not give it there) a block of that request's own, never the block it read
(`CanaryPort.misread_blocks`): vLLM then fails or recomputes that request alone.

It is configured the vLLM way, and the plugin registers it with vLLM's connector factory::

    --kv-transfer-config '{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"inner": {...}}}'

``inner``, optional, is the ``kv_transfer_config`` of a connector every call is delegated
to (`delegate.InnerDelegate`); without one, it transfers nothing and changes no scheduling:
it matches no external tokens, holds no request and defers no free. The KV an inner
connector loads is verified by the transfer verifier of its transport
(`transports.TRANSPORTS`: ``ExampleConnector``, ``NixlConnector``); any other inner
connector is accepted as a producer only (`checks.check_inner`). This class is the facade:
it builds the verifier's half of its role, calls it at the matching connector calls, and
applies the canary's policy to what the step flagged.

Its counters (`CanaryStats`) reach vLLM's stats log line and ``/metrics``
(``vllm:kv_canary_*``, `CanaryPromMetrics`), summed over the workers as vLLM sums connector
stats. With ``KVCANARY_VLLM_DRILL`` set it runs fault drills (`Drill`).

This module subclasses vLLM's public connector base, so it imports vLLM: vLLM imports it
when a ``kv_transfer_config`` names the connector, never the plugin's entry point.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ....violations import Violation
from .. import adapter
from ..config import CONNECTOR_POLICIES
from .checks import check_inner
from .delegate import InnerDelegate, build_inner, inner_config
from .drill import Drill
from .guard import Guard
from .port import CanaryPort, RecordPort
from .stats import FAILED, FAULTS, CanaryPromMetrics, CanaryStats
from .transports import TRANSPORTS

logger = logging.getLogger(adapter.LOGGER)


@dataclass
class KvCanaryMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step: whether the step runs a
    forward (an empty step reads no KV, so the canary has nothing to report for it), the
    inner connector's metadata, and the transfer verifier's orders (`SchedulerVerifier.plan`)."""

    forward: bool
    inner: KVConnectorMetadata | None = None
    orders: Any = None


class KvCanaryConnector(InnerDelegate):
    """The canary's KV connector; see the module's docstring. The plugin hands each worker's
    connector its canary, as its `CanaryPort` and its verifier's `RecordPort` (`attach`)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        # The scheduler's block size: its block ids are slot // this (kernel blocks may be smaller).
        self._block_size = groups[0].kv_cache_spec.block_size if groups else None
        config = inner_config(vllm_config)
        transport = None
        if config is not None:
            check_inner(config.kv_transfer_config)
            transport = TRANSPORTS.get(config.kv_transfer_config.kv_connector)
        if transport is not None:
            transport.worker.check(vllm_config)
            if role == KVConnectorRole.WORKER:
                transport.worker.prepare(vllm_config)
        self.inner = build_inner(config, role, kv_cache_config)
        self._planner = None  # the transfer verifier's scheduler half
        self._verifier = None  # its worker half
        if transport is not None and role == KVConnectorRole.SCHEDULER and transport.scheduler is not None:
            self._planner = transport.scheduler.build(vllm_config, self._block_size)
        if transport is not None and role == KVConnectorRole.WORKER:
            self._verifier = transport.worker.build(vllm_config, self.inner, self._block_size)
        self._orders = None  # the verifier's orders of the bound step
        self._failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        self.port: CanaryPort | None = None  # the worker's canary, once the plugin has built it (`attach`)
        self.records: RecordPort | None = None  # the same, as the verifier uses it
        self.stats = CanaryStats()
        self.guard = Guard()  # the canary's own code in each call below (`guard`)
        self.drill: Drill | None = None
        self._forward = False
        self._steps = 0
        self._verified = self._recorded = 0

    # The plugin's side -----------------------------------------------------------

    def attach(self, port) -> None:
        """Called by the plugin once the worker's canary is built, with ``port``: the facade's
        and the drills' `CanaryPort`, and the verifier's `RecordPort`."""
        self.port = port
        self.records = port
        self.drill = Drill(port.drill_probability) if port.drill_probability else None
        counters = port.counters()
        self._verified, self._recorded = counters["slots_verified"], counters["slots_recorded"]

    def count_violations(self, violations: list[Violation]) -> None:
        """Called by the plugin with each step's violations."""
        self.stats.add_violations(violations)

    def needs_step_verdicts(self) -> bool:
        """Whether each step's verdict is acted on in that step (the worker then waits for
        it): to report its blocks (repair, quarantine), to catch drills, or to judge what a
        transfer landed. Under log or raise without them, nothing needs it at once."""
        return self._reports_blocks() or self.drill is not None or self._verifier is not None

    def _reports_blocks(self) -> bool:
        return self.port is not None and self.port.policy in CONNECTOR_POLICIES

    def _verifying(self) -> bool:
        return self._verifier is not None and self.port is not None and self.port.watching

    # Worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """The inner connector registers the KV caches, and any layer the transfer verifier
        moves with them (NIXL's records region)."""
        super().register_kv_caches(self._verifier.transfer_caches(kv_caches) if self._verifier is not None else kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._forward = connector_metadata.forward
        self._orders = connector_metadata.orders
        self._steps += 1
        if self._forward and self._verifying():
            with self.guard.guarding("verifier"):
                self._verifier.before_forward(self.records)
        if self._forward and self.drill is not None and self.port is not None and self.port.watching:
            with self.guard.guarding("drill"):
                self._run_drill()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """The inner connector's loads. The verifier prepares for them first; for those that
        land within the call (`WorkerVerifier.after_load`) the canary then adopts the records
        stored with the landed blocks, breaking those the landed bytes or the request do not
        match, so that the step reports their blocks. Where the call raises, the verifier
        judges the loads it was landing, every block of them a load error
        (`WorkerVerifier.after_failed_load`), or, for loads that land later, lets the
        exception go on."""
        prepared = False
        if self._verifying():
            with self.guard.guarding("verifier"):
                self._verifier.before_load(self.records, self._orders)
                prepared = True
        if not prepared:  # the loads land unverified
            if self._verifier is not None and self.port is not None and not self.port.watching:
                with self.guard.guarding("verifier"):
                    self._verifier.land_unwatched(self._orders)  # this worker's share of each load: counted unverified
            super().start_load_kv(forward_context, **kwargs)
            return
        try:
            super().start_load_kv(forward_context, **kwargs)
        except Exception:
            landed = None
            with self.guard.guarding("verifier"):
                landed = self._verifier.after_failed_load(self.records)
            if landed is None:
                raise
            logger.exception("kv-canary: %s failed to load KV; its blocks are reported as load errors", type(self.inner).__name__)
            self._count_landed(landed)
            return
        with self.guard.guarding("verifier"):
            self._count_landed(self._verifier.after_load(self.records))

    def _count_landed(self, landed: tuple[int, int]) -> None:
        verified, failed = landed
        self.stats.add("transfer_slots_verified", verified)
        self.stats.add(FAILED, {"unknown": failed})  # failures a verifier found as they landed, not classified

    def wait_for_save(self):
        """The inner connector's saves; the verifier then stores or hands over the canary's
        records of the saved slots (the forward's slots are recorded by now)."""
        super().wait_for_save()
        if self._verifying():
            with self.guard.guarding("verifier"):
                self._verifier.after_save(self.records, self._orders)

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving = super().get_finished(finished_req_ids)
        self._transfers_done(finished_req_ids, sending, recving, ())
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        results = super().get_transfer_results(finished_req_ids)
        if self.inner is not None:
            self._transfers_done(finished_req_ids, results.finished_sending, results.finished_recving, results.failed_recving)
        return results

    def _transfers_done(self, finished_req_ids, sending, recving, failed) -> None:
        """The verifier's comparison of the transfers the inner connector finished, before
        vLLM marks the loads done: the records of what landed bad are broken, and the step
        that reads them reports their blocks."""
        if not self._verifying():
            return
        with self.guard.guarding("verifier"):
            self._verifier.forget(finished_req_ids)
            self._count_landed(self._verifier.on_done(self.records, sending, recving, failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner connector's, and under repair or quarantine the blocks of the slots the
        canary flagged in this step, with the blocks of the requests that read through a
        wrong mapping (`CanaryPort.misread_blocks`) in place of the blocks they read, and
        where the ring overflowed every block of the step's requests (`CanaryPort.overflow_blocks`);
        the records of what the bad reads spoiled are invalidated, so that a request reading
        them before they are recomputed is flagged too. Under repair a request is given
        ``KVCANARY_VLLM_MAX_REPAIRS`` recomputes of a block (`CanaryPort.ration_repairs`)."""
        errors = super().get_block_ids_with_load_errors()
        if not self._forward or self.port is None:
            return errors
        flagged = self.port.flagged_slots()
        ours: set[int] = set()
        if self._reports_blocks():
            misread, readers = set(), set()  # where the mapping rule fails, every flagged slot is reported as a byte fault
            with self.guard.guarding("mapping"):
                misread, readers = self.port.misread_blocks(self._block_size)
            if misread:  # the blocks read through a wrong mapping are their owners': not reported
                flagged = flagged[~torch.isin(flagged, torch.tensor(sorted(misread), dtype=flagged.dtype, device=flagged.device))]
            ours |= readers
            with self.guard.guarding("repair"):
                ours |= self.port.overflow_blocks(self._block_size)
        drilled = set()  # a drill's flip is a fault of its own, not one that came back
        if self.drill is not None and self.drill.pending and flagged.numel():
            drilled = set(self.drill.pending) & set(flagged.tolist())
        with self.guard.guarding("drill"):
            self._catch_drills(flagged)
        if self._verifying():
            with self.guard.guarding("verifier"):
                flagged_set = set(flagged.tolist()) if flagged.numel() else set()
                self._verifier.on_flagged(self.records, flagged_set)  # the verifier counts them by kind (`take_counts`)
        if not self._reports_blocks():
            return errors
        ours |= set((flagged // self._block_size).tolist()) if flagged.numel() else set()
        if self.port.policy == "repair" and ours:
            given_up = 0  # where the rationing fails, every block is reported
            with self.guard.guarding("repair"):
                ours, given_up = self.port.ration_repairs(ours, self._block_size, drilled=drilled)
            self.stats.add("repairs_given_up", given_up)
            self.stats.add("blocks_repaired", len(ours - errors))
        if flagged.numel():
            with self.guard.guarding("repair"):
                self.port.break_from_flagged_blocks(flagged)
        return errors | ours

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The canary's counters since the last call (vLLM calls it every step). vLLM
        builds one stats class per connector (`build_kv_connector_stats`), the canary's:
        the inner connector's own are not passed on."""
        with self.guard.guarding("counters"):
            if self.port is not None and self.port.watching:
                counters = self.port.counters()
                self.stats.add("slots_verified", counters["slots_verified"] - self._verified)
                self.stats.add("slots_recorded", counters["slots_recorded"] - self._recorded)
                self._verified, self._recorded = counters["slots_verified"], counters["slots_recorded"]
            elif self.port is not None:  # the canary has turned itself off: said at every step (`stats.OFF`)
                self.stats.mark_off()
        if self._verifier is not None:
            with self.guard.guarding("verifier"):
                self.stats.add_counts(self._verifier.take_counts())
        self.stats.add(FAULTS, self.guard.take())
        if self.stats.is_empty():
            return None
        taken, self.stats = self.stats, CanaryStats()
        return taken

    def shutdown(self):
        if self._verifier is not None:
            self._verifier.close()
        return super().shutdown()

    # Scheduler side --------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._planner is not None:
            with self.guard.guarding("verifier"):
                self._planner.bind_kv_cache_manager(kv_cache_manager)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._planner is not None:  # before the inner connector, which may clear what it reads (NIXL's do_remote_prefill)
            with self.guard.guarding("verifier"):
                self._planner.on_alloc(request, blocks, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        inner = super().build_connector_meta(scheduler_output)
        orders = None
        if self._planner is not None:
            with self.guard.guarding("verifier"):
                orders = self._planner.plan(scheduler_output)
        return KvCanaryMetadata(forward=scheduler_output.total_num_scheduled_tokens > 0, inner=inner, orders=orders)

    def update_connector_output(self, connector_output):
        super().update_connector_output(connector_output)
        if self._planner is not None:
            with self.guard.guarding("verifier"):
                self._planner.on_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The inner connector's answer (none: free the blocks now). Under
        kv_load_failure_policy "fail" a request that ends with an error is counted as
        failed: vLLM ends a request with an error for the blocks a connector reported (the
        canary's, or the inner connector's), and for a few failures of its own (a grammar
        rejecting the tokens, an encoder input it lost), which are counted too."""
        if adapter.ended_with_error(request) and self._failure_policy == "fail":
            self.stats.add("requests_failed", 1)
        delay, params = super().request_finished(request, block_ids)
        if self._planner is not None:
            with self.guard.guarding("verifier"):
                self._planner.on_finished(request, params)
        return delay, params

    # Class side ------------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.33: no. The canary watches views of the KV cache tensors taken when they
        were allocated, which a sleep-mode remap would leave behind."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CanaryStats(data=copy.deepcopy(data)) if data is not None else CanaryStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVConnectorPromMetrics | None:
        return CanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # The canary's work -----------------------------------------------------------

    def _run_drill(self) -> None:
        self.stats.add("drills_expired", self.drill.expire(self._steps))
        if self.drill.run(self.port, self._steps):
            self.stats.add("drills_injected", 1)

    def _catch_drills(self, flagged: torch.Tensor) -> None:
        if self.drill is None or not self.drill.pending:
            return
        for steps in self.drill.caught(set(flagged.tolist()), self._steps):
            self.stats.add("drills_caught", 1)
            self.stats.add("drill_steps_to_catch", steps)
