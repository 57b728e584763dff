"""The hooks every worker gets: its model runner checked and hooked (`v1`, `v2`) before
vLLM sizes its KV cache, the KV cache sized with the canary's memory taken from its budget,
and the plugin's view of a runner (`runner_view`)."""

from __future__ import annotations

from fractions import Fraction

from . import v1, v2
from .common import BUDGET, HOOKED, V1_RUNNER, V2_RUNNER, WATCHER, PluginCallbacks, RunnerView, is_model_runner_v2, qualified_name
from .identity import carry_cache_salt


def hook(callbacks: PluginCallbacks) -> bool:
    """Wraps the worker's and the model runner's methods that the canary needs.

    In each worker: before vLLM sizes the KV cache (``determine_available_memory``) and
    before it allocates it (``initialize_from_config``) the worker's model runner is checked
    (`unwatchable`); a runner the hooks cannot watch stops the worker with
    ``callbacks.refusal``. The memory the worker reports for the KV cache is cut to
    ``callbacks.kv_cache_budget``. Once the runner has allocated its KV cache (not in a
    profiling run), ``callbacks.start(runner)`` returns its watcher, and every model forward of
    an engine step runs between the watcher's ``begin_step`` and ``end_step`` (`Watcher`);
    a worker whose runner has no watcher after allocating its KV cache is stopped too.
    Each runner instance is hooked when its worker first checks it (`v1.hook_model_runner`,
    `v2.hook_model_runner`). In the scheduler's process the scheduler is made to carry each
    request's cache salt to the workers (`identity.carry_cache_salt`). False, and nothing
    done, when vLLM is hooked already."""
    from vllm.v1.worker.worker_base import WorkerBase

    carry_cache_salt()
    if getattr(WorkerBase, HOOKED, False):
        return False
    _hook_workers(callbacks)
    setattr(WorkerBase, HOOKED, True)
    return True


def _hook_workers(callbacks: PluginCallbacks) -> None:
    """Every vLLM worker built from here on gets, on the instance, the two methods that size
    and allocate its KV cache wrapped. vLLM builds a worker after loading the plugins, in
    the process that runs it, whatever its class (GPU, CPU, ...), so `WorkerBase`'s
    constructor is where every one of them passes."""
    from vllm.v1.worker.worker_base import WorkerBase

    construct = WorkerBase.__init__

    def construct_with_canary(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        _wrap_worker(self, callbacks)

    WorkerBase.__init__ = construct_with_canary


def _wrap_worker(worker, callbacks: PluginCallbacks) -> None:
    determine_available_memory = worker.determine_available_memory
    initialize_from_config = worker.initialize_from_config

    def determine_available_memory_with_canary(*args, **kwargs):
        runner = _checked_runner(worker, callbacks)
        available = determine_available_memory(*args, **kwargs)
        budget = callbacks.kv_cache_budget(available, _kv_bytes_per_slot(worker), _token_copy_bytes(runner))
        setattr(runner, BUDGET, (available, budget))
        return budget

    def initialize_from_config_with_canary(*args, **kwargs):
        runner = _checked_runner(worker, callbacks)
        initialize_from_config(*args, **kwargs)
        if getattr(runner, WATCHER, None) is None:
            base = V2_RUNNER if is_model_runner_v2(runner) else V1_RUNNER
            raise callbacks.refusal(
                f"the vLLM plugin did not attach to {qualified_name(type(runner))}: it allocated its KV cache "
                f"without reaching {base}.initialize_kv_cache"
            )

    worker.determine_available_memory = determine_available_memory_with_canary
    worker.initialize_from_config = initialize_from_config_with_canary


def unwatchable(model_runner) -> str | None:
    """Why the hooks cannot watch ``model_runner`` (naming it and what to do), or None when
    they can: it must be vLLM's Model Runner V1 or V2, or a subclass of either."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if is_model_runner_v2(model_runner) or isinstance(model_runner, GPUModelRunner):
        return None
    return (
        f"the vLLM plugin cannot watch {qualified_name(type(model_runner))}: it watches vLLM's Model Runner V1 "
        f"({V1_RUNNER}), V2 ({V2_RUNNER}) and their subclasses"
    )


def _checked_runner(worker, callbacks: PluginCallbacks):
    """The worker's model runner, once `unwatchable` has nothing against it and it is hooked."""
    model_runner = getattr(worker, "model_runner", None)
    reason = unwatchable(model_runner)
    if reason is not None:
        raise callbacks.refusal(reason)
    if is_model_runner_v2(model_runner):
        v2.hook_model_runner(model_runner, callbacks)
    else:
        v1.hook_model_runner(model_runner, callbacks)
    return model_runner


def _token_copy_bytes(model_runner) -> int:
    """The bytes of the canary's copy of a V1 runner's token history, where it keeps one
    (`RunnerView.keeps_token_copy`): one row per input-batch row, int32, or int64 where it
    holds prompt embeddings' words."""
    if is_model_runner_v2(model_runner):
        return 0
    view = v1.RunnerV1(model_runner)
    if not view.keeps_token_copy:
        return 0
    rows, length, dtype = view.token_rows
    return rows * length * dtype.itemsize


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


def runner_view(model_runner) -> RunnerView:
    """The plugin's view of ``model_runner``: `RunnerV2` for a Model Runner V2, else `RunnerV1`."""
    return v2.RunnerV2(model_runner) if is_model_runner_v2(model_runner) else v1.RunnerV1(model_runner)
