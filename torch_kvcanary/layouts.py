"""Sources for the KV caches of common engines, as views (never copies).

Each helper returns a tuple of sources (K first, then V, where a layout has both),
ready to concatenate and pass to `fold` or `KvCanary`: the views `engines` describes, a
slot's token being its ``[heads, head_dim]``, and SGLang's buffers in SGLang's own row form
(`make_row_source`). ``read_bytes`` is clipped per source like upstream (``sys.maxsize``
reads whole tokens, 0 leaves the source out).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from . import engines
from .sources import RealKvSource, ViewSource, make_row_source, view_source

Sources = tuple[RealKvSource | ViewSource, ...]


def _views(*views: torch.Tensor, read_bytes: int) -> Sources:
    sources = (view_source(v, read_bytes=read_bytes) for v in views)
    return tuple(s for s in sources if s.read_bytes > 0)


def sglang_mha(k_buffer: torch.Tensor, v_buffer: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One SGLang MHA layer: ``k_buffer`` and ``v_buffer`` are ``[num_slots, heads, head_dim]``."""
    return make_row_source(layer_buffer=k_buffer, read_bytes=read_bytes) + make_row_source(layer_buffer=v_buffer, read_bytes=read_bytes)


def sglang_mla(kv_buffer: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One SGLang MLA layer: ``kv_buffer`` is ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``."""
    return make_row_source(layer_buffer=kv_buffer, read_bytes=read_bytes)


# vLLM's layouts and backends, as `engines` describes them.
VLLM_LAYOUTS = engines.VLLM_LAYOUTS
VLLM_LEGACY_LAYOUTS = engines.VLLM_LEGACY_LAYOUTS
VLLM_BACKEND_SPLITS = engines.VLLM_BACKEND_SPLITS
VLLM_BLOCK_PACKED_BACKENDS = engines.VLLM_BLOCK_PACKED_BACKENDS
VLLM_MLA_BACKENDS = engines.VLLM_MLA_BACKENDS


def vllm(kv_cache: torch.Tensor, *, layout=None, backend: str | None = None, read_bytes: int = sys.maxsize) -> Sources:
    """One vLLM layer's K and V sources, as vLLM describes the layer; slot = block * block_size + offset.

    ``layout`` is vLLM's name of the cache layout (``CacheConfig.get_resolved_kv_cache_layout()``,
    a ``KVCacheLayout`` or its name), ``backend`` the attention backend's ``get_name()`` (for
    a packed layer), and ``kv_cache`` the tensor vLLM binds to the layer: a packed
    ``[num_blocks, num_kv_heads, block_size, C]`` or a legacy ``[2, num_blocks, block_size,
    num_kv_heads, head_size]`` (`engines.vllm`). For `VLLM_BLOCK_PACKED_BACKENDS` a slot
    reads a row of its block's planes, not its token's values (see there).

    The shape alone cannot tell these apart (with two KV heads a packed layer and the fused
    ``[num_blocks, 2, block_size, heads * head_size]`` are the same shape), so a call
    without ``layout``, or a packed layer without a known ``backend``, is refused.
    """
    if layout is None:
        raise ValueError(
            "kv-canary: layouts.vllm needs layout=, vLLM's name of the cache layout "
            f"(CacheConfig.get_resolved_kv_cache_layout(): one of {sorted(VLLM_LAYOUTS)}, or NHD / HND for a "
            "legacy [2, num_blocks, block_size, num_kv_heads, head_size] layer); the shape alone is ambiguous"
        )
    return _views(*engines.vllm(kv_cache, layout=layout, backend=backend), read_bytes=read_bytes)


def vllm_block_slots(blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Every slot of vLLM blocks ``blocks`` (slot = block * block_size + offset), int64, block by block."""
    return (np.asarray(blocks, dtype=np.int64)[:, None] * block_size + np.arange(block_size)).reshape(-1)


def vllm_mla(kv_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One vLLM MLA layer ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
    (`engines.vllm_mla`): one source, a slot's latent row; slot = block * block_size + offset."""
    return _views(engines.vllm_mla(kv_cache), read_bytes=read_bytes)


def vllm_fused(kv_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """vLLM's fused layout where K and V share each token's row: shape
    ``[num_blocks, 2, block_size, heads * head_size]``, strides
    ``(2 * block_size * hd, hd, 2 * hd, 1)`` (hd = heads * head_size)."""
    return _views(*engines.vllm_fused(kv_cache), read_bytes=read_bytes)


def hf_static_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One layer of a Hugging Face ``StaticCache``: ``[batch, heads, max_len, head_dim]`` each;
    slot = batch_index * max_len + position."""
    key = engines.hf_static_cache(key_cache, name="key_cache")
    value = engines.hf_static_cache(value_cache, name="value_cache")
    return _views(key, value, read_bytes=read_bytes)


def hf_static_cache_slots(batch_index: torch.Tensor | int, positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """The slots of ``positions`` of batch row ``batch_index`` in `hf_static_cache` sources."""
    return batch_index * max_len + positions


def trtllm_block_pool(pool: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """A TensorRT-LLM style block pool ``[num_blocks, 2, heads, tokens_per_block, head_dim]``;
    slot = block * tokens_per_block + offset."""
    return _views(*engines.trtllm_block_pool(pool), read_bytes=read_bytes)
