"""Model Runner V1 (`V1_RUNNER`; vLLM's V1 CPU runner subclasses it): its hooks, the `Step`
of its forward, and `Runner`, the plugin's view of it."""

from __future__ import annotations

import numpy as np
import torch

from .common import (
    BUDGET,
    FORWARD_SEEN,
    HOOKED,
    SKIPPED_SPECS,
    V1_RUNNER,
    WATCHED_SPECS,
    WATCHER,
    AttentionLayer,
    KvCacheGroup,
    Plugin,
    Step,
    TokenHistory,
    forward_unseen,
    inner_method,
    is_model_runner_v2,
    qualified_name,
    watch,
    watched_group_indices,
)

# What the hooks keep on a V1 runner besides the common attributes: the scheduler output of the
# step in execute_model, and a step left open for the speculative drafter's writes.
_SCHEDULED = "_kvcanary_step"
_PENDING = "_kvcanary_pending"


def hook_model_runner(model_runner, plugin: Plugin) -> None:
    """Model Runner V1, on the instance: a step's forward runs between the watcher's
    ``begin_step`` and ``end_step``; where the watcher waits for the speculative drafter,
    which proposes in ``sample_tokens``, the step ends after that (or, if sampling never
    came, before the runner's next forward).

    The hooks are the instance's own attributes, so they bracket whatever the runner's
    class does: a subclass's overrides, and other plugins' patches of the class, made
    before or after this hook, run inside them. A step whose tokens reached the model
    without passing ``_model_forward`` (a runner that runs its model some other way) stops
    the engine with ``plugin.refusal`` at that step, so the canary is never silently off."""
    if model_runner.__dict__.get(HOOKED, False):
        return
    initialize_kv_cache = inner_method(model_runner, "initialize_kv_cache")
    execute_model = inner_method(model_runner, "execute_model")
    model_forward = inner_method(model_runner, "_model_forward")
    sample_tokens = inner_method(model_runner, "sample_tokens")

    def initialize_kv_cache_with_canary(kv_cache_config, is_profiling=False, *args, **kwargs):
        initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            watch(model_runner, plugin.start(model_runner))

    def execute_model_with_canary(scheduler_output, *args, **kwargs):
        setattr(model_runner, _SCHEDULED, scheduler_output)
        setattr(model_runner, FORWARD_SEEN, False)
        try:
            output = execute_model(scheduler_output, *args, **kwargs)
        finally:
            setattr(model_runner, _SCHEDULED, None)
        if forward_unseen(model_runner, scheduler_output):
            raise plugin.refusal(
                f"the vLLM plugin did not see the model forward of an engine step of {qualified_name(type(model_runner))}: "
                f"its execute_model ran the step's tokens without {V1_RUNNER}._model_forward, where the plugin watches each forward"
            )
        return output

    def model_forward_with_canary(input_ids=None, positions=None, *args, **kwargs):
        watcher = getattr(model_runner, WATCHER, None)
        scheduled = getattr(model_runner, _SCHEDULED, None)
        if watcher is None or scheduled is None:  # profiling, warm-up and CUDA-graph capture runs
            return model_forward(input_ids, positions, *args, **kwargs)
        setattr(model_runner, FORWARD_SEEN, True)
        _end_pending_step(model_runner)
        batch = watcher.begin_step(lambda: _step(model_runner, scheduled, input_ids, positions))
        output = model_forward(input_ids, positions, *args, **kwargs)
        if watcher.watches_drafter:
            setattr(model_runner, _PENDING, (watcher, batch))
        else:
            watcher.end_step(batch)
        return output

    def sample_tokens_with_canary(*args, **kwargs):
        output = sample_tokens(*args, **kwargs)
        _end_pending_step(model_runner)
        return output

    model_runner.initialize_kv_cache = initialize_kv_cache_with_canary
    model_runner.execute_model = execute_model_with_canary
    model_runner._model_forward = model_forward_with_canary
    model_runner.sample_tokens = sample_tokens_with_canary
    setattr(model_runner, HOOKED, True)


def _end_pending_step(model_runner) -> None:
    """Ends the step a V1 runner's watcher left open for the drafter's writes, if any."""
    pending = getattr(model_runner, _PENDING, None)
    if pending is not None:
        setattr(model_runner, _PENDING, None)
        watcher, batch = pending
        watcher.end_step(batch)


def _step(model_runner, scheduler_output, input_ids: torch.Tensor | None, positions: torch.Tensor) -> Step:
    batch = model_runner.input_batch
    request_ids = list(batch.req_ids)
    num_scheduled = np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in request_ids], dtype=np.int64)
    num_computed = batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64)
    num_tokens = int(num_scheduled.sum())
    if positions.dim() != 1:  # M-RoPE's [3, tokens]: the runner keeps the sequence positions beside them
        positions = model_runner.positions[:num_tokens]
    if input_ids is None and model_runner.supports_mm_inputs and not model_runner.enable_prompt_embeds:
        # A multimodal model runs on the embeddings of the runner's input ids (placeholders
        # where an image goes), which the runner keeps.
        input_ids = model_runner.input_ids.gpu[:num_tokens]
    tables = batch.block_table.block_tables
    slot_mappings = [tables[i].slot_mapping.gpu[:num_tokens] for i in watched_group_indices(model_runner)]
    copies = np.array(scheduler_output.kv_cache_block_copies or [], dtype=np.int64).reshape(-1, 2)
    return Step(request_ids, num_scheduled, num_computed, input_ids, positions, slot_mappings, copies)


def keeps_token_history_on_host(model_runner) -> bool:
    """Whether Model Runner V1 keeps its token history on the host while its model runs on a
    device (a GPU); never V2, whose history is on its device."""
    if is_model_runner_v2(model_runner):
        return False
    return model_runner.input_batch.token_ids_cpu_tensor.device != torch.device(model_runner.device)


class Runner:
    """One vLLM model runner whose KV cache is allocated, as the plugin reads it:
    ``model_runner`` (vLLM's Model Runner V1; `runner` gives the right view of any)."""

    is_v2 = False

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
    def async_scheduling(self) -> bool:
        return self.model_runner.use_async_scheduling

    @property
    def token_history_current(self) -> bool:
        """Whether the token history (`token_history`) holds every context token when a forward
        starts: V1's trails the device by a step under async scheduling."""
        return not self.async_scheduling

    @property
    def token_history_on_host(self) -> bool:
        """Whether the runner keeps its token history on the host while its model runs on a
        device (V1 on a GPU): the canary then keeps a copy on the device (`worker.TokenCopy`),
        of `token_rows`' shape, from `known_tokens` and each step's input ids."""
        return keeps_token_history_on_host(self.model_runner)

    @property
    def token_rows(self) -> tuple[int, int]:
        """The token history's shape: (input-batch rows, positions per row)."""
        batch = self.model_runner.input_batch
        return batch.max_num_reqs, batch.max_model_len

    def known_tokens(self, row: int) -> torch.Tensor:
        """The tokens of input-batch row ``row``'s context as V1 holds them on the host once a
        request has taken the row (its prompt, and a resumed request's earlier output): int32
        ``[context]`` on the host, -1 where the prompt is embeddings."""
        batch = self.model_runner.input_batch
        context = int(batch.num_computed_tokens_cpu[row])
        return torch.where(batch.is_token_ids_tensor[row, :context], batch.token_ids_cpu_tensor[row, :context], -1)

    @property
    def kv_transfer_config(self):
        """vLLM's ``kv_transfer_config`` (a ``KVTransferConfig``), None when none is set."""
        return self.model_runner.vllm_config.kv_transfer_config

    @property
    def kv_load_failure_policy(self) -> str | None:
        """vLLM's ``kv_transfer_config.kv_load_failure_policy`` ("recompute" or "fail"), None without a KV connector."""
        config = self.model_runner.vllm_config.kv_transfer_config
        return None if config is None or config.kv_connector is None else config.kv_load_failure_policy

    def kv_connector(self):
        """This worker's KV connector (vLLM builds it before the KV cache), or None."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def context(self) -> tuple[list[str], np.ndarray]:
        """The request ids of the input batch's rows and, per row, its tokens in the KV cache."""
        batch = self.model_runner.input_batch
        request_ids = list(batch.req_ids)
        return request_ids, batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64)

    @property
    def kv_cache_layout(self) -> str:
        """vLLM's name of the layout its caches are in (a `layouts.VLLM_LAYOUTS` key, or a legacy alias)."""
        return self.model_runner.cache_config.get_resolved_kv_cache_layout().name

    @property
    def tensor_parallel_size(self) -> int:
        return self.model_runner.parallel_config.tensor_parallel_size

    def tensor_parallel_group(self):
        """The CPU process group of this worker's tensor-parallel ranks."""
        from vllm.distributed import get_tp_group

        return get_tp_group().cpu_group

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
            block_size, device_block_table, block_table = self._block_table(index)
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
                )
            )
        return watched

    @property
    def drafter_writes_seen(self) -> bool:
        """Whether a watcher's step can end after the speculative drafter has written its
        layers (`Watcher.watches_drafter`): V1's drafter proposes in ``sample_tokens``,
        which the hooks wrap."""
        return True

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

    def _block_table(self, group: int) -> tuple[int, torch.Tensor, object]:
        """KV cache group ``group``'s block size, device block table and block table object
        (`KvCacheGroup`): V1's input batch keeps one per group, rows in input-batch order."""
        table = self.model_runner.input_batch.block_table.block_tables[group]
        return table.block_size, table.block_table.gpu, table

    def token_history(self, device: torch.device) -> TokenHistory | None:
        """The runner's token history where it lives on ``device``, else None (V1 on a GPU
        keeps it on the host). V1's is by input-batch row, with a mask of the positions it
        holds."""
        batch = self.model_runner.input_batch
        if batch.token_ids_cpu_tensor.device != device:
            return None
        return TokenHistory(batch.token_ids_cpu_tensor, batch.is_token_ids_tensor)
