"""`digest.kv_digest_by_head`, the per-slot, per-KV-head transfer digest that the two sides of
a prefill/decode transfer compare: on vLLM's CPU_ATTN caches (LBHNC, blocks packed by the
kernel), split over ranks in other ways on each side, it gives equal digests where the bytes
landed equal, and each column is the plain-int transcription of docs/spec.md's digest of
that head's K and V with the unit ids written out here. No vLLM is needed."""

from __future__ import annotations

import spec_oracle as oracle
import torch

from torch_kvcanary import digest

BLOCK_SIZE, HEAD_SIZE = 16, 8


def _cpu_attn_cache(blocks: int, heads: int, generator) -> torch.Tensor:
    """A CPU_ATTN layer as vLLM allocates it in the LBHNC layout: [blocks, heads, block_size, 2 * head_size]."""
    return torch.randn(blocks, heads, BLOCK_SIZE, 2 * HEAD_SIZE, generator=generator)


def _slots(blocks: list[int], count: int) -> torch.Tensor:
    """The slots of a request's first ``count`` positions in its blocks ``blocks``."""
    return torch.tensor([blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE for position in range(count)])


def _heads(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global heads of rank ``rank`` of ``tp_size`` where each holds as many (no replicas)."""
    per_rank = num_kv_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def _digests(caches, blocks, heads, *, tokens, num_kv_heads, start=0):
    views = [digest.vllm_head_views(cache, "CPU_ATTN", "LBHNC") for cache in caches]
    positions = torch.arange(start, start + tokens)
    return digest.kv_digest_by_head(views, _slots(blocks, tokens), heads, num_kv_heads=num_kv_heads, mla=False, positions=positions)


def test_head_digests_do_not_depend_on_how_the_ranks_split_the_heads():
    """P (one rank, four heads) and D (two ranks, two heads each, other blocks): each D
    rank's digest of a head equals P's where it landed byte for byte, whatever the blocks;
    a flipped byte changes its head's digest of the slots reading it, and no other."""
    generator = torch.Generator().manual_seed(0)
    layers, heads, tokens = 3, 4, 40
    prefill = [_cpu_attn_cache(6, heads, generator) for _ in range(layers)]
    p_blocks, d_blocks = [4, 1, 5], [2, 0, 3]
    decode = [[torch.zeros(4, 2, BLOCK_SIZE, 2 * HEAD_SIZE) for _ in range(layers)] for _ in range(2)]
    for rank in range(2):
        for p_cache, d_cache in zip(prefill, decode[rank]):
            d_cache[d_blocks] = p_cache[p_blocks, 2 * rank : 2 * rank + 2]  # NIXL's read of the rank's heads

    def digests(caches, blocks, tp_size, rank):
        return _digests(caches, blocks, _heads(rank, tp_size, heads), tokens=tokens, num_kv_heads=heads)

    theirs = digests(prefill, p_blocks, 1, 0)
    mine = [digests(decode[rank], d_blocks, 2, rank) for rank in range(2)]
    assert torch.equal(torch.cat(mine, dim=1), theirs)
    assert len(set(theirs.flatten().tolist())) == theirs.numel()  # each slot and head digests apart
    # Positions are part of the digest: the same slots read from position 1 on digest apart.
    shifted = _digests(prefill, p_blocks, range(4), tokens=tokens, num_kv_heads=heads, start=1)
    assert not torch.equal(shifted, theirs)
    # A flip in layer 2's V of global head 3 (D rank 1's local head 1), in the block of positions 16-31.
    decode[1][2].view(torch.int32)[d_blocks[1], 1, 5, HEAD_SIZE + 2] ^= 1 << 20
    flipped = digests(decode[1], d_blocks, 2, 1)
    differs = (flipped != theirs[:, 2:]).nonzero().tolist()
    assert differs and {head for _, head in differs} == {1}
    assert {position // BLOCK_SIZE for position, _ in differs} == {1}


def test_each_column_is_the_specs_digest_of_its_head():
    """Rank 1 of 2 (global heads 2 and 3 of 4): column ``h`` is the spec's digest of slot by
    slot over the head's K and V in every layer, unit ``layer * 4 * heads + kind * heads +
    global head`` (K = 0, V = 1), from position ``start`` on."""
    generator = torch.Generator().manual_seed(1)
    layers, heads, tokens, start = 2, 4, 21, 3
    caches = [_cpu_attn_cache(3, 2, generator) for _ in range(layers)]
    blocks = [2, 0]
    got = _digests(caches, blocks, range(2, 4), tokens=tokens, num_kv_heads=heads, start=start)
    slots = _slots(blocks, tokens)
    positions = torch.arange(start, start + tokens)
    for local, head in enumerate(range(2, 4)):
        views, offsets = [], []
        for layer, cache in enumerate(caches):
            for kind, view in digest.vllm_head_views(cache, "CPU_ATTN", "LBHNC"):
                views.append(view[:, :, local : local + 1])
                offsets.append(layer * 4 * heads + kind * heads + head)
        expected = oracle.digest(views, slots, positions, offsets, groups=torch.arange(tokens), num_groups=tokens)
        assert got[:, local].tolist() == expected


def test_head_digests_built_once_read_the_caches_as_they_are_at_each_call():
    """`digest.HeadDigests`, built once over a rank's caches: each call equals
    `kv_digest_by_head` of the caches as they are then (its views are the caches' own
    memory: a byte changed after it was built changes its head's digest), whatever slots
    and positions a call gives."""
    generator = torch.Generator().manual_seed(2)
    layers, heads, tokens = 3, 4, 40
    caches = [_cpu_attn_cache(4, 2, generator) for _ in range(layers)]
    views = [digest.vllm_head_views(cache, "CPU_ATTN", "LBHNC") for cache in caches]
    built = digest.HeadDigests(views, range(2, 4), num_kv_heads=heads, mla=False)
    for blocks, start in (([2, 0, 3], 0), ([1, 3, 0], 5)):
        slots, positions = _slots(blocks, tokens)[start:], torch.arange(start, tokens)
        fresh = digest.kv_digest_by_head(views, slots, range(2, 4), num_kv_heads=heads, mla=False, positions=positions)
        assert torch.equal(built(slots, positions=positions), fresh)
    before = built(slots, positions=positions)
    # Local head 1 (global 3) of the block of positions 0-15: CPU_ATTN packs a block-head's
    # 16 K rows of 8 elements, then its V rows; element 12 * 16 + 2 is V of position 8 (row 3).
    caches[1].view(torch.int32)[blocks[0], 1, 12, 2] ^= 1 << 7
    assert (built(slots, positions=positions) != before).nonzero().tolist() == [[8 - start, 1]]
