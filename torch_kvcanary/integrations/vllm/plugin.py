"""The vLLM plugin's entry point: SGLang's per-slot canary records kept beside vLLM's KV cache.

vLLM runs `register` in every process (the ``vllm.general_plugins`` entry point); it does
nothing unless ``KVCANARY_VLLM`` is set. Then it checks that `adapter` supports this vLLM,
hooks each worker's model runner (V1 or V2; any other is refused at start), sizes the KV
cache with the canary's memory taken from its budget (`kv_cache_budget`), and registers the
KV connector `CONNECTOR`. The switches are `config`'s, the worker's canary is
`worker.WorkerCanary`, what the log says is `reports`', and the connector is `connector`'s.
See docs/vllm.md.
"""

from __future__ import annotations

import logging
import math
from fractions import Fraction

from ...canary import KvCanary
from ...records import SLOT_BYTES
from . import adapter
from .config import CONNECTOR, POLICY_ENV, Settings, refusal, settings
from .worker import WorkerCanary

logger = logging.getLogger(adapter.LOGGER)

_active: WorkerCanary | None = None


def active() -> WorkerCanary | None:
    """The canary of the model runner this process built last (in-process engines:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``)."""
    return _active


def register() -> None:
    """The ``vllm.general_plugins`` entry point: hooks vLLM's model runner and registers
    the KV connector `CONNECTOR` when ``KVCANARY_VLLM`` is set, after checking that
    `adapter` supports this vLLM. vLLM may call it more than once in a process."""
    chosen = settings()
    if chosen is None:
        return
    version = adapter.vllm_version()
    if not adapter.is_supported(version):
        raise RuntimeError(
            f"kv-canary: the vLLM plugin supports vLLM {adapter.SUPPORTED}, this is vLLM {version}: "
            f"install a supported vLLM, or unset {POLICY_ENV} to serve without the canary"
        )
    adapter.register_connector(CONNECTOR, f"{__package__}.connector", CONNECTOR)
    # A runner starts under the settings of its start (a process may start engines one after another).
    hooks = adapter.PluginCallbacks(
        start=lambda model_runner: _start(model_runner, settings() or chosen), kv_cache_budget=kv_cache_budget, refusal=refusal
    )
    if adapter.hook(hooks):
        logger.debug("kv-canary: vLLM plugin hooked (policy %s, mode %s)", chosen.policy, chosen.mode.name)


def _start(model_runner, chosen: Settings) -> WorkerCanary:
    """The canary of a model runner that has just allocated its KV cache."""
    global _active
    _active = WorkerCanary(model_runner, chosen)
    return _active


def kv_cache_budget(available: int, kv_bytes_per_slot: Fraction | int, fixed_bytes: int = 0) -> int:
    """The bytes of ``available`` (what a worker found for its KV cache) by which vLLM may
    size the KV cache, so that the cache and its canary fit in ``available`` together: the
    canary's fixed part (``fixed_bytes`` besides its tables: a `step_buffers.TokenCopy`) comes off the
    top, and the rest is split between a slot's KV bytes and its `SLOT_BYTES`. vLLM gives
    the cache at most the budget, in whole blocks."""
    fixed = KvCanary.device_bytes(0) + fixed_bytes
    share = Fraction(max(available - fixed, 0)) * kv_bytes_per_slot / (kv_bytes_per_slot + SLOT_BYTES)
    return math.floor(share)
