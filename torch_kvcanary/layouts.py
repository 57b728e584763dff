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


# vLLM's KVCacheLayout names (vllm/v1/kv_cache_layout.py): each is a stride order of the
# logical [L, B, H, N, C] (layers, blocks, kv heads, tokens of a block, content). A layer's
# cache is the logical view [B, H, N, C]; the physical order of its axes is the layout's
# order with L dropped.
VLLM_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3),
    "LBNHC": (0, 2, 1, 3),
    "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3),
    "BLNHC": (0, 2, 1, 3),
    "BHLNC": (0, 1, 2, 3),
}
# The caches before vLLM packed K and V into one content axis: a layer is the logical
# [2, B, N, H, D], stored in the order of the backend's get_kv_cache_stride_order.
VLLM_LEGACY_LAYOUTS = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
# vLLM 0.32 still accepts the legacy names for packed caches (vllm/config/cache.py).
_VLLM_PACKED_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# How each attention backend (its get_name()) splits a packed layer's [B, H, N, C] into K
# and V, read off its forward():
#   "content": ``kv.transpose(1, 2).split(head_size, dim=-1)``: K is C[:D], V is C[D:].
#   "tokens": CPU_ATTN views each block-head's [N, C] as [2N, D], K in the first N rows.
VLLM_BACKEND_SPLITS = {
    "CPU_ATTN": "tokens",
    "FLASH_ATTN": "content",
    "TRITON_ATTN": "content",
    "FLEX_ATTENTION": "content",
    "HPC_ATTN": "content",
    "ROCM_AITER_UNIFIED_ATTN": "content",
}
# Backends whose kernels pack the tokens of a block together inside its K and V planes:
# CPU_ATTN's cpu_attn_reshape_and_cache stores K as [head_size, block_size] ("vec") or in
# AMX tiles, and V in token pairs under AMX. Slot t of a block then reads row t of the
# plane, not token t's values: the slots of a block still cover its bytes exactly once (a
# changed byte is reported at a slot of the same block), but writing one token changes the
# fold of the block's other slots.
VLLM_BLOCK_PACKED_BACKENDS = frozenset({"CPU_ATTN"})


def _layout_name(layout) -> str:
    name = getattr(layout, "name", layout)  # a vllm KVCacheLayout member, or its name
    if not isinstance(name, str):
        raise TypeError(f"kv-canary: layout must be vLLM's name of the layout (a str or a KVCacheLayout), got {type(layout).__name__}")
    return name


def _check_physical_order(kv_cache: torch.Tensor, order: tuple[int, ...], layout: str) -> None:
    """The logical axes taken in ``order`` must lie outermost to innermost in memory."""
    strides = [kv_cache.stride(axis) for axis in order if kv_cache.shape[axis] > 1]
    if any(outer < inner for outer, inner in zip(strides, strides[1:])) or (strides and strides[-1] != 1):
        raise ValueError(
            f"kv-canary: a vLLM {layout} layer has its axes {order} outermost to innermost in memory, but this tensor "
            f"(shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}) does not: pass the layout vLLM resolved "
            "(CacheConfig.get_resolved_kv_cache_layout()) and the layer's tensor as vLLM binds it"
        )


def vllm(kv_cache: torch.Tensor, *, layout=None, backend: str | None = None, read_bytes: int = sys.maxsize) -> Sources:
    """One vLLM layer's K and V sources, as vLLM describes the layer; slot = block * block_size + offset.

    ``layout`` is vLLM's name of the cache layout (``CacheConfig.get_resolved_kv_cache_layout()``,
    a ``KVCacheLayout`` or its name), and ``kv_cache`` the tensor vLLM binds to the layer:

    * a packed layer (vLLM >= 0.26): the logical ``[num_blocks, num_kv_heads, block_size, C]``
      in one of `VLLM_LAYOUTS` (or the legacy aliases ``NHD`` / ``HND``). ``backend``, the
      attention backend's ``get_name()``, says how K and V share C (`VLLM_BACKEND_SPLITS`);
      for `VLLM_BLOCK_PACKED_BACKENDS` a slot reads a row of its block's planes, not its
      token's values (see there).
    * a legacy layer: the logical ``[2, num_blocks, block_size, num_kv_heads, head_size]``
      with ``layout`` ``NHD`` or ``HND`` (K is ``kv_cache[0]``, V ``kv_cache[1]``).

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
    name = _layout_name(layout)
    if kv_cache.dim() == 5:
        if name not in VLLM_LEGACY_LAYOUTS or kv_cache.shape[0] != 2:
            raise ValueError(
                f"kv-canary: a 5-D vLLM layer is the legacy [2, num_blocks, block_size, num_kv_heads, head_size] with "
                f"layout NHD or HND, got shape {tuple(kv_cache.shape)} with layout {name!r}"
            )
        _check_physical_order(kv_cache, VLLM_LEGACY_LAYOUTS[name], name)
        return _views(kv_cache[0], kv_cache[1], read_bytes=read_bytes)
    name = _VLLM_PACKED_ALIASES.get(name, name)
    if kv_cache.dim() != 4 or name not in VLLM_LAYOUTS:
        raise ValueError(
            f"kv-canary: a packed vLLM layer is the 4-D [num_blocks, num_kv_heads, block_size, C] with a layout of "
            f"{sorted(VLLM_LAYOUTS)}, got shape {tuple(kv_cache.shape)} with layout {name!r}"
        )
    split = VLLM_BACKEND_SPLITS.get(backend)
    if split is None:
        raise ValueError(
            f"kv-canary: a packed vLLM layer needs backend=, the attention backend's get_name(), to say how K and V "
            f"share the content axis; known: {sorted(VLLM_BACKEND_SPLITS)}, got {backend!r}"
        )
    _check_physical_order(kv_cache, VLLM_LAYOUTS[name], name)
    num_blocks, heads, block_size, content = kv_cache.shape
    if content % 2:
        raise ValueError(f"kv-canary: a packed vLLM layer's content axis holds K then V (2 * head_size), got {content}")
    head_size = content // 2
    if split == "content":
        key, value = kv_cache[..., :head_size], kv_cache[..., head_size:]
    else:
        if kv_cache.stride(3) != 1 or kv_cache.stride(2) != content:
            raise ValueError(
                f"kv-canary: {backend} reads each block-head [block_size, C] as one run, but this tensor's strides are {kv_cache.stride()}"
            )
        # Row t of the [2N, D] reading starts t * D elements into the block-head.
        shape, strides = (num_blocks, heads, block_size, head_size), (kv_cache.stride(0), kv_cache.stride(1), head_size, 1)
        offset = kv_cache.storage_offset()
        key = kv_cache.as_strided(shape, strides, offset)
        value = kv_cache.as_strided(shape, strides, offset + block_size * head_size)
    return _views(key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3), read_bytes=read_bytes)


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
