"""Pools past 4 GiB (int64 byte offsets everywhere) and concurrent callers."""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torch_kvcanary as kc

GIB = 1 << 30


def _fill(rows: torch.Tensor, gen: torch.Generator) -> None:
    rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen).view(rows.dtype))


def test_row_pool_past_4_gib():
    # 4.5 GiB allocated, never touched except the rows that are read.
    num_rows, row_bytes = (9 * GIB // 2) // 1024, 1024
    pool = torch.empty(num_rows, row_bytes, dtype=torch.uint8)
    slots = torch.tensor(
        [
            0,
            (1 << 31) // row_bytes - 1,
            (1 << 31) // row_bytes,
            (1 << 32) // row_bytes,
            (1 << 32) // row_bytes + 1,
            num_rows - 2,
            num_rows - 1,
            -1,
        ]
    )
    gen = torch.Generator().manual_seed(0)
    for slot in slots[slots >= 0].tolist():
        _fill(pool[slot], gen)
    source = kc.make_row_source(layer_buffer=pool, read_bytes=sys.maxsize)
    expected = kc.reference_fold(source, slots)
    assert torch.equal(kc.fold(source, slots), expected)
    assert torch.equal(kc.fold(source, slots.int()), expected)
    assert (expected[:-1] != 0).all()
    with pytest.raises(IndexError, match=f"^kv-canary: slot {num_rows} is out of range"):
        kc.fold(source, torch.tensor([num_rows]))


def test_paged_view_past_4_gib():
    # [pages, page_size, heads, dim] bf16 with the head dim strided: slots near the end.
    pages, page_size, heads, dim = (9 * GIB // 2) // (16 * 2 * 128 * 2), 16, 2, 128
    pool = torch.empty(pages, page_size, heads, dim, dtype=torch.bfloat16)
    view = pool[:, :, :, :64]
    capacity = pages * page_size
    slots = torch.tensor([capacity - 1, capacity - page_size, capacity // 2, 5, -3])
    gen = torch.Generator().manual_seed(1)
    for slot in slots[slots >= 0].tolist():
        _fill(pool[slot // page_size, slot % page_size].view(torch.uint8), gen)
    source = kc.view_source(view, read_bytes=sys.maxsize)
    assert torch.equal(kc.fold(source, slots), kc.reference_fold(source, slots))


def test_python_threads_share_sources():
    gen = torch.Generator().manual_seed(2)
    kv = torch.randint(0, 256, (2, 64, 16, 2, 32), dtype=torch.uint8, generator=gen)
    sources = [kc.view_source(kv[0], read_bytes=64), kc.view_source(kv[1], read_bytes=64)]
    batches = [torch.randint(-1, 1024, (500,), generator=gen) for _ in range(32)]
    expected = [kc.reference_fold(sources, b) for b in batches]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda b: kc.fold(sources, b), batches * 4))
    assert all(torch.equal(r, expected[i % len(batches)]) for i, r in enumerate(results))
