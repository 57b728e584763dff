"""Every vLLM internal the plugin touches, and the vLLM versions they are read off.

The plugin decides what is verified, recorded and reported; this subpackage is its only way
into vLLM's internals: it wraps the worker's and the model runner's methods (`hook`), refuses
a model runner it cannot watch, turns each model forward into a `Step`, reads a runner's KV
cache layers, block table and token history (`RunnerView`: `RunnerV1`, `RunnerV2`), reaches vLLM's KV
connector machinery (`connectors`), and names the logger whose lines reach vLLM's log
(`LOGGER`). How a layer's bytes split into K and V is `layouts.vllm`'s.

* `versions`: the vLLM series supported and what differs between them (`RELEASES`, `is_supported`, `release`);
* `common`: what the runners' hooks share and hand the plugin;
* `groups`: a runner's KV cache groups as the plugin watches them;
* `embeddings`: what fed each position where requests may give prompt embeddings;
* `v1`, `v2`: Model Runner V1's and V2's hooks, `Step` and view;
* `hooks`: the worker's hooks, which check and hook its runner and size its KV cache;
* `identity`: what vLLM holds of a request's identity (its LoRA adapter's loads, its cache salt);
* `connectors`: vLLM's KV connector internals;
* `nixl`: vLLM's NixlConnector's and NIXL's.

Nothing here imports vLLM at module level: the plugin's entry point runs in every process
vLLM starts and must cost nothing while the plugin is off.
"""

from . import nixl
from .common import (
    LOGGER,
    V1_RUNNER,
    V2_RUNNER,
    PluginCallbacks,
    RunnerView,
    Step,
    TokenHistory,
    Watcher,
    watch,
)
from .connectors import (
    ended_with_error,
    example_connector_folder,
    example_connector_requests,
    locally_cached_blocks,
    register_connector,
    tensor_parallel_rank,
    total_kv_heads,
)
from .groups import NULL_SLOT, SKIPPED_SPECS, WATCHED_SPECS, AttentionLayer, KvCacheGroup
from .hooks import hook, runner_view, unwatchable
from .identity import RequestIdentity, carries_cache_salt
from .v1 import RunnerV1
from .v2 import RunnerV2
from .versions import RELEASES, SUPPORTED, SUPPORTED_SERIES, Release, is_supported, release, vllm_version

__all__ = [
    "LOGGER", "NULL_SLOT", "RELEASES", "SKIPPED_SPECS", "SUPPORTED", "SUPPORTED_SERIES", "V1_RUNNER", "V2_RUNNER", "WATCHED_SPECS",
    "AttentionLayer", "KvCacheGroup", "PluginCallbacks", "Release", "RequestIdentity", "RunnerV1", "RunnerV2", "RunnerView", "Step", "TokenHistory", "Watcher",
    "carries_cache_salt", "ended_with_error", "example_connector_folder", "example_connector_requests", "hook", "is_supported", "locally_cached_blocks", "nixl", "register_connector",
    "release", "runner_view", "tensor_parallel_rank", "total_kv_heads", "unwatchable", "vllm_version", "watch",
]  # fmt: skip
