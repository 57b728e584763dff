"""`KvCanaryConnector`: the canary as a vLLM KV connector.

vLLM's KV connectors are how a worker tells the scheduler that blocks of the KV cache hold
bad bytes: ``get_block_ids_with_load_errors``, read right after the forward of the same
step. With ``kv_load_failure_policy="recompute"`` the scheduler rolls every running request
whose context holds such a block back to the start of its first bad block, drops the token
it sampled in that step and recomputes the blocks in place; with ``"fail"`` it ends those
requests with an error and drops the bad blocks and those after them from the prefix cache.
Under ``KVCANARY_VLLM=repair`` or ``quarantine`` this connector reports the blocks of the
slots the canary flagged in the step (byte-only violations: the plugin stops the step on
any other, see `worker.WorkerCanary`).

It is configured the vLLM way, and the plugin registers it with vLLM's connector factory::

    --kv-transfer-config '{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"inner": {...}}}'

``inner``, optional, is the ``kv_transfer_config`` of a connector every call is delegated
to; without one, it transfers nothing and changes no scheduling: it matches no external
tokens, holds no request and defers no free. The KV an inner connector loads is verified
against the canary's records stored with it for ``ExampleConnector`` (`DiskTransfer`); any
other inner connector is accepted as a producer only (`check_inner`).

Its counters (`CanaryStats`) reach vLLM's stats log line and ``/metrics``
(``vllm:kv_canary_*``, `CanaryPromMetrics`), summed over the workers as vLLM sums connector
stats. With ``KVCANARY_VLLM_DRILL`` set it runs fault drills (`Drill`).

This module subclasses vLLM's public connector base, so it imports vLLM: vLLM imports it
when a ``kv_transfer_config`` names the connector, never the plugin's entry point.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm import envs
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.request import RequestStatus

from ....canary import Violation
from .. import adapter
from ..config import CONNECTOR, CONNECTOR_POLICIES, POLICY_ENV
from . import nixl
from .drill import Drill
from .stats import CanaryPromMetrics, CanaryStats
from .disk import DiskTransfer

logger = logging.getLogger(adapter.LOGGER)

INNER = "inner"
"""The key of ``kv_connector_extra_config`` that holds the inner connector's ``kv_transfer_config``."""


@dataclass
class KvCanaryMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step: whether the step runs a
    forward (an empty step reads no KV, so the canary has nothing to report for it), and
    the inner connector's metadata, and with NixlConnector inside what to snapshot and verify."""

    forward: bool
    inner: KVConnectorMetadata | None = None
    nixl: nixl.NixlOrders | None = None


class KvCanaryConnector(KVConnectorBase_V1):
    """The canary's KV connector; see the module's docstring. The plugin hands each worker's
    connector its `worker.WorkerCanary` (`watch`)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        # The scheduler's block size: its block ids are slot // this (kernel blocks may be smaller).
        self._block_size = groups[0].kv_cache_spec.block_size if groups else None
        # Before the inner connector: NIXL's agent is configured when NixlConnector is built.
        self._nixl_scheduler, self._nixl = _nixl_sides(vllm_config, role, self._block_size)
        self._nixl_orders: nixl.NixlOrders | None = None
        self._nixl_errors: set[int] = set()
        self.inner = _inner_connector(vllm_config, role, kv_cache_config)
        self._failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        self._transfer = DiskTransfer(self.inner) if type(self.inner).__name__ in DiskTransfer.CONNECTORS else None
        self.worker_canary = None  # the worker's `worker.WorkerCanary`, once the plugin has built it (`watch`)
        self.stats = CanaryStats()
        self.drill: Drill | None = None
        self._forward = False
        self._steps = 0
        self._verified = self._recorded = 0

    # The plugin's side -----------------------------------------------------------

    def watch(self, canary) -> None:
        """Called by the plugin once the worker's canary (`worker.WorkerCanary`) is built."""
        self.worker_canary = canary
        self.drill = Drill(canary.drill) if canary.drill else None
        counters = canary.stats()
        self._verified, self._recorded = counters["slots_verified"], counters["slots_recorded"]

    def count(self, violations: list[Violation]) -> None:
        """Called by the plugin with each step's violations."""
        self.stats.add_violations(violations)

    def _reports_blocks(self) -> bool:
        return self.worker_canary is not None and self.worker_canary.policy in CONNECTOR_POLICIES

    # Worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.inner is not None:
            self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._forward = connector_metadata.forward
        self._nixl_orders = connector_metadata.nixl
        self._steps += 1
        if self.inner is not None:
            self.inner.bind_connector_metadata(connector_metadata.inner)
        if self._forward and self.drill is not None and self.worker_canary is not None and self.worker_canary.on:
            self._run_drill()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.inner is not None:
            self.inner.clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """The inner connector's loads; with verified transfers (`DiskTransfer`) the
        canary then adopts the records stored with the landed blocks, breaking those the
        landed bytes or the request do not match, so that the step reports their blocks."""
        if self.inner is None:
            return
        if self._verifies_nixl() and self._nixl_orders is not None:
            self._nixl.fetch(self._nixl_orders)  # P's records, before NIXL starts reading the blocks
        if self._transfer is None or self.worker_canary is None or not self.worker_canary.on:
            self.inner.start_load_kv(forward_context, **kwargs)
            return
        try:
            self.inner.start_load_kv(forward_context, **kwargs)
        except Exception:  # a load that raised: every block it was loading is a load error
            logger.exception("kv-canary: %s failed to load KV; its blocks are reported as load errors", type(self.inner).__name__)
            self._count_landed(self._transfer.land(self.worker_canary, failed=True))
            return
        self._count_landed(self._transfer.land(self.worker_canary))

    def _count_landed(self, landed: tuple[int, int]) -> None:
        verified, failed = landed
        self.stats.data["transfer_slots_verified"] += verified
        self.stats.data["transfer_slots_failed"] += failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.inner is not None:
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        """The inner connector's saves; with verified transfers the canary's records of the
        saved slots are stored beside them (the forward's slots are recorded by now)."""
        if self.inner is not None:
            self.inner.wait_for_save()
        if self._transfer is not None and self.worker_canary is not None and self.worker_canary.on:
            self._transfer.store(self.worker_canary)
        if self._verifies_nixl() and self._nixl_orders is not None:
            self._nixl.snapshot(self.worker_canary, self._nixl_orders)

    def _verifies_nixl(self) -> bool:
        return self._nixl is not None and self.worker_canary is not None and self.worker_canary.on

    def get_finished(self, finished_req_ids: set[str]):
        if self.inner is None:
            return None, None
        sending, recving = self.inner.get_finished(finished_req_ids)
        self._nixl_finished(sending, recving, ())
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]):
        if self.inner is None:
            return super().get_transfer_results(finished_req_ids)
        results = self.inner.get_transfer_results(finished_req_ids)
        self._nixl_finished(results.finished_sending, results.finished_recving, results.failed_recving)
        return results

    def _nixl_finished(self, sending, recving, failed) -> None:
        """P: drops the snapshots of the requests whose blocks were sent (or whose lease
        expired). D: verifies the requests whose blocks landed, before vLLM marks their load
        done; their bad blocks are this step's load errors."""
        if not self._verifies_nixl():
            return
        self._nixl.release(sending)
        if recving:
            errors, verified, bad = self._nixl.land(self.worker_canary, recving, failed)
            self._nixl_errors |= errors
            self._count_landed((verified, bad))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner connector's, and under repair or quarantine the blocks of the slots the
        canary flagged in this step; their records from each affected request's first bad
        block on are invalidated, so that a request reading them before they are
        recomputed is flagged too."""
        errors = set(self.inner.get_block_ids_with_load_errors()) if self.inner is not None else set()
        if self._nixl_errors and self._reports_blocks():  # blocks that landed bad in this step (`_nixl_finished`), forward or not
            errors |= self._nixl_errors
            if self.worker_canary.policy == "repair":
                self.stats.data["blocks_repaired"] += len(self._nixl_errors)
        self._nixl_errors = set()  # under the other policies their broken records are flagged where they are read
        if not self._forward or self.worker_canary is None:
            return errors
        flagged = self.worker_canary.step_flagged_slots()
        self._catch_drills(flagged)
        if self._reports_blocks() and flagged.numel():
            blocks = set((flagged // self._block_size).tolist())
            self.worker_canary.invalidate_from_flagged_blocks(flagged)
            if self.worker_canary.policy == "repair":
                self.stats.data["blocks_repaired"] += len(blocks)
            errors |= blocks
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counters since the last call (vLLM calls it every step)."""
        if self.worker_canary is not None and self.worker_canary.on:
            counters = self.worker_canary.stats()
            self.stats.data["slots_verified"] += counters["slots_verified"] - self._verified
            self.stats.data["slots_recorded"] += counters["slots_recorded"] - self._recorded
            self._verified, self._recorded = counters["slots_verified"], counters["slots_recorded"]
        if self._nixl is not None:
            for name, count in self._nixl.take_counts().items():
                self.stats.data[name] += count
        if self.stats.is_empty():
            return None
        taken, self.stats = self.stats, CanaryStats()
        return taken

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if self.inner is not None:
            self.inner.handle_preemptions(kv_connector_metadata.inner)

    def unregister_kv_caches(self) -> None:  # vLLM 0.33: before sleep mode frees the KV cache
        if self.inner is not None:
            self.inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:  # vLLM 0.33: after wake-up
        if self.inner is not None:
            self.inner.restore_kv_caches()

    def get_mem_pool_context(self):
        return self.inner.get_mem_pool_context() if self.inner is not None else None

    def set_host_xfer_buffer_ops(self, copy_operation):
        if self.inner is not None:
            self.inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        if self.inner is not None:
            self.inner.finish_forward()

    def reset_capture_state(self) -> None:
        if self.inner is not None:
            self.inner.reset_capture_state()

    def get_kv_connector_kv_cache_events(self):
        return self.inner.get_kv_connector_kv_cache_events() if self.inner is not None else None

    def get_handshake_metadata(self):
        return self.inner.get_handshake_metadata() if self.inner is not None else None

    def set_xfer_handshake_metadata(self, metadata) -> None:
        if self.inner is not None:
            self.inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        if self.inner is not None:
            self.inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def build_connector_worker_meta(self):
        return self.inner.build_connector_worker_meta() if self.inner is not None else None

    def get_finished_count(self) -> int | None:
        return self.inner.get_finished_count() if self.inner is not None else None

    def shutdown(self):
        if self._nixl is not None:
            self._nixl.close()
        return self.inner.shutdown() if self.inner is not None else None

    # Scheduler side --------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self.inner.requires_kv_delivery if self.inner is not None else False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.inner.supports_divergent_local_hybrid_hits if self.inner is not None else False

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        if self.inner is not None:
            self.inner.bind_gpu_block_pool(gpu_block_pool)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.inner is not None:
            self.inner.bind_kv_cache_manager(kv_cache_manager)
        if self._nixl_scheduler is not None:
            self._nixl_scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.inner is None:
            return 0, False
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        if self.inner is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self.inner.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        if self.inner is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._nixl_scheduler is not None:  # before NixlConnector, which clears the params' do_remote_prefill
            self._nixl_scheduler.before_alloc(request, blocks, num_external_tokens)
        if self.inner is not None:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        inner = self.inner.build_connector_meta(scheduler_output) if self.inner is not None else None
        orders = self._nixl_scheduler.orders(scheduler_output) if self._nixl_scheduler is not None else None
        return KvCanaryMetadata(forward=scheduler_output.total_num_scheduled_tokens > 0, inner=inner, nixl=orders)

    def on_new_request(self, request) -> None:
        if self.inner is not None:
            self.inner.on_new_request(request)

    def update_connector_output(self, connector_output):
        if self.inner is not None:
            self.inner.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The inner connector's answer (none: free the blocks now). Under
        kv_load_failure_policy "fail" a request that ends with an error is counted as
        failed: vLLM ends a request with an error for the blocks a connector reported (the
        canary's, or the inner connector's), and for a few failures of its own (a grammar
        rejecting the tokens, an encoder input it lost), which are counted too."""
        if request.status == RequestStatus.FINISHED_ERROR and self._failure_policy == "fail":
            self.stats.data["requests_failed"] += 1
        if self.inner is None:
            return False, None
        delay, params = self.inner.request_finished(request, block_ids)
        if self._nixl_scheduler is not None:
            self._nixl_scheduler.finished(request, params)
        return delay, params

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        if self.inner is None:
            return False
        return self.inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self):
        return self.inner.take_events() if self.inner is not None else ()

    def has_pending_block_frees(self) -> bool:
        return self.inner.has_pending_block_frees() if self.inner is not None else False

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work() if self.inner is not None else False

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache() if self.inner is not None else None

    # Class side ------------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.33: no. The canary watches views of the KV cache tensors taken when they
        were allocated, which a sleep-mode remap would leave behind."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        inner = _inner_config(vllm_config)
        if inner is None:
            return None
        return KVConnectorFactory.get_connector_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = extra_config.get(INNER)
        if inner is None:
            return False
        connector_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**inner))
        return connector_cls.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config", {}))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CanaryStats(data=copy.deepcopy(data)) if data is not None else CanaryStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVConnectorPromMetrics | None:
        return CanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # The canary's work -----------------------------------------------------------

    def _run_drill(self) -> None:
        if self.drill.run(self.worker_canary, self._steps):
            self.stats.data["drills_injected"] += 1

    def _catch_drills(self, flagged: torch.Tensor) -> None:
        if self.drill is None or not self.drill.pending:
            return
        for steps in self.drill.caught(set(flagged.tolist()), self._steps):
            self.stats.data["drills_caught"] += 1
            self.stats.data["drill_steps_to_catch"] += steps


def _inner_config(vllm_config):
    """A shallow copy of ``vllm_config`` with the inner connector's ``kv_transfer_config``,
    or None without one."""
    outer = vllm_config.kv_transfer_config
    inner = outer.kv_connector_extra_config.get(INNER)
    if inner is None:
        return None
    if not isinstance(inner, dict) or "kv_connector" not in inner:
        raise ValueError(
            f"kv-canary: {CONNECTOR}'s kv_connector_extra_config[{INNER!r}] must be the kv_transfer_config of the "
            f'connector it wraps, e.g. {{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, got {inner!r}'
        )
    if inner["kv_connector"] == CONNECTOR:
        raise ValueError(f"kv-canary: {CONNECTOR} cannot wrap itself: name another connector in kv_connector_extra_config[{INNER!r}]")
    config = copy.copy(vllm_config)
    config.kv_transfer_config = KVTransferConfig(
        **{"engine_id": outer.engine_id, "kv_load_failure_policy": outer.kv_load_failure_policy, **inner}
    )
    return config


VERIFIED = (*DiskTransfer.CONNECTORS, *nixl.CONNECTORS)
"""The inner connectors whose loads the canary verifies."""


def check_inner(inner: KVTransferConfig) -> None:
    """Refuses an inner connector that would load KV the canary cannot verify: the slots it
    loads would hold no records of the canary's (or an earlier request's), and be reported
    at their first read. A producer (it saves, never loads) is delegated to whatever it is."""
    if inner.is_kv_consumer and inner.kv_connector not in VERIFIED:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies the KV an inner connector loads for {', '.join(VERIFIED)} only; "
            f'{inner.kv_connector} with "kv_role": "{inner.kv_role}" would load KV the canary has no records of: give it '
            f'"kv_role": "kv_producer", or unset {POLICY_ENV} to serve it without the canary'
        )


def check_unwrapped(config: KVTransferConfig) -> None:
    """Refuses a KV connector configured in the canary's place (not as its inner connector)
    that loads KV: it writes slots outside the model's forward, which then hold no records
    of the canary's (or an earlier request's), and would be reported at their first read. A
    producer (it saves, never loads) serves beside the canary as it is."""
    if not config.is_kv_consumer:
        return
    if config.kv_connector in VERIFIED:
        inner = {"kv_connector": config.kv_connector, "kv_role": config.kv_role}
        if config.kv_connector_extra_config:
            inner["kv_connector_extra_config"] = config.kv_connector_extra_config
        wrapped = {"kv_connector": CONNECTOR, "kv_role": config.kv_role, "kv_connector_extra_config": {INNER: inner}}
        port = (
            f', with "{nixl.RECORDS_PORT}": a free TCP port in its kv_connector_extra_config'
            if config.kv_connector in nixl.CONNECTORS
            else ""
        )
        change = (
            f"serve it as {CONNECTOR}'s inner connector, which verifies what it loads (--kv-transfer-config '{json.dumps(wrapped)}'{port})"
        )
    else:
        change = f'give it "kv_role": "kv_producer" ({CONNECTOR} verifies the loads of {", ".join(VERIFIED)} only)'
    raise ValueError(
        f'kv-canary: vLLM\'s KV connector {config.kv_connector} with "kv_role": "{config.kv_role}" loads KV into the cache outside '
        f"the model's forward, into slots the canary holds no records of, which it would report as corrupt: {change}, "
        f"or unset {POLICY_ENV} to serve it without the canary"
    )


def _inner_connector(vllm_config, role: KVConnectorRole, kv_cache_config) -> KVConnectorBase_V1 | None:
    config = _inner_config(vllm_config)
    if config is None:
        return None
    check_inner(config.kv_transfer_config)
    connector_cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    return connector_cls(config, role, kv_cache_config)


def _nixl_sides(vllm_config, role: KVConnectorRole, block_size: int | None):
    """With NixlConnector inside: (the scheduler side, None) or (None, the worker side)
    (`nixl`), once its settings are checked and, when asked, NIXL's progress thread slowed;
    (None, None) with another inner connector or none."""
    config = _inner_config(vllm_config)
    if config is None or config.kv_transfer_config.kv_connector not in nixl.CONNECTORS:
        return None, None
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    nixl.check_nixl(vllm_config, extra)
    host, port = envs.VLLM_NIXL_SIDE_CHANNEL_HOST, extra[nixl.RECORDS_PORT]
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if role == KVConnectorRole.SCHEDULER:
        return nixl.NixlScheduler(block_size, f"{host}:{port}", tp_size), None
    if extra.get(nixl.PROGRESS_DELAY) is not None:
        nixl.delay_progress_thread(int(extra[nixl.PROGRESS_DELAY]))
    lease_s = config.kv_transfer_config.get_from_extra_config("kv_lease_duration", nixl.NIXL_LEASE_S)
    sharding = nixl.Sharding(tp_size, adapter.total_kv_heads(vllm_config))
    worker = nixl.NixlWorker(block_size, host, port, max_age_s=2 * lease_s, sharding=sharding, rank=adapter.tensor_parallel_rank())
    return None, worker
