"""KV transfer digests (docs/spec.md, "Digest"): one int64 per request or chunk that
does not depend on how the cache is sharded, paged or split into calls.

`kv_digest` is the entry point of ``torch.ops.kvcanary.digest``. The ``*_units`` helpers
give ``(views, unit_offsets)`` for a layer stack of a real engine's cache (read as `engines`
describes it), numbering the units the same way on every rank and layout:

    id = layer * units_per_layer + kind * num_kv_heads + global_head

with kinds K = 0 and V = 1, then the scale sidecars K_SCALE = 2 and V_SCALE = 3 (MHA;
``units_per_layer = 4 * num_kv_heads`` whether or not a cache has scales), or LATENT = 0
and LATENT_SCALE = 1 (MLA, one head). A tensor-parallel rank's global head is
``tp_rank * local_heads + local_head``; where heads are replicated (fewer KV heads than
ranks, or MLA's latent) only the first replica's rank contributes, so the
``all_reduce(SUM)`` of a group's digests counts each unit once.

`kv_digest_by_head` gives one digest per slot and KV head instead, numbered by global head,
so that two sides of a transfer sharded differently compare head by head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import engines
from .ops import check_index_dtype, integer_view, may_check_bounds, refusal

K, V, K_SCALE, V_SCALE = range(4)
MHA_KINDS = 4
LATENT, LATENT_SCALE = range(2)
MLA_KINDS = 2


def _index_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kv-canary: {name} must be an int32 or int64 tensor, got {type(value).__name__}")
    return value


def kv_digest(
    views: Sequence[torch.Tensor],
    slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    unit_offsets: Sequence[int],
    groups: torch.Tensor | None = None,
    num_groups: int = 1,
    check_bounds: bool = True,
) -> torch.Tensor:
    """The digest of the entries ``(slots[i], positions[i], groups[i])`` over ``views``.

    Args:
        views: tensors ``[num_pages, page_size, units, *unit_shape]`` of any dtype and
            strides on one device (a unit's innermost dim contiguous, its bytes a multiple
            of 4); slot ``s`` of view ``j`` is ``views[j][s // page_size, s % page_size]``.
        slots: int32 or int64 tensor; negative slots are padding and add nothing.
        positions: int32 or int64 tensor shaped like ``slots``: each entry's token position.
        unit_offsets: ``unit_offsets[j]`` is the global id of view ``j``'s unit 0.
        groups: int32 or int64 tensor shaped like ``slots`` with values in
            ``[0, num_groups)`` (a request of a batch, a chunk of a transfer); None sends
            every entry to group 0.
        num_groups: the length of the result.
        check_bounds: False skips the range check (for slots in range by construction, such
            as an engine's own block ids, where the check's host sync would cost more than
            it guards).

    Returns:
        int64 ``[num_groups]``: for each group, the wrapping sum over its entries and every
        unit of every view of ``mix3(unit id, position, unit fold)``. Digests of disjoint
        parts (ranks, pages, chunks, calls) add up, wrapping, to the digest of the whole.

    Slots past the smallest view capacity and groups out of range raise IndexError (on
    CUDA the check syncs with the host, so under torch.compile and CUDA-graph capture, or
    with ``check_bounds`` False, it is skipped and such entries add nothing); nothing is
    ever read outside a view.
    """
    views = None if isinstance(views, torch.Tensor) else list(views)
    if views is None or not all(isinstance(v, torch.Tensor) for v in views):
        raise TypeError("kv-canary: views must be a sequence of tensors [num_pages, page_size, units, *unit_shape]")
    slots = _index_tensor(slots, "slots")
    positions = _index_tensor(positions, "positions")
    if groups is not None:
        groups = _index_tensor(groups, "groups")
    offsets = [int(u) for u in unit_offsets]
    return _digest([integer_view(v) for v in views], slots, positions, groups, offsets, num_groups, check_bounds)


def _digest(views, slots, positions, groups, offsets, num_groups, check_bounds) -> torch.Tensor:
    """``torch.ops.kvcanary.digest`` over integer views, its refusals as ``kv-canary:`` errors."""
    try:
        return torch.ops.kvcanary.digest(views, slots, positions, groups, offsets, num_groups, check_bounds and may_check_bounds(slots))
    except (ValueError, RuntimeError) as error:
        raise refusal(error, {"slots": slots, "positions": positions, "groups": groups}) from None


@torch.library.register_fake("kvcanary::digest")
def _digest_fake(views, slots, positions, groups, unit_offsets, num_groups, check_bounds=True):
    # The checks of make_digest_plan (csrc/plan/digest_plan.cpp) that need no data nor guards
    # on symbolic sizes, with its messages; mixed devices reach this kernel when one is meta.
    entries = {"slots": slots, "positions": positions, "groups": groups}
    for name, value in entries.items():
        if value is not None:
            check_index_dtype(value, name)
    if len(views) != len(unit_offsets):
        raise ValueError(
            f"kv-canary: got {len(views)} digest views but {len(unit_offsets)} unit_offsets; pass one unit offset (the global id of its unit 0) per view"
        )
    for name, value in [(f"digest view {i}", v) for i, v in enumerate(views)] + [("positions", positions), ("groups", groups)]:
        if value is not None and value.device != slots.device:
            raise ValueError(f"kv-canary: {name} is on {value.device} but slots are on {slots.device}; put them on one device")
    for index, view in enumerate(views):
        if view.dim() < 3:
            raise ValueError(
                f"kv-canary: digest view {index} must be [num_pages, page_size, units, *unit_shape], got shape {list(view.shape)}"
            )
    return slots.new_empty((num_groups,), dtype=torch.int64)


# --- unit ids for real caches ---------------------------------------------------------------


class DigestUnits(NamedTuple):
    """The views of a layer stack and the global id of each view's unit 0, ready for
    ``kv_digest(units.views, slots, positions, unit_offsets=units.unit_offsets)``."""

    views: list[torch.Tensor]
    unit_offsets: list[int]

    def __add__(self, other: DigestUnits) -> DigestUnits:  # type: ignore[override]
        return DigestUnits(self.views + other.views, self.unit_offsets + other.unit_offsets)


def unit_id(layer: int, kind: int, head: int, *, num_kv_heads: int, kinds: int = MHA_KINDS) -> int:
    """The global id of ``head`` of unit ``kind`` in ``layer`` (module docstring)."""
    return (layer * kinds + kind) * num_kv_heads + head


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"kv-canary: tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")


def first_global_head(local_heads: int, *, tp_rank: int, tp_size: int, num_kv_heads: int | None = None) -> int | None:
    """The global index of a rank's local head 0, or None when the rank holds replicas
    that another rank already contributes. ``num_kv_heads`` defaults to
    ``local_heads * tp_size`` (heads split evenly)."""
    _check_rank(tp_rank, tp_size)
    num_kv_heads = local_heads * tp_size if num_kv_heads is None else num_kv_heads
    if local_heads * tp_size == num_kv_heads:
        return tp_rank * local_heads
    if local_heads == 1 and num_kv_heads < tp_size and tp_size % num_kv_heads == 0:
        replicas = tp_size // num_kv_heads
        return tp_rank // replicas if tp_rank % replicas == 0 else None
    raise ValueError(
        f"kv-canary: {local_heads} local KV heads on each of {tp_size} ranks do not split {num_kv_heads} KV heads "
        "(split evenly, or one replicated head per rank)"
    )


def _layer_list(tensors, name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"kv-canary: {name} must be a sequence of per-layer tensors, got a tensor")
    return list(tensors)


def _mha_units(
    k_views: list[torch.Tensor],
    v_views: list[torch.Tensor],
    k_scales: list[torch.Tensor] | None,
    v_scales: list[torch.Tensor] | None,
    *,
    tp_rank: int,
    tp_size: int,
    num_kv_heads: int | None,
    first_layer: int,
) -> DigestUnits:
    """Per layer K and V views ``[P, S, local_heads, head_dim]`` and optional scale views
    ``[P, S, local_heads]``, numbered per the module docstring."""
    if len(k_views) != len(v_views):
        raise ValueError(f"kv-canary: got {len(k_views)} K layers but {len(v_views)} V layers")
    per_kind = [(K, k_views), (V, v_views)]
    for kind, scales in ((K_SCALE, k_scales), (V_SCALE, v_scales)):
        if scales is not None:
            if len(scales) != len(k_views):
                raise ValueError(f"kv-canary: got {len(scales)} scale layers for {len(k_views)} layers")
            per_kind.append((kind, scales))
    units = DigestUnits([], [])
    if not k_views:
        return units
    local_heads = k_views[0].shape[2]
    heads = local_heads * tp_size if num_kv_heads is None else num_kv_heads
    first = first_global_head(local_heads, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=heads)
    if first is None:
        return units
    for kind, views in per_kind:
        for layer, view in enumerate(views):
            if view.shape[2] != local_heads:
                raise ValueError(f"kv-canary: layer {layer} has {view.shape[2]} local heads, layer 0 has {local_heads}")
            units.views.append(view)
            units.unit_offsets.append(unit_id(first_layer + layer, kind, first, num_kv_heads=heads))
    return units


def _mapped(tensors, transform, name: str) -> list[torch.Tensor] | None:
    return None if tensors is None else [transform(t) for t in _layer_list(tensors, name)]


def _each_mapped(arguments: dict[str, tuple]) -> list[list[torch.Tensor] | None]:
    """`_mapped` of each argument, by name: (its per-layer tensors or None, the transform of each)."""
    return [_mapped(tensors, transform, name) for name, (tensors, transform) in arguments.items()]


def sglang_mha_units(
    k_buffers, v_buffers, *, k_scales=None, v_scales=None, tp_rank=0, tp_size=1, num_kv_heads=None, first_layer=0
) -> DigestUnits:
    """SGLang MHA: per layer ``k_buffers[l]``/``v_buffers[l]`` ``[num_slots, local_heads, head_dim]``
    and optional fp32 scales ``[num_slots, local_heads]``; slot = the pool's slot index."""
    rows = engines.sglang_pool
    kv = {"k_buffers": (k_buffers, rows), "v_buffers": (v_buffers, rows), "k_scales": (k_scales, rows), "v_scales": (v_scales, rows)}
    return _mha_units(*_each_mapped(kv), tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, first_layer=first_layer)


def sglang_mla_units(kv_buffers, *, scales=None, tp_rank=0, tp_size=1, first_layer=0) -> DigestUnits:
    """SGLang MLA: per layer ``kv_buffers[l]`` ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``
    and optional fp32 scales ``[num_slots, 1]``. The latent is replicated on every
    tensor-parallel rank: only rank 0 contributes."""
    _check_rank(tp_rank, tp_size)
    units = DigestUnits([], [])
    if tp_rank != 0:
        return units
    for kind, name, tensors in ((LATENT, "kv_buffers", kv_buffers), (LATENT_SCALE, "scales", scales)):
        for layer, t in enumerate(_mapped(tensors, engines.sglang_pool, name) or []):
            units.views.append(t)
            units.unit_offsets.append(unit_id(first_layer + layer, kind, 0, num_kv_heads=1, kinds=MLA_KINDS))
    return units


def _vllm_layer(kv_cache: torch.Tensor, layout, backend: str | None) -> engines.KvViews:
    if layout is not None:
        return engines.vllm(kv_cache, layout=layout, backend=backend)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv-canary: a vLLM layer is [2, num_blocks, block_size, num_kv_heads, head_size], or pass layout= (and "
            f"backend= for a packed [num_blocks, num_kv_heads, block_size, C] layer), got shape {tuple(kv_cache.shape)}"
        )
    return engines.vllm_legacy(kv_cache)


def vllm_units(
    kv_caches, *, layout=None, backend=None, k_scales=None, v_scales=None, tp_rank=0, tp_size=1, num_kv_heads=None, first_layer=0
) -> DigestUnits:
    """vLLM: per layer the tensor vLLM binds to it (slot = block * block_size + offset) and
    optional fp32 scales ``[num_blocks, block_size, local_heads]``.

    ``layout`` and ``backend`` describe the layers as for `layouts.vllm` (`engines.vllm`):
    packed ``[num_blocks, local_heads, block_size, C]`` layers in any of vLLM's layouts, or
    legacy ``[2, num_blocks, block_size, local_heads, head_size]`` ones. Without ``layout`` a
    layer is the legacy tensor, whatever its strides. Under `engines.VLLM_BLOCK_PACKED_BACKENDS`
    (CPU_ATTN) a slot's units are rows of its block-head's K and V planes, which the kernel
    fills with the block's tokens packed together: a slot's units then hold bytes of other
    tokens of its block, so two such caches give the same digest where their blocks hold
    the same bytes (blocks copied whole between caches the same kernel packed).
    """
    layers = [_vllm_layer(cache, layout, backend) for cache in _layer_list(kv_caches, "kv_caches")]
    by_slot = lambda t: t  # noqa: E731  (the scales are [num_blocks, block_size, heads] already)
    return _mha_units(
        [kv.key for kv in layers], [kv.value for kv in layers], _mapped(k_scales, by_slot, "k_scales"), _mapped(v_scales, by_slot, "v_scales"),
        tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, first_layer=first_layer,
    )  # fmt: skip


def vllm_head_views(kv_cache: torch.Tensor, backend: str, layout: str) -> list[tuple[int, torch.Tensor]]:
    """The views of one vLLM layer's cache that `kv_digest_by_head` reads, each with its
    digest kind: MLA's latent, or K and V, ``[num_blocks, block_size, heads, ...]``."""
    if backend in engines.VLLM_MLA_BACKENDS:
        return [(LATENT, engines.vllm_mla(kv_cache))]
    kv = engines.vllm(kv_cache, layout=layout, backend=backend)
    return [(K, kv.key), (V, kv.value)]


def kv_digest_by_head(
    caches: list[list[tuple[int, torch.Tensor]]],
    slots: torch.Tensor,
    heads: range,
    *,
    num_kv_heads: int,
    mla: bool,
    positions: torch.Tensor,
    check_bounds: bool = True,
) -> torch.Tensor:
    """The transfer digest of each of ``slots``, which hold the positions ``positions``
    (int64, shaped like ``slots``, on their device) of the requests they belong to, over each
    KV head a rank holds (global heads ``heads`` of the model's ``num_kv_heads``; MLA's latent
    is head 0 of 1): int64 ``[len(slots), len(heads)]``. ``caches`` holds each cache's views
    (`vllm_head_views`: digest kind, ``[num_blocks, block_size, len(heads), ...]``). A head's
    column is `kv_digest` of its K and V (MLA: latent) in every cache, numbered by cache,
    kind and global head, so that it does not depend on how the ranks of either side of a
    transfer split the heads. ``check_bounds`` as `kv_digest`'s. (`HeadDigests` is the same
    for caches that stay put, built once.)"""
    return HeadDigests(caches, heads, num_kv_heads=num_kv_heads, mla=mla)(slots, positions=positions, check_bounds=check_bounds)


class HeadDigests:
    """`kv_digest_by_head` over caches that stay put: each head's views, as the digest reads
    them, and unit ids are built once, so that a call dispatches one digest per head and
    nothing per cache."""

    def __init__(self, caches: list[list[tuple[int, torch.Tensor]]], heads: range, *, num_kv_heads: int, mla: bool):
        local_heads = {view.shape[2] for views in caches for _, view in views}
        if local_heads != {len(heads)}:
            raise ValueError(f"kv-canary: this rank's caches hold {sorted(local_heads)} KV heads, not the {len(heads)} of {heads}")
        kinds = MLA_KINDS if mla else MHA_KINDS
        self._units = []  # per local head: (integer views, unit ids)
        for local, head in enumerate(heads):
            views, offsets = [], []
            for layer, cache_views in enumerate(caches):
                for kind, view in cache_views:
                    views.append(integer_view(view[:, :, local : local + 1]))
                    offsets.append(unit_id(layer, kind, head, num_kv_heads=num_kv_heads, kinds=kinds))
            self._units.append((views, offsets))

    def __call__(self, slots: torch.Tensor, *, positions: torch.Tensor, check_bounds: bool = True) -> torch.Tensor:
        slots = _index_tensor(slots, "slots")
        positions = _index_tensor(positions, "positions")
        groups = torch.arange(len(slots), device=slots.device)
        columns = [_digest(views, slots, positions, groups, offsets, len(slots), check_bounds) for views, offsets in self._units]
        return torch.stack(columns, dim=1)


def hf_static_cache_units(
    key_caches, value_caches, *, k_scales=None, v_scales=None, tp_rank=0, tp_size=1, num_kv_heads=None, first_layer=0
) -> DigestUnits:
    """Hugging Face ``StaticCache``: per layer ``[batch, local_heads, max_len, head_dim]``
    (slot = batch_index * max_len + position) and optional scales ``[batch, local_heads, max_len]``."""
    keys = lambda t: engines.hf_static_cache(t, name="each of key_caches")  # noqa: E731
    values = lambda t: engines.hf_static_cache(t, name="each of value_caches")  # noqa: E731
    scales = engines.hf_static_cache_scales
    kv = {
        "key_caches": (key_caches, keys),
        "value_caches": (value_caches, values),
        "k_scales": (k_scales, scales),
        "v_scales": (v_scales, scales),
    }
    return _mha_units(*_each_mapped(kv), tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, first_layer=first_layer)


def trtllm_units(pools, *, scale_pools=None, tp_rank=0, tp_size=1, num_kv_heads=None, first_layer=0) -> DigestUnits:
    """TensorRT-LLM block pools: per layer ``[num_blocks, 2, local_heads, tokens_per_block, head_dim]``
    (slot = block * tokens_per_block + offset) and optional fp32 scale pools
    ``[num_blocks, 2, local_heads, tokens_per_block]``."""
    layers = [engines.trtllm_block_pool(pool) for pool in _layer_list(pools, "pools")]
    scales = None if scale_pools is None else [engines.trtllm_scale_pool(s) for s in _layer_list(scale_pools, "scale_pools")]
    return _mha_units(
        [kv.key for kv in layers], [kv.value for kv in layers],
        None if scales is None else [kv.key for kv in scales], None if scales is None else [kv.value for kv in scales],
        tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=num_kv_heads, first_layer=first_layer,
    )  # fmt: skip
