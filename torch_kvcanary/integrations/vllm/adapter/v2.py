"""Model Runner V2 (`V2_RUNNER`; V2's CPU runner subclasses it): its hooks, the `Step` of
its forward, and `RunnerV2`, the plugin's view of it."""

from __future__ import annotations

import numpy as np
import torch

from .common import (
    FORWARD_SEEN,
    HOOKED,
    V2_RUNNER,
    WATCHER,
    PluginCallbacks,
    RunnerView,
    Step,
    TokenHistory,
    Watcher,
    begin_execute,
    forward_unseen,
    inner_method,
    qualified_name,
    watching_after_allocation,
)


def hook_model_runner(model_runner, callbacks: PluginCallbacks) -> None:
    """Model Runner V2, on the instance: once it has allocated its KV cache (not in a
    profiling run), its watcher is started and its KV connector wrapped (`_ForwardBracket`),
    so that every forward of an engine step runs between the watcher's ``begin_step`` and
    ``end_step``: V2's execute_model brackets every forward (eager, piecewise and full CUDA
    graphs) with the connector's ``pre_forward`` and ``finish_forward``. As for V1
    (`v1.hook_model_runner`), the hooks run around whatever the class does, and a step whose
    scheduled tokens ran without the connector's ``pre_forward`` stops the engine."""
    if model_runner.__dict__.get(HOOKED, False):
        return
    execute_model = inner_method(model_runner, "execute_model")

    def bracket_forwards() -> None:
        model_runner.kv_connector = _ForwardBracket(model_runner.kv_connector, model_runner)

    def execute_model_with_canary(scheduler_output, *args, **kwargs):
        begin_execute(model_runner, scheduler_output)
        output = execute_model(scheduler_output, *args, **kwargs)
        if forward_unseen(model_runner, scheduler_output):
            raise callbacks.refusal(
                f"the vLLM plugin did not see the model forward of an engine step of {qualified_name(type(model_runner))}: "
                f"its execute_model ran the step's tokens without its KV connector's pre_forward ({V2_RUNNER}'s bracket "
                "of every forward), where the plugin watches each forward"
            )
        return output

    model_runner.initialize_kv_cache = watching_after_allocation(model_runner, callbacks, prepare=bracket_forwards)
    model_runner.execute_model = execute_model_with_canary
    setattr(model_runner, HOOKED, True)


class _ForwardBracket:
    """A Model Runner V2's KV connector (vLLM's no-op one when none is configured), with the
    runner's watcher called around each model forward of an engine step: after the
    connector's ``pre_forward`` (whose synchronous loads land before the forward reads them)
    and after its ``finish_forward``. Dummy runs (profiling, warm-up, CUDA-graph capture,
    data-parallel padding) schedule no token and are not watched. Everything else is the
    connector's."""

    def __init__(self, connector, model_runner):
        self._connector = connector
        self._model_runner = model_runner
        self._watched: tuple[Watcher, object] | None = None

    def __getattr__(self, name):
        # Only what this object lacks reaches here; its own (underscored) state is never the
        # connector's, which also keeps a copy made before __init__ ran from recursing.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._connector, name)

    def pre_forward(self, scheduler_output, input_batch, *args, **kwargs):
        result = self._connector.pre_forward(scheduler_output, input_batch, *args, **kwargs)
        self._watched = None
        watcher = getattr(self._model_runner, WATCHER, None)
        if watcher is not None and scheduler_output.total_num_scheduled_tokens:
            setattr(self._model_runner, FORWARD_SEEN, True)
            batch = watcher.begin_step(lambda: step_v2(self._model_runner, scheduler_output, input_batch))
            self._watched = (watcher, batch)
        return result

    def finish_forward(self):
        result = self._connector.finish_forward()
        watched, self._watched = self._watched, None
        if watched is not None:
            watcher, batch = watched
            watcher.end_step(batch)
        return result


def step_v2(model_runner, scheduler_output, input_batch) -> Step:
    """The `Step` of one Model Runner V2 forward, from its input batch: rows in input-batch
    order, each row's tokens laid out by ``query_start_loc`` (the batch may run fewer
    tokens than were scheduled, under adaptive verification of draft tokens), slots from
    the group's row of V2's slot mappings, positions 1-D (V2 keeps M-RoPE's apart), and
    each row's request-state index for its token history."""
    num_reqs = input_batch.num_reqs
    starts = input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64)
    num_scheduled = np.diff(starts)
    num_computed = input_batch.num_computed_tokens_np[:num_reqs].astype(np.int64)
    copies = np.array(scheduler_output.kv_cache_block_copies or [], dtype=np.int64).reshape(-1, 2)
    return Step(
        list(input_batch.req_ids[:num_reqs]), num_scheduled, num_computed, input_batch.input_ids,
        input_batch.positions, copies, input_batch.idx_mapping,
    )  # fmt: skip


class RunnerV2(RunnerView):
    """A Model Runner V2 (`V2_RUNNER`), as the plugin reads it. V2 keeps a request's state by
    request-state index and gathers, before each forward, the block tables attention reads
    into persistent buffers in input-batch order; the forward's `Step` comes from V2's
    input batch (`step_v2`), and its token history from V2's request states."""

    is_v2 = True

    @property
    def drafter_writes_seen(self) -> bool:
        """V2's speculator proposes after the forward's ``finish_forward``, which ends the
        watcher's step: its layers are not watched."""
        return False

    def _lora_request(self, request_id: str):
        state = getattr(self.model_runner, "lora_state", None)
        return None if state is None else state.lora_requests.get(request_id)

    def _group_buffers(self, group: int) -> tuple[int, torch.Tensor, torch.Tensor, object]:
        tables = self.model_runner.block_tables
        return tables.block_sizes[group], tables.input_block_tables[group], tables.slot_mappings[group], None

    @property
    def async_scheduling(self) -> bool:
        return bool(self.model_runner.vllm_config.scheduler_config.async_scheduling)

    @property
    def token_history_current(self) -> bool:
        """V2 writes each sampled token into its history on the device, in stream order,
        before the next forward, under async scheduling too."""
        return True

    @property
    def token_history_on_host(self) -> bool:
        return False

    def token_history(self, device: torch.device) -> TokenHistory | None:
        """V2 keeps every request's tokens (its prompt and what it sampled, written on the
        device in stream order before the next forward) by request-state index
        (`Step.history_rows`), on the runner's device."""
        history = self.model_runner.req_states.all_token_ids.gpu
        return TokenHistory(history, None) if history.device == device else None
