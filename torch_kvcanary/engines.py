"""Where each engine keeps K and V in its KV cache: one description per engine, read by
`layouts` (fold sources) and `digest` (digest units).

Each function takes the tensor(s) an engine keeps for one layer and returns views of them
(never copies) ``[num_pages, page_size, heads, *head_shape]``: slot ``s`` is
``[s // page_size, s % page_size]`` and ``[..., h, ...]`` its head ``h``. A fold source's
token is a slot's ``[heads, *head_shape]``; a digest unit is one head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KvViews(NamedTuple):
    """K and V of one layer, each ``[num_pages, page_size, heads, *head_shape]``."""

    key: torch.Tensor
    value: torch.Tensor


# --- SGLang ------------------------------------------------------------------------------


def sglang_pool(buffer: torch.Tensor) -> torch.Tensor:
    """An SGLang per-slot buffer ``[num_slots, ...]`` (K, V, the MLA latent, a scale) as
    ``[num_slots, 1, ...]``: slot ``s`` is row ``s``, pages of one slot."""
    return buffer.unsqueeze(1)


# --- vLLM --------------------------------------------------------------------------------

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
VLLM_PACKED_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
# How each attention backend (its get_name()) splits a packed layer's [B, H, N, C] into K
# and V, read off its forward():
#   "content": ``kv.transpose(1, 2).split(head_size, dim=-1)``: K is C[:D], V is C[D:].
#   "tokens": CPU_ATTN views each block-head's [N, C] as [2N, D]: the first N rows are the
#   block-head's K plane, the last N its V plane.
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
# plane, not token t's values: the slots of a block still cover its bytes exactly once, K
# in K views and V in V views (a changed byte is reported at a slot of the same block), but
# writing one token changes the rows of the block's other slots.
VLLM_BLOCK_PACKED_BACKENDS = frozenset({"CPU_ATTN"})


def vllm_layout_name(layout) -> str:
    """vLLM's name of a cache layout, from a ``KVCacheLayout`` member or the name itself."""
    name = getattr(layout, "name", layout)
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


def vllm_legacy(kv_cache: torch.Tensor) -> KvViews:
    """A legacy vLLM layer, the logical ``[2, num_blocks, block_size, num_kv_heads, head_size]``
    (any strides): K is ``kv_cache[0]``, V ``kv_cache[1]``."""
    return KvViews(kv_cache[0], kv_cache[1])


def vllm(kv_cache: torch.Tensor, *, layout, backend: str | None = None) -> KvViews:
    """One vLLM layer as vLLM describes it: K and V ``[num_blocks, block_size, num_kv_heads,
    head_size]``, slot = block * block_size + offset.

    ``layout`` is vLLM's name of the cache layout (``CacheConfig.get_resolved_kv_cache_layout()``,
    a ``KVCacheLayout`` or its name), and ``kv_cache`` the tensor vLLM binds to the layer:

    * a packed layer (vLLM >= 0.26): the logical ``[num_blocks, num_kv_heads, block_size, C]``
      in one of `VLLM_LAYOUTS` (or the legacy aliases ``NHD`` / ``HND``). ``backend``, the
      attention backend's ``get_name()``, says how K and V share C (`VLLM_BACKEND_SPLITS`);
      for `VLLM_BLOCK_PACKED_BACKENDS` a slot is a row of its block's K and V planes, not its
      token's values (see there).
    * a legacy layer: `vllm_legacy`'s tensor with ``layout`` ``NHD`` or ``HND``.
    """
    name = vllm_layout_name(layout)
    if kv_cache.dim() == 5:
        if name not in VLLM_LEGACY_LAYOUTS or kv_cache.shape[0] != 2:
            raise ValueError(
                f"kv-canary: a 5-D vLLM layer is the legacy [2, num_blocks, block_size, num_kv_heads, head_size] with "
                f"layout NHD or HND, got shape {tuple(kv_cache.shape)} with layout {name!r}"
            )
        _check_physical_order(kv_cache, VLLM_LEGACY_LAYOUTS[name], name)
        return vllm_legacy(kv_cache)
    name = VLLM_PACKED_ALIASES.get(name, name)
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
    content = kv_cache.shape[3]
    if content % 2:
        raise ValueError(f"kv-canary: a packed vLLM layer's content axis holds K then V (2 * head_size), got {content}")
    if split == "content":
        key, value = kv_cache[..., : content // 2], kv_cache[..., content // 2 :]
    else:
        key, value = _block_head_planes(kv_cache, backend)
    return KvViews(key.transpose(1, 2), value.transpose(1, 2))


def _block_head_planes(kv_cache: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes of each block-head ``[N, C]`` read as ``[2N, D]``, each as
    ``[num_blocks, num_kv_heads, N, D]``: row t of K is row t of the reading, of V row N + t."""
    num_blocks, heads, block_size, content = kv_cache.shape
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != content:
        raise ValueError(
            f"kv-canary: {backend} reads each block-head [block_size, C] as one run, but this tensor's strides are {kv_cache.stride()}"
        )
    head_size = content // 2
    shape, strides = (num_blocks, heads, block_size, head_size), (kv_cache.stride(0), kv_cache.stride(1), head_size, 1)
    offset = kv_cache.storage_offset()
    return kv_cache.as_strided(shape, strides, offset), kv_cache.as_strided(shape, strides, offset + block_size * head_size)


# vLLM's MLA backends (their get_name()) whose layers bind the token-major latent cache
# [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: a slot's row holds its
# compressed KV then its rope key (CPU_MLA's and AMX_MLA's concat-and-cache kernels write
# token t of block b to row [b, t]).
VLLM_MLA_BACKENDS = frozenset({"CPU_MLA", "AMX_MLA"})


def vllm_mla(kv_cache: torch.Tensor) -> torch.Tensor:
    """One vLLM MLA layer ``[num_blocks, block_size, latent]`` (`VLLM_MLA_BACKENDS`) as
    ``[num_blocks, block_size, 1, latent]``: one head, the latent; slot = block * block_size + offset."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv-canary: a vLLM MLA layer is [num_blocks, block_size, latent], got shape {tuple(kv_cache.shape)}")
    return kv_cache.unsqueeze(2)


def vllm_fused(kv_cache: torch.Tensor) -> KvViews:
    """vLLM's fused layout where K and V share each token's row: shape
    ``[num_blocks, 2, block_size, heads * head_size]``, strides
    ``(2 * block_size * hd, hd, 2 * hd, 1)`` (hd = heads * head_size). K and V are
    ``[num_blocks, block_size, heads * head_size]``: the heads are not told apart."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv-canary: a fused vLLM layer is [num_blocks, 2, block_size, heads * head_size], got shape {tuple(kv_cache.shape)}"
        )
    return KvViews(kv_cache[:, 0], kv_cache[:, 1])


# --- Hugging Face ------------------------------------------------------------------------


def hf_static_cache(cache: torch.Tensor, *, name: str = "key_cache") -> torch.Tensor:
    """One K or V tensor of a ``StaticCache`` layer, ``[batch, heads, max_len, head_dim]``, as
    ``[batch, max_len, heads, head_dim]``: slot = batch_index * max_len + position."""
    if cache.dim() != 4:
        raise ValueError(f"kv-canary: {name} is [batch, heads, max_len, head_dim], got shape {tuple(cache.shape)}")
    return cache.transpose(1, 2)


def hf_static_cache_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-head scales beside a `hf_static_cache` tensor, ``[batch, heads, max_len]``, as
    ``[batch, max_len, heads]``."""
    return scales.transpose(1, 2)


# --- TensorRT-LLM ------------------------------------------------------------------------


def trtllm_block_pool(pool: torch.Tensor) -> KvViews:
    """A TensorRT-LLM style block pool ``[num_blocks, 2, heads, tokens_per_block, head_dim]``
    (K at 0, V at 1 of dim 1) as K and V ``[num_blocks, tokens_per_block, heads, head_dim]``:
    slot = block * tokens_per_block + offset."""
    if pool.dim() != 5 or pool.shape[1] != 2:
        raise ValueError(f"kv-canary: a block pool is [num_blocks, 2, heads, tokens_per_block, head_dim], got shape {tuple(pool.shape)}")
    return _trtllm_by_slot(pool)


def trtllm_scale_pool(pool: torch.Tensor) -> KvViews:
    """Per-head scales beside a `trtllm_block_pool`, ``[num_blocks, 2, heads, tokens_per_block]``,
    as K and V scales ``[num_blocks, tokens_per_block, heads]``."""
    return _trtllm_by_slot(pool)


def _trtllm_by_slot(pool: torch.Tensor) -> KvViews:
    return KvViews(pool[:, 0].transpose(1, 2), pool[:, 1].transpose(1, 2))
