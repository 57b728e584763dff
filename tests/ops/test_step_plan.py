"""kvcanary::step_plan (torch_kvcanary.paged_step.step_plan): the host's plan of a paged serving step,
equal set by set to its contract (the schema in csrc/ops.cpp) transcribed row by row in
plain Python, on random steps and on hand-checked ones; refusals (opcheck: test_op_contracts.py). Host work: CPU tensors
only, whatever device the step runs on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_kvcanary import paged_step

RECORD_ORDER = 3


def expected_sets(computed, scheduled, firsts, block_size, packed):
    """Each set's entries, transcribed from the schema row by row: a range set as one list
    of positions per row, the record order as its list of values."""
    rows = range(len(computed))
    block_of = lambda p: p // block_size  # noqa: E731
    written = [list(range(computed[i], computed[i] + scheduled[i])) for i in rows]
    # The rest of the block holding the last position before the step, that it does not write.
    tail = [
        [p for p in range(computed[i], computed[i] + block_size) if block_of(p) == block_of(computed[i] - 1) and p not in written[i]]
        if packed and computed[i]
        else []
        for i in rows
    ]
    # Every position of each block the step writes a position of.
    blocks_written = [
        [p for p in range(0, computed[i] + scheduled[i] + block_size) if block_of(p) in {block_of(q) for q in written[i]}] if packed else []
        for i in rows
    ]
    token_index = iter(range(sum(scheduled)))
    tokens = [[next(token_index) for _ in range(scheduled[i])] for i in rows]
    order = sorted(rows, key=lambda i: computed[i])  # stable: ties keep the batch's order
    sets = [written, tail, blocks_written, sum((tokens[i] for i in order), [])]
    for first in firsts:
        sets.append([list(range(first[i], computed[i])) for i in rows])
    return sets


def is_index_set(k: int) -> bool:
    return k == RECORD_ORDER


def unpacked(planned: paged_step.StepPlan, num_rows: int) -> list:
    """Each set of ``planned`` as `expected_sets` writes it: a range set's offsets and starts
    expanded to positions, row by row."""
    plan = planned.plan.tolist()
    sets = []
    for k, (base, count) in enumerate(zip(planned.bases, planned.counts)):
        if is_index_set(k):
            sets.append(plan[base : base + count])
            continue
        offsets, starts = plan[base : base + num_rows + 1], plan[base + num_rows + 1 : base + 2 * num_rows + 1]
        assert offsets[0] == 0 and offsets[-1] == count, k
        sets.append([list(range(starts[i], starts[i] + offsets[i + 1] - offsets[i])) for i in range(num_rows)])
    return sets


def plan(computed, scheduled, firsts, block_size, packed) -> paged_step.StepPlan:
    def longs(values):
        return torch.tensor(values, dtype=torch.int64)

    return paged_step.step_plan(
        longs(computed), longs(scheduled), longs(firsts).reshape(len(firsts), len(computed)), block_size=block_size, blocks_packed=packed
    )


@pytest.mark.parametrize("seed", range(60))
def test_random_steps_equal_the_contract(seed):
    rng = np.random.default_rng(seed)
    num_rows, block_size, packed = int(rng.integers(0, 9)), int(rng.choice([1, 4, 16, 32])), bool(seed % 2)
    computed = rng.integers(0, 70, num_rows)
    if seed % 3 == 0:
        computed = np.sort(computed)
    scheduled = rng.integers(0, 20, num_rows) * (rng.random(num_rows) < 0.8)
    num_groups = int(rng.integers(0, 4))  # full attention, then windows
    firsts = np.zeros((num_groups, num_rows), dtype=np.int64)
    firsts[1:] = np.minimum(computed, rng.integers(0, 70, (max(num_groups - 1, 0), num_rows)))
    planned = paged_step.step_plan(
        torch.from_numpy(computed), torch.from_numpy(scheduled), torch.from_numpy(firsts), block_size=block_size, blocks_packed=packed
    )
    want = expected_sets(computed.tolist(), scheduled.tolist(), firsts.tolist(), block_size, packed)
    assert len(planned.counts) == len(planned.bases) == len(want) == paged_step.STEP_SETS + len(firsts)
    assert unpacked(planned, num_rows) == want
    assert planned.counts == [len(s) if is_index_set(k) else sum(map(len, s)) for k, s in enumerate(want)]
    assert planned.in_batch_order == bool((np.diff(computed) >= 0).all())
    assert planned.plan.dtype == torch.int64 and planned.plan.numel() == max(
        b + (c if is_index_set(k) else 2 * num_rows + 1) for k, (b, c) in enumerate(zip(planned.bases, planned.counts))
    )


def test_a_hand_checked_step():
    # Blocks of 4, packed. Row 0 decodes (5 in the cache, 1 scheduled), row 1 prefills a
    # chunk (2 in the cache, 7 scheduled), row 2 waits (3 in the cache, none scheduled);
    # one full-attention group, and one whose window starts at 4, 0 and 1.
    planned = plan([5, 2, 3], [1, 7, 0], [[0, 0, 0], [4, 0, 1]], 4, True)
    written, tail, blocks_written, order, context, window = unpacked(planned, 3)
    assert written == [[5], [2, 3, 4, 5, 6, 7, 8], []]
    assert tail == [[6, 7], [], [3]]  # the rest of each last block that the step does not write
    assert blocks_written == [[4, 5, 6, 7], list(range(12)), []]
    assert order == [1, 2, 3, 4, 5, 6, 7, 0]  # row 1 (2 computed) first, then row 0
    assert context == [[0, 1, 2, 3, 4], [0, 1], [0, 1, 2]]
    assert window == [[4], [0, 1], [1, 2]]
    assert not planned.in_batch_order


def test_without_packed_blocks_the_block_sets_are_empty():
    planned = plan([5, 9], [1, 1], [[0, 0]], 4, False)
    written, tail, blocks_written, order, context = unpacked(planned, 2)
    assert (written, tail, blocks_written) == ([[5], [9]], [[], []], [[], []])
    assert order == [0, 1] and context == [[0, 1, 2, 3, 4], list(range(9))] and planned.in_batch_order


def test_no_rows():
    planned = plan([], [], [[]], 16, True)
    assert planned.counts == [0] * 5 and planned.plan.tolist() == [0] * 4  # four range sets, offsets [0] each
    assert planned.in_batch_order


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(computed=torch.tensor([1, 2], dtype=torch.int32)), TypeError, "computed must be an int64 tensor"),
        (dict(scheduled=[1, 1]), TypeError, "scheduled must be an int64 tensor"),
        (dict(scheduled=torch.tensor([1, 1, 1])), ValueError, "scheduled must be 1-D with 2 entries"),
        (dict(firsts=torch.tensor([0, 0])), ValueError, r"firsts must be \[num_groups, 2\]"),
        (dict(firsts=torch.tensor([[0, 3]])), ValueError, r"firsts\[0, 1\] is 3; .* \[0, 2\]"),
        (dict(firsts=torch.tensor([[-1, 0]])), ValueError, r"firsts\[0, 0\] is -1"),
        (dict(computed=torch.tensor([4, -2])), ValueError, "row 1 has computed -2"),
        (dict(scheduled=torch.tensor([1 << 50, 1])), ValueError, r"row 0 has .* in \[0, 2\*\*48\)"),
        (dict(block_size=0), ValueError, r"block_size must be in \[1, 2\*\*48\)"),
        (dict(block_size=(1 << 63) - 1), ValueError, r"block_size must be in \[1, 2\*\*48\), got 9223372036854775807"),
        (dict(scheduled=torch.tensor([1 << 40, 1 << 40])), ValueError, r"the step's plan would hold \d+ values"),
        (
            dict(
                computed=torch.full((1 << 14,), (1 << 48) - 1),
                scheduled=torch.zeros(1 << 14, dtype=torch.int64),
                firsts=torch.zeros(1, 1 << 14, dtype=torch.int64),
            ),
            ValueError,
            r"the rows' tokens add up past 2\*\*62 by row 16383",
        ),
        (dict(computed=torch.tensor([[4, 2]])), ValueError, "computed must be 1-D"),
        (dict(computed=torch.tensor([4, 2], device="meta")), ValueError, "computed is on meta; the step's plan is host work"),
    ],
)
def test_refusals(change, error, message):
    args = dict(computed=torch.tensor([4, 2]), scheduled=torch.tensor([1, 1]), firsts=torch.tensor([[0, 0]]), block_size=4)
    args.update(change)
    with pytest.raises(error, match=f"^kv-canary: {message}"):
        paged_step.step_plan(args["computed"], args["scheduled"], args["firsts"], block_size=args["block_size"], blocks_packed=True)
