"""context_slots: the slots of one range of positions per row of a paged block table, equal to
a reference written here in plain Python (compiled and in CUDA graphs: test_op_contracts.py;
refused arguments: test_bad_input.py)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import DEVICES
from spec_oracle import context_slots as reference

from torch_kvcanary import paged_step


def call(table: torch.Tensor, lengths: list[int], starts: list[int], block_size: int, cut_slot: int = -1, starts_dtype=torch.int64):
    device = table.device
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device)
    found = paged_step.context_slots(
        table,
        offsets,
        torch.tensor(starts, dtype=starts_dtype, device=device),
        block_size=block_size,
        num_entries=sum(lengths),
        cut_slot=cut_slot,
    )
    assert all(t.dtype == torch.int64 and t.device == table.device for t in found)
    return [t.tolist() for t in found]


def random_table(rng: random.Random, rows: int, max_blocks: int, num_blocks: int) -> list[list[int]]:
    return [[rng.randrange(num_blocks) for _ in range(max_blocks)] for _ in range(rows)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("starts_dtype", [torch.int32, torch.int64])
def test_random_ranges_equal_the_reference(device, table_dtype, starts_dtype):
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        for _ in range(8):
            rows, max_blocks = rng.randrange(0, 9), rng.randrange(1, 12)
            table = random_table(rng, rows + rng.randrange(1, 3), max_blocks, 500)  # rows past R are not read
            capacity = max_blocks * block_size
            starts = [rng.randrange(capacity) for _ in range(rows)]
            lengths = [rng.choice([0, rng.randrange(capacity - s + 1)]) for s in starts]  # some rows empty
            cut = rng.choice([-1, 0, 7])
            got = call(torch.tensor(table, dtype=table_dtype, device=device), lengths, starts, block_size, cut, starts_dtype)
            assert got == reference(table, lengths, starts, block_size, cut)


@pytest.mark.parametrize("device", DEVICES)
def test_odd_cases(device):
    table = [[3, 5, 7], [1, 2, 9]]
    t = torch.tensor(table, dtype=torch.int32, device=device)
    assert call(t, [], [], 4) == [[], [], [], []]  # no rows
    assert call(t, [0, 0], [5, 0], 4) == [[], [], [], []]  # rows with no entries
    # position 0 anchors the chain even with a cut; a row starting past 0 takes the cut slot
    assert call(t, [3, 2], [0, 6], 4, cut_slot=0) == [[12, 13, 14, 10, 11], [0, 1, 2, 6, 7], [-1, 12, 13, 0, 10], [0, 0, 0, 1, 1]]
    # without a cut the chain reaches into the block before the range
    assert call(t, [1], [4], 4) == [[20], [4], [15], [0]]
    # the last position of the table; block_size 1
    assert call(t, [1], [11], 4) == reference(table, [1], [11], 4) == [[31], [11], [30], [0]]
    assert call(t, [2, 3], [1, 0], 1) == reference(table, [2, 3], [1, 0], 1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_table_view_with_strides(device):
    rng = random.Random(1)
    wide = torch.tensor(random_table(rng, 12, 10, 300), device=device)
    view = wide[::2, 1::3]  # rows and blocks both strided, no copy
    table = view.tolist()
    lengths, starts = [5, 0, 9, 12], [0, 3, 1, 0]
    assert call(view, lengths, starts, 4, cut_slot=2) == reference(table, lengths, starts, 4, cut_slot=2)


def test_many_entries_on_several_threads():
    rng = random.Random(2)
    table = random_table(rng, 64, 40, 4000)
    starts = [rng.randrange(100) for _ in range(64)]
    lengths = [40 * 16 - s - rng.randrange(100) for s in starts]  # more entries than one thread's share
    assert sum(lengths) > 20000
    assert call(torch.tensor(table, dtype=torch.int32), lengths, starts, 16, 0) == reference(table, lengths, starts, 16, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_unchecked_ranges_read_nothing_out_of_bounds(device):
    table = torch.tensor([[3, 5], [1, 2]], device=device)
    offsets = torch.tensor([0, 3, 5], device=device)

    def unchecked(starts, offsets=offsets, num_entries=5):
        found = paged_step.context_slots(
            table, offsets, torch.tensor(starts, device=device), block_size=4, num_entries=num_entries, check_bounds=False
        )
        return [t.tolist() for t in found]

    # row 0 runs past its 2 blocks at position 8; row 1 starts below 0
    slots, positions, prev_slots, rows = unchecked([6, -1])
    assert slots == [22, 23, -1, -1, 4] and prev_slots == [21, 22, -1, -1, -1]
    assert positions == [6, 7, 8, -1, 0] and rows == [0, 0, 0, 1, 1]
    # offsets ending short of num_entries: the entries past them belong to no row
    slots, positions, prev_slots, rows = unchecked([0, 0], offsets=torch.tensor([0, 1, 2], device=device))
    assert slots == [12, 4, -1, -1, -1] and rows == [0, 1, -1, -1, -1] and positions == [0, 0, -1, -1, -1]
