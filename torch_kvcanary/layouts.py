"""Sources for the KV caches of common engines, as views (never copies).

Each helper returns a tuple of sources (K first, then V, where a layout has both),
ready to concatenate and pass to `fold` or `KvCanary`. ``read_bytes`` is clipped per
source like upstream (``sys.maxsize`` reads whole tokens, 0 leaves the source out).
"""

from __future__ import annotations

import sys

import torch

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


def vllm(kv_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One vLLM layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
    slot = block * block_size + offset."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv-canary: a vLLM layer is [2, num_blocks, block_size, num_kv_heads, head_size], got shape {tuple(kv_cache.shape)}"
        )
    return _views(kv_cache[0], kv_cache[1], read_bytes=read_bytes)


def vllm_fused(kv_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """vLLM's fused layout where K and V share each token's row: shape
    ``[num_blocks, 2, block_size, heads * head_size]``, strides
    ``(2 * block_size * hd, hd, 2 * hd, 1)`` (hd = heads * head_size)."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv-canary: a fused vLLM layer is [num_blocks, 2, block_size, heads * head_size], got shape {tuple(kv_cache.shape)}"
        )
    return _views(kv_cache[:, 0], kv_cache[:, 1], read_bytes=read_bytes)


def hf_static_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """One layer of a Hugging Face ``StaticCache``: ``[batch, heads, max_len, head_dim]`` each;
    slot = batch_index * max_len + position."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(f"kv-canary: {name} is [batch, heads, max_len, head_dim], got shape {tuple(cache.shape)}")
    return _views(key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3), read_bytes=read_bytes)


def hf_static_cache_slots(batch_index: torch.Tensor | int, positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """The slots of ``positions`` of batch row ``batch_index`` in `hf_static_cache` sources."""
    return batch_index * max_len + positions


def trtllm_block_pool(pool: torch.Tensor, *, read_bytes: int = sys.maxsize) -> Sources:
    """A TensorRT-LLM style block pool ``[num_blocks, 2, heads, tokens_per_block, head_dim]``;
    slot = block * tokens_per_block + offset."""
    if pool.dim() != 5 or pool.shape[1] != 2:
        raise ValueError(f"kv-canary: a block pool is [num_blocks, 2, heads, tokens_per_block, head_dim], got shape {tuple(pool.shape)}")
    return _views(pool[:, 0].permute(0, 2, 1, 3), pool[:, 1].permute(0, 2, 1, 3), read_bytes=read_bytes)
