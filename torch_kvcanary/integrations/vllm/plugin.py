"""A vLLM plugin: SGLang's per-slot canary records kept beside vLLM's KV cache.

vLLM runs `register` in every process (the ``vllm.general_plugins`` entry point). It does
nothing unless ``KVCANARY_VLLM`` is set:

* ``KVCANARY_VLLM=log``: each corrupted slot is a WARNING line in vLLM's log at its first
  detection; later detections of it are counted into a summary line;
* ``KVCANARY_VLLM=raise``: the step raises `KvCorruptionError`;
* ``KVCANARY_VLLM=repair`` / ``quarantine``: with vLLM's KV connector `CONNECTOR`
  (`connector`), the blocks of byte-only violations are reported to vLLM's scheduler as
  load errors, which it recomputes (``kv_load_failure_policy="recompute"``) or fails the
  requests that read them with (``"fail"``); violations of the mapping stop the step;
* ``KVCANARY_VLLM_DRILL`` (default 0): the probability per step of a fault drill (one byte
  of a live cached block flipped, through the connector);
* ``KVCANARY_VLLM_MODE=partial|all`` (default ``all``): how much of each slot is folded;
* ``KVCANARY_VLLM_SUMMARY_S`` (default 60): at most how often the summary line comes;
* ``KVCANARY_VLLM_EVERY=N`` (default 1): sampled verification: each step verifies each
  request's newest block and one block in N of the rest of its context, in turns, so every
  context slot a request keeps reading is verified at least once every N steps.

In each worker the model runner (vLLM's Model Runner V1 or V2) is checked before vLLM sizes
the KV cache: one the plugin cannot watch stops the worker with a ``kv-canary:`` error (a
canary that is silently off is worse than none). The KV cache is sized with the canary's memory taken from its budget.
Once vLLM has allocated the KV caches, one `KvCanary` watches every attention layer of the
watched KV cache groups (full, sliding-window, chunked-local and MLA attention; Mamba groups
are skipped, any other kind refused): K and V of a packed layer (`layouts.vllm`) or MLA's
latent (`layouts.vllm_mla`), zero-copy views of the distinct tensors; one INFO line says
what is watched. In every engine step, around the model forward, in each watched group:

1. before it, every scheduled request's context that the step's tokens attend to (all of it,
   or a window's positions: blocks below may be freed) is verified as the group's block
   table gives it: the slot's bytes, its position, its token, and its chain through the
   previous position's slot (a context slot this forward itself writes, for another
   request of the batch, is verified after the forward);
2. after it, the slots the forward wrote (the group's slot mapping) are recorded with their
   positions (the 1-D sequence positions, also for M-RoPE models), tokens and previous slots
   (under speculative decoding with a drafter of its own layers, once the drafter has
   written them too: see below);
3. the canary is polled once; a violation line names the vLLM request(s) that read the slot.

The step is planned on the canary's device: the host builds a few values per request (where
each request's verified context, its block-packed tail and its written tokens start, and how
many there are), copies them over once, and `kvcanary::context_slots` expands them through
the group's block table into slots, positions, previous slots and input-batch rows; the
host's work per step grows with the number of requests, not with their context.

Speculative decoding: the target model writes the KV of every draft token in its forward,
and vLLM rewrites the slots of the tokens it rejects in a later forward; a drafter with
layers of its own in the pool (a draft model, EAGLE, MTP) writes them at the step's slots
(and past them, as it drafts) when it proposes, after the forward. Under Model Runner V1 its
layers are watched like the model's, the step recorded once the drafter has proposed;
under V2, or with this package's KV connector (which needs each step's verdict right after
the forward), they are not watched, as the start line says.

Prefix caching, chunked prefill, preemption and recompute need nothing special: a shared
block holds the same records for every request that reads it, and a recomputed slot is
recorded again when it is rewritten. Under a backend that packs a block's tokens together
(CPU_ATTN, `layouts.VLLM_BLOCK_PACKED_BACKENDS`) a slot's bytes are a row of its block, so
the unwritten rows of each request's last block are verified too, and every slot of a
block the forward wrote gets its fold recomputed (`KvCanary.refold`). The context's
tokens are checked against the runner's token history: V2's, on its device; V1's where it
lives on the canary's device (vLLM's CPU build, whose scheduling is synchronous); and where
V1 keeps it on the host (a GPU), against the canary's `worker.TokenCopy` of it on the device.

An exception of the plugin's own code in a step (not a violation) stops the engine under
``raise``; under ``log`` it is logged once at ERROR with its traceback and the canary turns
itself off in that worker, which keeps serving.

Everything the plugin reads from or hooks into vLLM goes through `adapter`, which also says
which vLLM versions it supports: with ``KVCANARY_VLLM`` set, any other version is refused.
This module is the entry point; the switches are `config`'s, the worker's canary is
`worker.WorkerCanary`, what the log says is `reports`', and the KV connector is `connector`'s.
"""

from __future__ import annotations

import logging
import math
from fractions import Fraction

from ...canary import SLOT_BYTES, KvCanary
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
    canary's fixed part (``fixed_bytes`` besides its tables: a `worker.TokenCopy`) comes off the
    top, and the rest is split between a slot's KV bytes and its `SLOT_BYTES`. vLLM gives
    the cache at most the budget, in whole blocks."""
    fixed = KvCanary.device_bytes(0) + fixed_bytes
    share = Fraction(max(available - fixed, 0)) * kv_bytes_per_slot / (kv_bytes_per_slot + SLOT_BYTES)
    return math.floor(share)
