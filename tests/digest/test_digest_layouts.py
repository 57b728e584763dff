"""Unit ids for real caches: one request's KV (K, V and fp32 scales per token and head) laid
out in each engine's layout, split over tensor-parallel ranks, gives the digest that the
plain-int transcription of docs/spec.md computes from the logical tensors, with the ids written
out here: layer * 4 * num_kv_heads + kind * num_kv_heads + head (K, V, K scale, V scale)."""

from __future__ import annotations

import pytest
import spec_oracle as oracle
import torch
from helpers import random_bytes

import torch_kvcanary as kc
from torch_kvcanary import digest as units

LAYERS, HEADS, DIM, TOKENS = 2, 4, 16, 11
POSITIONS = torch.arange(5, 5 + TOKENS)  # a request whose first 5 positions were sent earlier


@pytest.fixture(scope="module")
def request_kv():
    """Logical tensors per layer: K and V [TOKENS, HEADS, DIM] bf16, scales [TOKENS, HEADS] fp32."""
    gen = torch.Generator().manual_seed(0)
    kinds = [[random_bytes([TOKENS, HEADS, DIM], torch.bfloat16, gen) for _ in range(LAYERS)] for _ in range(2)]
    scales = [[random_bytes([TOKENS, HEADS], torch.float32, gen) for _ in range(LAYERS)] for _ in range(2)]
    return kinds[0], kinds[1], scales[0], scales[1]


def logical_digest(k, v, k_scales=None, v_scales=None) -> int:
    views, offsets = [], []
    for kind, layers in enumerate([k, v, k_scales, v_scales]):
        for layer, t in enumerate(layers or []):
            views.append(t.unsqueeze(1))  # [TOKENS, 1, HEADS, ...]: slot = token index
            offsets.append(layer * 4 * HEADS + kind * HEADS)
    return oracle.digest(views, torch.arange(TOKENS), POSITIONS, offsets)[0]


def digest_of(u: units.DigestUnits, slots: torch.Tensor) -> int:
    return kc.kv_digest(u.views, slots, POSITIONS, unit_offsets=u.unit_offsets).item()


def group_digest(per_rank) -> int:
    return torch.tensor(per_rank, dtype=torch.int64).sum().item()  # all_reduce(SUM): wrapping


def shuffled_slots(capacity: int, seed: int) -> torch.Tensor:
    return torch.randperm(capacity, generator=torch.Generator().manual_seed(seed))[:TOKENS]


def rank_heads(rank: int, tp: int) -> slice:
    local = HEADS // tp
    return slice(rank * local, (rank + 1) * local)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sglang_mha_rows(request_kv, tp):
    k, v, ks, vs = request_kv
    slots = shuffled_slots(40, seed=tp)
    per_rank = []
    for rank in range(tp):
        h = rank_heads(rank, tp)
        pools = []
        for layers in (k, v, ks, vs):
            rows = [torch.zeros(40, *t[:, h].shape[1:], dtype=t.dtype) for t in layers]
            for row, t in zip(rows, layers):
                row[slots] = t[:, h]
            pools.append(rows)
        u = units.sglang_mha_units(pools[0], pools[1], k_scales=pools[2], v_scales=pools[3], tp_rank=rank, tp_size=tp)
        per_rank.append(digest_of(u, slots))
    assert group_digest(per_rank) == logical_digest(k, v, ks, vs)


def paged(t: torch.Tensor, block_table: list[int], num_blocks: int, block_size: int) -> torch.Tensor:
    """[num_blocks, block_size, ...] holding the request's tokens in the blocks of block_table."""
    out = torch.zeros(num_blocks, block_size, *t.shape[1:], dtype=t.dtype)
    for i in range(t.shape[0]):
        out[block_table[i // block_size], i % block_size] = t[i]
    return out


def paged_slots(block_table: list[int], block_size: int) -> torch.Tensor:
    return torch.tensor([block_table[i // block_size] * block_size + i % block_size for i in range(TOKENS)])


def check_rank_digests(request_kv, tp: int, rank_units) -> None:
    """The request in blocks [6, 1, 3] of 4 slots (of 8 blocks) on each of ``tp`` ranks: the
    ranks' digests of their units, ``rank_units(rank, heads, k_scales, v_scales, table,
    block_size)`` over its paged scales, make the request's logical digest."""
    _, _, ks, vs = request_kv
    table, block_size = [6, 1, 3], 4
    per_rank = []
    for rank in range(tp):
        h = rank_heads(rank, tp)
        k_sc = [paged(ks[layer][:, h], table, 8, block_size) for layer in range(LAYERS)]
        v_sc = [paged(vs[layer][:, h], table, 8, block_size) for layer in range(LAYERS)]
        per_rank.append(digest_of(rank_units(rank, h, k_sc, v_sc, table, block_size), paged_slots(table, block_size)))
    assert group_digest(per_rank) == logical_digest(*request_kv)


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_blocks(request_kv, tp):
    k, v, _, _ = request_kv

    def rank_units(rank, h, k_sc, v_sc, table, block_size):
        caches = [
            torch.stack([paged(k[layer][:, h], table, 8, block_size), paged(v[layer][:, h], table, 8, block_size)])
            for layer in range(LAYERS)
        ]
        return units.vllm_units(caches, k_scales=k_sc, v_scales=v_sc, tp_rank=rank, tp_size=tp)

    check_rank_digests(request_kv, tp, rank_units)


def packed_layer(k_layer, v_layer, table, num_blocks, block_size, order) -> torch.Tensor:
    """A packed vLLM layer, the logical [blocks, H, block_size, 2 * DIM] with K then V in the
    content axis, its axes stored outermost to innermost in ``order``."""
    content = torch.cat([paged(k_layer, table, num_blocks, block_size), paged(v_layer, table, num_blocks, block_size)], dim=-1)
    logical = content.transpose(1, 2)
    return logical.permute(order).contiguous().permute([order.index(axis) for axis in range(4)])


@pytest.mark.parametrize("layout", sorted(kc.layouts.VLLM_LAYOUTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_packed_layouts(request_kv, layout, tp):
    k, v, _, _ = request_kv
    order = kc.layouts.VLLM_LAYOUTS[layout]

    def rank_units(rank, h, k_sc, v_sc, table, block_size):
        caches = [packed_layer(k[layer][:, h], v[layer][:, h], table, 8, block_size, order) for layer in range(LAYERS)]
        return units.vllm_units(caches, layout=layout, backend="FLASH_ATTN", k_scales=k_sc, v_scales=v_sc, tp_rank=rank, tp_size=tp)

    check_rank_digests(request_kv, tp, rank_units)


def test_vllm_cpu_layout(request_kv):
    """CPU_ATTN's layer [num_blocks, heads, block_size, 2 * head_size] read as vLLM's
    forward reads it: each block-head a [2 * block_size, head_size] of K rows, then V rows.
    (The kernel packs a block's tokens inside those planes: tests/vllm_plugin/adapter/test_vllm_layouts.py.)"""
    k, v, _, _ = request_kv
    table, block_size = [2, 0], 8
    caches = []
    for layer in range(LAYERS):
        planes = [paged(t[layer], table, 3, block_size).transpose(1, 2) for t in (k, v)]  # [blocks, H, bs, D] each
        caches.append(torch.cat(planes, dim=2).view(3, HEADS, block_size, 2 * DIM))  # [blocks, H, 2 * bs, D] as vLLM's layer
    u = units.vllm_units(caches, layout="LBHNC", backend="CPU_ATTN")
    # zero-copy: every view is a view of its layer's cache
    assert [view.untyped_storage().data_ptr() for view in u.views] == [c.untyped_storage().data_ptr() for c in caches] * 2
    assert digest_of(u, paged_slots(table, block_size)) == logical_digest(k, v)


@pytest.mark.parametrize(
    ("layout", "backend", "shape"),
    [("NHD", None, (2, 4, 8, 2, 16)), ("HND", None, (2, 4, 2, 8, 16))]
    + [(layout, backend, (4, 2, 8, 32)) for layout in ("LBHNC", "HND") for backend in ("FLASH_ATTN", "CPU_ATTN")],
)
def test_vllm_units_read_what_layouts_vllm_reads(layout, backend, shape):
    """The digest's K and V views of a vLLM layer are the views `layouts.vllm` folds."""
    kv = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).view(shape)
    if layout == "HND" and len(shape) == 5:
        kv = kv.transpose(2, 3)  # [2, blocks, block_size, heads, dim] stored heads before tokens
    sources = kc.layouts.vllm(kv, layout=layout, backend=backend)
    u = units.vllm_units([kv], layout=layout, backend=backend)
    for source, view in zip(sources, u.views, strict=True):
        assert (source.as_view().data_ptr(), source.as_view().stride()) == (view.data_ptr(), view.stride())
        assert torch.equal(source.as_view(), view)


def test_hf_static_cache(request_kv):
    k, v, _, _ = request_kv
    batch, max_len, row = 3, 16, 1
    keys, values = [], []
    for layer in range(LAYERS):
        for dest, src in ((keys, k[layer]), (values, v[layer])):
            cache = torch.zeros(batch, HEADS, max_len, DIM, dtype=torch.bfloat16)
            cache[row, :, POSITIONS] = src.transpose(0, 1)
            dest.append(cache)
    u = units.hf_static_cache_units(keys, values)
    slots = kc.layouts.hf_static_cache_slots(row, POSITIONS, max_len)
    assert digest_of(u, slots) == logical_digest(k, v)


@pytest.mark.parametrize("tp", [1, 4])
def test_trtllm_pool(request_kv, tp):
    k, v, ks, vs = request_kv
    table, tokens_per_block = [4, 2], 8
    per_rank = []
    for rank in range(tp):
        h = rank_heads(rank, tp)
        pools, scale_pools = [], []
        for layer in range(LAYERS):
            kv = torch.stack([paged(k[layer][:, h], table, 5, tokens_per_block), paged(v[layer][:, h], table, 5, tokens_per_block)], dim=1)
            pools.append(kv.permute(0, 1, 3, 2, 4).contiguous())  # [blocks, 2, heads, tpb, dim]
            sc = torch.stack(
                [paged(ks[layer][:, h], table, 5, tokens_per_block), paged(vs[layer][:, h], table, 5, tokens_per_block)], dim=1
            )
            scale_pools.append(sc.permute(0, 1, 3, 2).contiguous())  # [blocks, 2, heads, tpb]
        u = units.trtllm_units(pools, scale_pools=scale_pools, tp_rank=rank, tp_size=tp)
        per_rank.append(digest_of(u, paged_slots(table, tokens_per_block)))
    assert group_digest(per_rank) == logical_digest(k, v, ks, vs)


def test_replicated_heads_count_once(request_kv):
    """Two KV heads on four ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1; the
    group's sum counts each head once."""
    k, v, _, _ = request_kv
    k2, v2 = [t[:, :2] for t in k], [t[:, :2] for t in v]
    slots = torch.arange(TOKENS)
    per_rank = []
    for rank in range(4):
        head = rank // 2
        u = units.sglang_mha_units(
            [t[:, head : head + 1] for t in k2], [t[:, head : head + 1] for t in v2], tp_rank=rank, tp_size=4, num_kv_heads=2
        )
        per_rank.append(digest_of(u, slots))  # a replica rank has no views: 0
    views, offsets = [], []
    for kind, layers in enumerate([k2, v2]):
        for layer, t in enumerate(layers):
            views.append(t.unsqueeze(1))
            offsets.append(layer * 4 * 2 + kind * 2)
    assert group_digest(per_rank) == oracle.digest(views, slots, POSITIONS, offsets)[0]


def test_sglang_mla_latent_is_counted_once():
    gen = torch.Generator().manual_seed(3)
    latent = [random_bytes([20, 1, 48], torch.float8_e4m3fn, gen) for _ in range(LAYERS)]
    scales = [random_bytes([20, 1], torch.float32, gen) for _ in range(LAYERS)]
    slots = shuffled_slots(20, seed=9)
    per_rank = []
    for rank in range(2):  # the latent is replicated on both ranks
        u = units.sglang_mla_units(latent, scales=scales, tp_rank=rank, tp_size=2)
        per_rank.append(digest_of(u, slots))  # a replica rank has no views: 0
    views = [t.unsqueeze(1) for t in latent] + [t.unsqueeze(1) for t in scales]
    offsets = [layer * 2 for layer in range(LAYERS)] + [layer * 2 + 1 for layer in range(LAYERS)]
    assert group_digest(per_rank) == oracle.digest(views, slots, POSITIONS, offsets)[0]


def test_first_layer_and_ids():
    assert units.unit_id(3, units.V, 5, num_kv_heads=8) == 3 * 32 + 8 + 5
    assert units.first_global_head(2, tp_rank=3, tp_size=4) == 6
    assert units.first_global_head(1, tp_rank=3, tp_size=4, num_kv_heads=2) is None
    assert units.first_global_head(1, tp_rank=2, tp_size=4, num_kv_heads=2) == 1
    k = [torch.zeros(4, 2, 16, dtype=torch.bfloat16)]
    assert units.sglang_mha_units(k, k, first_layer=7).unit_offsets == [7 * 8, 7 * 8 + 2]
