"""What the adapter's modules share: the values the hooks hand the plugin (`Step`,
`TokenHistory`; `KvCacheGroup` is `groups`'), what they ask of it (`Watcher`, `PluginCallbacks`), the
attributes they keep on vLLM's objects, the helpers both runners' hooks use, and what the
plugin reads of either runner (`RunnerView`)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .embeddings import prompt_words
from .groups import SKIPPED_SPECS, WATCHED_SPECS, AttentionLayer, KvCacheGroup
from .identity import RequestIdentity, held_adapter_weights, lora_identity, watch_lora_loads
from .identity import notes as identity_notes

LOGGER = "vllm.torch_kvcanary"
"""The plugin's logger. vLLM's logging configuration handles the ``vllm`` logger and its
children only (its format: process name, pid, level, time, file and line), so a child of it
reaches vLLM's log wherever vLLM configures it, and follows ``VLLM_LOGGING_LEVEL``."""

# The model runners the hooks wrap, "module.qualname": Model Runner V1 (vLLM's V1 CPU runner
# subclasses it) and Model Runner V2 (vLLM 0.33's default where Triton runs; V2's CPU
# runner subclasses it).
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"

# What the hooks keep on vLLM's classes and instances.
HOOKED = "_kvcanary_hooked"
WATCHER = "_kvcanary"
FORWARD_SEEN = "_kvcanary_forward_seen"
BUDGET = "_kvcanary_kv_budget"

PROMPT_EMBEDDINGS = "prompt embeddings"


@dataclass(frozen=True)
class Step:
    """One model forward of an engine step. Row ``i`` of the arrays is row ``i`` of the
    runner's input batch, request ``request_ids[i]``; the tokens of the forward are laid
    out row by row (``num_scheduled[i]`` of row ``i``), ``positions[t]`` is token ``t``'s
    position in its sequence; each watched KV cache group's `KvCacheGroup.slot_mapping`
    holds the slot token ``t`` is written to. The tensors are the runner's buffers as they
    are, with at least ``num_tokens`` (``history_rows``: one per row) entries: none is
    sliced on the step's path."""

    request_ids: list[str]
    num_scheduled: np.ndarray  # int64, tokens this forward runs per row
    num_computed: np.ndarray  # int64, tokens already in the KV cache per row (the context)
    # What fed each token: its token id, or the word of the embedding row that fed it
    # (`embeddings`); None when the model runs on input embeddings the plugin cannot name.
    input_ids: torch.Tensor | None
    positions: torch.Tensor  # 1-D, also for M-RoPE models
    # int64 [copies, 2]: (source, destination) of each whole block vLLM copied before this
    # forward (copy-on-write of a partial prefix hit), in every layer of the pool.
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    # Each row's row in the runner's token history, on the runner's device (V2 keeps a
    # request's state by request-state index); None where they are the input batch's rows.
    history_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


class TokenHistory(NamedTuple):
    """A runner's token history: ``tokens[h, p]`` is the token at position ``p`` of history
    row ``h`` (int32 or int64), held where ``known`` (bool, same shape; None: everywhere) is
    True."""

    tokens: torch.Tensor
    known: torch.Tensor | None


class Watcher(Protocol):
    """What the hooks call around each model forward of an engine step: ``begin_step`` gets
    the function that reads the forward's `Step` from the runner, so that reading it runs
    inside the watcher's own error handling. ``end_step`` comes right after the forward, or,
    where ``watches_drafter``, once the speculative drafter has written its layers too
    (`RunnerView.drafter_writes_seen`)."""

    watches_drafter: bool

    def begin_step(self, read_step: Callable[[], Step]): ...

    def end_step(self, batch) -> None: ...


@dataclass(frozen=True)
class PluginCallbacks:
    """What the hooks ask of the plugin.

    ``start(runner)``: the watcher of a model runner that has just allocated its KV cache.
    ``kv_cache_budget(available, kv_bytes_per_slot, fixed_bytes)``: of the ``available``
    bytes a worker found for its KV cache, those vLLM may size the cache by (the rest is the
    canary's), given the KV cache's bytes per slot over all layers and the bytes the canary
    holds besides its records (a device copy of the token history).
    ``refusal(reason)``: the error that stops a worker whose model runner the plugin cannot
    watch, ``reason`` naming the runner and what to do.
    """

    start: Callable[[object], Watcher]
    kv_cache_budget: Callable[[int, Fraction, int], int]
    refusal: Callable[[str], Exception]


def watching_after_allocation(model_runner, callbacks: PluginCallbacks, *, prepare: Callable[[], None] | None = None) -> Callable:
    """The runner's ``initialize_kv_cache`` wrapped so that once it has allocated the KV
    cache (not in a profiling run), ``prepare`` runs and the runner's watcher starts
    (`watch`, with ``callbacks.start``): both runners' first hook."""
    initialize_kv_cache = inner_method(model_runner, "initialize_kv_cache")

    def initialize_kv_cache_with_canary(kv_cache_config, is_profiling=False, *args, **kwargs):
        initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            if prepare is not None:
                prepare()
            watch(model_runner, callbacks.start(model_runner))

    return initialize_kv_cache_with_canary


def begin_execute(model_runner, scheduler_output) -> None:
    """What both runners' execute_model hooks do first: the identities the step's new
    requests carry are noted (once the watcher runs: `identity.IdentityNotes.note`), and the
    step's forward is marked not seen yet."""
    if getattr(model_runner, WATCHER, None) is not None:
        identity_notes(model_runner).note(scheduler_output)
        prompt_words(model_runner).forget(scheduler_output.finished_req_ids)
    setattr(model_runner, FORWARD_SEEN, False)


def watch(model_runner, watcher: Watcher | None) -> None:
    """Makes ``watcher`` the one the hooks call for ``model_runner`` (None: none)."""
    setattr(model_runner, WATCHER, watcher)


def inner_method(model_runner, name: str) -> Callable:
    """What the instance hook of method ``name`` calls: an attribute of the instance's own
    set before the hook, else the method of its class as it is at each call (so that a
    later patch of the class runs too)."""
    own = model_runner.__dict__.get(name)
    if own is not None:
        return own
    return lambda *args, **kwargs: getattr(type(model_runner), name)(model_runner, *args, **kwargs)


def forward_unseen(model_runner, scheduler_output) -> bool:
    """Whether a watched runner's execute_model has just run scheduled tokens without the
    hooked forward (V1's ``_model_forward``, V2's forward bracket). An encoder-cache producer
    (disaggregated encoding) runs only the multimodal encoder, with no forward of the
    language model."""
    if getattr(model_runner, WATCHER, None) is None or getattr(model_runner, FORWARD_SEEN, True):
        return False
    if not scheduler_output.total_num_scheduled_tokens:
        return False
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    return not (has_ec_transfer() and not get_ec_transfer().is_consumer)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_model_runner_v2(model_runner) -> bool:
    return any(qualified_name(base) == V2_RUNNER for base in type(model_runner).__mro__)


def watched_group_indices(model_runner) -> list[int]:
    """The indices of the runner's KV cache groups of a `WATCHED_SPECS` kind."""
    groups = model_runner.kv_cache_config.kv_cache_groups
    return [i for i, group in enumerate(groups) if type(group.kv_cache_spec).__name__ in WATCHED_SPECS]


class RunnerView(abc.ABC):
    """One vLLM model runner whose KV cache is allocated, as the plugin reads it:
    ``model_runner`` (vLLM's). `RunnerV1` and `RunnerV2` read what differs between Model
    Runner V1 and V2; `hooks.runner_view` gives the right one for a runner."""

    is_v2: bool

    def __init__(self, model_runner):
        self.model_runner = model_runner

    @property
    def name(self) -> str:
        """The runner's class, ``module.qualname``."""
        return qualified_name(type(self.model_runner))

    @property
    def kv_cache_budget(self) -> tuple[int, int] | None:
        """(bytes the worker found for the KV cache, bytes it reported to vLLM for it), or
        None when vLLM sized the cache without asking this worker."""
        return getattr(self.model_runner, BUDGET, None)

    @property
    @abc.abstractmethod
    def async_scheduling(self) -> bool:
        """Whether vLLM schedules the next step before this one's forward has finished."""

    @property
    @abc.abstractmethod
    def token_history_current(self) -> bool:
        """Whether the token history (`token_history`) holds every context token when a forward starts."""

    @property
    @abc.abstractmethod
    def token_history_on_host(self) -> bool:
        """Whether the runner keeps its token history on the host while its model runs on a
        device: the canary then keeps a copy on the device (`step_buffers.TokenCopy`)."""

    @property
    def keeps_token_copy(self) -> bool:
        """Whether the canary keeps its own copy of the token history (`step_buffers.TokenCopy`,
        of `token_rows`' shape and dtype, from `known_tokens` and each step's input ids)."""
        return self.token_history_on_host

    @abc.abstractmethod
    def token_history(self, device: torch.device) -> TokenHistory | None:
        """The runner's token history where it lives on ``device``, else None."""

    @property
    @abc.abstractmethod
    def drafter_writes_seen(self) -> bool:
        """Whether a watcher's step can end after the speculative drafter has written its
        layers (`Watcher.watches_drafter`)."""

    @abc.abstractmethod
    def _group_buffers(self, group: int) -> tuple[int, torch.Tensor, torch.Tensor, object]:
        """KV cache group ``group``'s block size, device block table, slot mapping and block
        table object (`KvCacheGroup`)."""

    @property
    def kv_transfer_config(self):
        """vLLM's ``kv_transfer_config`` (a ``KVTransferConfig``), None when none is set."""
        return self.model_runner.vllm_config.kv_transfer_config

    @property
    def kv_load_failure_policy(self) -> str | None:
        """vLLM's ``kv_transfer_config.kv_load_failure_policy`` ("recompute" or "fail"), None without a KV connector."""
        config = self.model_runner.vllm_config.kv_transfer_config
        return None if config is None or config.kv_connector is None else config.kv_load_failure_policy

    # A request's identity (`identity`) -----------------------------------------------

    def request_identity(self, request_id: str) -> RequestIdentity:
        """What covers request ``request_id`` of the step as a whole: its LoRA adapter and
        its cache salt (taken from the runner's `IdentityNotes`: asked once per request)."""
        found = lora_identity(self._lora_request(request_id))
        return found._replace(cache_salt=identity_notes(self.model_runner).take_salt(request_id))

    def _lora_request(self, request_id: str):
        """Request ``request_id``'s ``LoRARequest`` as the runner holds it (None: no adapter)."""
        return None

    def take_finished(self) -> set[str]:
        """The requests vLLM finished since the last call (their identities may go)."""
        return identity_notes(self.model_runner).take_finished()

    @property
    def uncarried_salts(self) -> int:
        """How many new requests came without their cache salt carried from the scheduler."""
        return identity_notes(self.model_runner).uncarried

    def watch_lora_loads(self, loaded: Callable[[int, dict[str, torch.Tensor]], None]) -> bool:
        """`identity.watch_lora_loads` on the runner."""
        return watch_lora_loads(self.model_runner, loaded)

    def held_adapter_weights(self, lora_id: int) -> dict[str, torch.Tensor] | None:
        return held_adapter_weights(self.model_runner, lora_id)

    @property
    def prompt_embeds_enabled(self) -> bool:
        """Whether the runner's requests may give prompt embeddings (``enable_prompt_embeds``)."""
        config = getattr(self.model_runner, "model_config", None)
        return config is not None and bool(getattr(config, "enable_prompt_embeds", False))

    def read_identity(self) -> dict[str, str]:
        """What of a request's identity the plugin reads from this runner's requests beyond
        its root, each with how: none here (`RunnerV1` reads prompt embeddings)."""
        return {}

    def unread_identity(self) -> list[str]:
        """What of a request's identity this runner's requests may give and the plugin does
        not read (`read_identity`): a multimodal model's items behind their placeholder
        tokens, prompt embeddings (positions whose token is not known, which the canary does
        not check)."""
        config = getattr(self.model_runner, "model_config", None)
        kinds = (("multimodal items", "supports_multimodal_inputs"), (PROMPT_EMBEDDINGS, "enable_prompt_embeds"))
        given = [name for name, flag in kinds if config is not None and getattr(config, flag, False)]
        return [name for name in given if name not in self.read_identity()]

    def kv_connector(self):
        """This worker's KV connector (vLLM builds it before the KV cache), or None."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    @property
    def kv_cache_layout(self) -> str:
        """vLLM's name of the layout its caches are in (a `layouts.VLLM_LAYOUTS` key, or a legacy alias)."""
        return self.model_runner.cache_config.get_resolved_kv_cache_layout().name

    @property
    def tensor_parallel_size(self) -> int:
        return self.model_runner.parallel_config.tensor_parallel_size

    def kv_cache_group_kinds(self) -> list[str]:
        """The kind of each of the model's KV cache groups (its spec's class name)."""
        return [type(group.kv_cache_spec).__name__ for group in self.model_runner.kv_cache_config.kv_cache_groups]

    def unwatched_group_kinds(self) -> list[str]:
        """The kinds of the model's KV cache groups the plugin neither watches nor skips."""
        return [kind for kind in self.kv_cache_group_kinds() if kind not in WATCHED_SPECS and kind not in SKIPPED_SPECS]

    def kv_cache_groups(self, *, drafter: bool = False) -> list[KvCacheGroup]:
        """The watched KV cache groups (`WATCHED_SPECS`), each with the attention layers of the
        served model in layer order, then with ``drafter`` those of `drafter_layer_names` in
        the group (a group of none of the served model's layers is not watched)."""
        from vllm.model_executor.models.utils import extract_layer_index

        indices = watched_group_indices(self.model_runner)
        if not indices:
            return []
        groups = self.model_runner.kv_cache_config.kv_cache_groups
        context = self.model_runner.compilation_config.static_forward_context
        served = self._served_layer_names()
        watched = []
        for index in indices:
            spec = groups[index].kv_cache_spec
            names = sorted((name for name in groups[index].layer_names if name in served), key=extract_layer_index)
            if not names:
                continue
            drafters = (
                sorted((name for name in groups[index].layer_names if name not in served), key=extract_layer_index) if drafter else []
            )
            layers = [
                AttentionLayer(name, context[name].kv_cache, context[name].get_attn_backend().get_name(), drafter=name in drafters)
                for name in names + drafters
            ]
            block_size, device_block_table, slot_mapping, block_table = self._group_buffers(index)
            watched.append(
                KvCacheGroup(
                    index,
                    type(spec).__name__,
                    layers,
                    block_size,
                    device_block_table,
                    block_table,
                    sliding_window=getattr(spec, "sliding_window", None),
                    attention_chunk_size=getattr(spec, "attention_chunk_size", None),
                    slot_mapping=slot_mapping,
                )
            )
        return watched

    def drafter_layer_names(self) -> list[str]:
        """The layers of the watched KV cache groups that are not the served model's: a
        speculative drafter's (a draft model, EAGLE, MTP), which write the pool outside the
        model's forward, when the drafter proposes."""
        indices = watched_group_indices(self.model_runner)
        if not indices:
            return []
        served = self._served_layer_names()
        groups = self.model_runner.kv_cache_config.kv_cache_groups
        return sorted(name for index in indices for name in groups[index].layer_names if name not in served)

    def _served_layer_names(self) -> set[str]:
        """The attention layers of the model the runner serves (its ``get_model()``)."""
        return {
            module.layer_name for module in self.model_runner.get_model().modules() if isinstance(getattr(module, "layer_name", None), str)
        }
