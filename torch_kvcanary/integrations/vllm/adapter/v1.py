"""Model Runner V1 (`V1_RUNNER`; vLLM's V1 CPU runner subclasses it): its hooks, the `Step`
of its forward, and `RunnerV1`, the plugin's view of it."""

from __future__ import annotations

import numpy as np
import torch

from . import embeddings
from .common import (
    FORWARD_SEEN,
    HOOKED,
    PROMPT_EMBEDDINGS,
    V1_RUNNER,
    WATCHER,
    PluginCallbacks,
    RunnerView,
    Step,
    TokenHistory,
    begin_execute,
    forward_unseen,
    inner_method,
    is_model_runner_v2,
    qualified_name,
    watching_after_allocation,
)

# What the hooks keep on a V1 runner besides the common attributes: the scheduler output of the
# step in execute_model, and a step left open for the speculative drafter's writes.
_SCHEDULED = "_kvcanary_step"
_PENDING = "_kvcanary_pending"


def hook_model_runner(model_runner, callbacks: PluginCallbacks) -> None:
    """Model Runner V1, on the instance: a step's forward runs between the watcher's
    ``begin_step`` and ``end_step``; where the watcher waits for the speculative drafter,
    which proposes in ``sample_tokens``, the step ends after that (or, if sampling never
    came, before the runner's next forward).

    The hooks are the instance's own attributes, so they bracket whatever the runner's
    class does: a subclass's overrides, and other plugins' patches of the class, made
    before or after this hook, run inside them. A step whose tokens reached the model
    without passing ``_model_forward`` (a runner that runs its model some other way) stops
    the engine with ``callbacks.refusal`` at that step, so the canary is never silently off."""
    if model_runner.__dict__.get(HOOKED, False):
        return
    execute_model = inner_method(model_runner, "execute_model")
    model_forward = inner_method(model_runner, "_model_forward")
    sample_tokens = inner_method(model_runner, "sample_tokens")

    def execute_model_with_canary(scheduler_output, *args, **kwargs):
        begin_execute(model_runner, scheduler_output)
        setattr(model_runner, _SCHEDULED, scheduler_output)
        try:
            output = execute_model(scheduler_output, *args, **kwargs)
        finally:
            setattr(model_runner, _SCHEDULED, None)
        if forward_unseen(model_runner, scheduler_output):
            raise callbacks.refusal(
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

    model_runner.initialize_kv_cache = watching_after_allocation(model_runner, callbacks)
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
    if positions.dim() != 1:  # M-RoPE's [3, tokens]: the runner keeps the sequence positions beside them
        positions = model_runner.positions
    if input_ids is None and model_runner.enable_prompt_embeds:
        # The token ids the runner keeps, and a word for each position an embedding row feeds.
        input_ids = embeddings.step_input_words(model_runner, request_ids, num_scheduled, num_computed)
    elif input_ids is None and model_runner.supports_mm_inputs:
        # A multimodal model runs on the embeddings of the runner's input ids (placeholders
        # where an image goes), which the runner keeps.
        input_ids = model_runner.input_ids.gpu
    copies = np.array(scheduler_output.kv_cache_block_copies or [], dtype=np.int64).reshape(-1, 2)
    return Step(request_ids, num_scheduled, num_computed, input_ids, positions, copies)


def keeps_token_history_on_host(model_runner) -> bool:
    """Whether Model Runner V1 keeps its token history on the host while its model runs on a
    device (a GPU); never V2, whose history is on its device."""
    if is_model_runner_v2(model_runner):
        return False
    return model_runner.input_batch.token_ids_cpu_tensor.device != torch.device(model_runner.device)


class RunnerV1(RunnerView):
    """A Model Runner V1 (`V1_RUNNER`), as the plugin reads it: its input batch holds the
    requests by row, with a block table object per KV cache group and the token history on
    the host (`token_history_on_host` where the model runs on a device)."""

    is_v2 = False

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
        device (V1 on a GPU): the canary then keeps a copy on the device (`step_buffers.TokenCopy`),
        of `token_rows`' shape, from `known_tokens` and each step's input ids."""
        return keeps_token_history_on_host(self.model_runner)

    @property
    def keeps_token_copy(self) -> bool:
        """Whether the canary keeps its own copy of the token history (`step_buffers.TokenCopy`):
        where V1 keeps it on the host while its model runs on a device, and where requests may
        give prompt embeddings, whose rows' words the runner's int32 history cannot hold."""
        return self.token_history_on_host or self.prompt_embeds_enabled

    @property
    def token_rows(self) -> tuple[int, int, torch.dtype]:
        """The shape of the canary's copy of the token history (input-batch rows, positions per
        row) and its dtype: int64 where it holds embedding rows' words, else int32."""
        batch = self.model_runner.input_batch
        return batch.max_num_reqs, batch.max_model_len, torch.int64 if self.prompt_embeds_enabled else torch.int32

    def read_identity(self) -> dict[str, str]:
        """Prompt embeddings, where requests may give them: each row's word in its position's token field."""
        return {PROMPT_EMBEDDINGS: "a word per embedding row"} if self.prompt_embeds_enabled else {}

    def _lora_request(self, request_id: str):
        state = self.model_runner.requests.get(request_id)
        return None if state is None else state.lora_request

    def known_tokens(self, row: int) -> torch.Tensor:
        """What fed input-batch row ``row``'s context as V1 holds it on the host once a request
        has taken the row (its prompt, and a resumed request's earlier output): ``[context]``
        on the host, int32 token ids, or where requests may give prompt embeddings int64 with
        each embedding row's word at its position (`embeddings.known_words`)."""
        batch = self.model_runner.input_batch
        context = int(batch.num_computed_tokens_cpu[row])
        tokens = torch.where(batch.is_token_ids_tensor[row, :context], batch.token_ids_cpu_tensor[row, :context], -1)
        if not self.prompt_embeds_enabled:
            return tokens
        return embeddings.known_words(self.model_runner, batch.req_ids[row], tokens, context)

    def context(self) -> tuple[list[str], np.ndarray]:
        """The request ids of the input batch's rows and, per row, its tokens in the KV cache."""
        batch = self.model_runner.input_batch
        request_ids = list(batch.req_ids)
        return request_ids, batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64)

    @property
    def drafter_writes_seen(self) -> bool:
        """Whether a watcher's step can end after the speculative drafter has written its
        layers (`Watcher.watches_drafter`): V1's drafter proposes in ``sample_tokens``,
        which the hooks wrap."""
        return True

    def _group_buffers(self, group: int) -> tuple[int, torch.Tensor, torch.Tensor, object]:
        """KV cache group ``group``'s block size, device block table, slot mapping and block
        table object (`KvCacheGroup`): V1's input batch keeps one per group, rows in
        input-batch order."""
        table = self.model_runner.input_batch.block_table.block_tables[group]
        return table.block_size, table.block_table.gpu, table.slot_mapping.gpu, table

    def token_history(self, device: torch.device) -> TokenHistory | None:
        """The runner's token history where it lives on ``device``, else None (V1 on a GPU
        keeps it on the host). V1's is by input-batch row, with a mask of the positions it
        holds."""
        batch = self.model_runner.input_batch
        if batch.token_ids_cpu_tensor.device != device:
            return None
        return TokenHistory(batch.token_ids_cpu_tensor, batch.is_token_ids_tensor)
