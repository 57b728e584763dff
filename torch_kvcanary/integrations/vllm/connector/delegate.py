"""`InnerDelegate`: every call of vLLM's KV connector API forwarded to an inner connector.

`KvCanaryConnector` may wrap another connector (``kv_connector_extra_config["inner"]``, a
whole ``kv_transfer_config``). This base class holds that connector (`inner`, or None) and
forwards each member of vLLM's ``KVConnectorBase_V1`` to it, with the answer of a connector
that transfers nothing where there is none: no external tokens, no request held, no block
freed late. The facade overrides the calls where the canary acts and calls these for the
rest; a test walks the installed vLLM's base and fails on a member not defined here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from ..config import CONNECTOR

INNER = "inner"
"""The key of ``kv_connector_extra_config`` that holds the inner connector's ``kv_transfer_config``."""


def inner_config(vllm_config):
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


def build_inner(config, role: KVConnectorRole, kv_cache_config) -> KVConnectorBase_V1 | None:
    """The inner connector of ``config`` (`inner_config`'s answer), or None without one."""
    if config is None:
        return None
    connector_cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    return connector_cls(config, role, kv_cache_config)


class InnerDelegate(KVConnectorBase_V1):
    """vLLM's connector API, forwarded to `inner` (None: a connector that transfers nothing).
    The step's metadata the facade binds holds the inner connector's as ``.inner``."""

    inner: KVConnectorBase_V1 | None

    # Worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.inner is not None:
            self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.inner is not None:
            self.inner.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.inner is not None:
            self.inner.clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.inner is not None:
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        if self.inner is not None:
            self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]):
        return self.inner.get_finished(finished_req_ids) if self.inner is not None else (None, None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        if self.inner is None:
            return super().get_transfer_results(finished_req_ids)
        return self.inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.inner.get_block_ids_with_load_errors()) if self.inner is not None else set()

    def get_kv_connector_stats(self):
        return self.inner.get_kv_connector_stats() if self.inner is not None else None

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
        if self.inner is not None:
            self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata | None:
        """The inner connector's metadata of the step (the facade wraps it in its own)."""
        return self.inner.build_connector_meta(scheduler_output) if self.inner is not None else None

    def on_new_request(self, request) -> None:
        if self.inner is not None:
            self.inner.on_new_request(request)

    def update_connector_output(self, connector_output):
        if self.inner is not None:
            self.inner.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids) if self.inner is not None else (False, None)

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
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        inner = inner_config(vllm_config)
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
