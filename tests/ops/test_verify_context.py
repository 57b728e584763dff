"""KvCanary.verify_context (kvcanary::verify_context): a step's context verified in one call,
equal entry by entry to its contract transcribed in plain Python (spec_oracle.verify_context:
context_slots' entries, the choice of entries and tokens, then the spec's verify) on random
steps over a paged pool with shared, rewritten and damaged blocks; odd cases; refusals. The
PT2 contracts are in test_op_contracts.py."""

from __future__ import annotations

import random
import re

import pytest
import spec_oracle
import torch
from helpers import DEVICES

import torch_kvcanary as kc
from torch_kvcanary import layouts


class Pool:
    """A vLLM layer's paged K and V ([2, blocks, block_size, heads, dim]) under a canary and
    the spec's records, with a token history and one block table row per request."""

    def __init__(self, rng: random.Random, device: str, *, block_size: int, num_blocks: int, mode=kc.HashMode.ALL, padding=None):
        gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
        heads, dim = rng.choice([(1, 8), (2, 16)])
        self.kv = torch.randint(0, 256, (2, num_blocks, block_size, heads, dim * 2), dtype=torch.uint8, generator=gen).to(device)
        self.kv = self.kv.view(torch.bfloat16)
        self.canary = kc.KvCanary(
            layouts.vllm(self.kv, layout="NHD"), mode=mode, on_violation=None, padding_slot=padding, ring_capacity=1 << 15
        )
        self.oracle = spec_oracle.Records(self.canary.capacity)
        self.block_size, self.num_blocks, self.device, self.padding = block_size, num_blocks, device, padding

    def folds(self, slots: list[int]) -> list[int]:
        s = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return kc.reference_fold(list(self.canary.sources), s, mode=self.canary.mode).tolist()

    def record(self, blocks: list[int], tokens: list[int], length: int) -> None:
        """One request's positions 0 .. length - 1 through ``blocks``, chained, as one call."""
        slots, positions, prev, _ = spec_oracle.context_slots([blocks], [length], [0], self.block_size)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        self.canary.record(as_tensor(slots), positions=as_tensor(positions), tokens=as_tensor(tokens[:length]), prev_slots=as_tensor(prev))
        self.oracle.record(slots, self.folds(slots), positions=positions, tokens=tokens[:length], prev_slots=prev)

    def damage(self, slot: int, source_slot: int) -> None:
        """Copies another slot's K bytes over ``slot``'s."""
        b, o = divmod(slot, self.block_size)
        sb, so = divmod(source_slot, self.block_size)
        self.kv[0, b, o] = self.kv[0, sb, so]


def ring_rows(canary: kc.KvCanary) -> list[list[int]]:
    fields = ("slot", "position", "stored_token", "expected_token", "stored_chain", "expected_aux")
    return sorted([int(v.kind), *(getattr(v, f) for f in fields), int(v.reasons)] for v in canary.poll())


def call(pool: Pool, table, lengths, starts, *, table_dtype=torch.int32, history=None, known=None, history_rows=None, written=(), **kwargs):
    device = pool.device
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device)
    found = pool.canary.verify_context(
        torch.tensor(table, dtype=table_dtype, device=device).reshape(len(table), -1),
        offsets,
        torch.tensor(starts, dtype=torch.int64, device=device),
        block_size=pool.block_size,
        num_entries=sum(lengths),
        written=torch.tensor(sorted(written), dtype=torch.int64, device=device) if written is not None else None,
        history=None if history is None else torch.tensor(history, dtype=torch.int32, device=device),
        history_known=None if known is None else torch.tensor(known, dtype=torch.bool, device=device),
        history_rows=None if history_rows is None else torch.tensor(history_rows, dtype=torch.int32, device=device),
        **kwargs,
    )
    assert [t.dtype for t in found] == [torch.int64, torch.int64, torch.bool, torch.int64]
    assert all(t.device == pool.canary.device for t in found)
    return found.slots.tolist(), found.rows.tolist(), found.flagged.tolist(), found.waiting.item()


def expected(pool: Pool, table, lengths, starts, *, written=(), **kwargs):
    return spec_oracle.verify_context(
        pool.oracle, pool.folds, table, lengths, starts, pool.block_size, written=set(written), padding_slot=pool.padding, **kwargs
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(20))
def test_random_steps_match_the_spec(seed, device):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randrange(6, 24)
    pool = Pool(
        rng, device, block_size=block_size, num_blocks=num_blocks, mode=rng.choice(list(kc.HashMode)), padding=rng.choice([None, 0])
    )
    rows, max_blocks = rng.randrange(0, 7), rng.randrange(1, 6)
    # Requests own distinct blocks, except that some share another's first block (a prefix
    # hit) or point at another's block (a block table bug); rows past R are never read.
    table = [rng.sample(range(1, num_blocks), min(max_blocks, num_blocks - 1)) for _ in range(rows + 1)]
    max_blocks = len(table[0])
    for r in range(1, rows):
        if rng.random() < 0.3:
            table[r][0] = table[r - 1][0]
    capacity = max_blocks * block_size
    history_length = capacity + rng.randrange(3)
    history = [[rng.randrange(1000) for _ in range(history_length)] for _ in range(rows + 2)]
    history_rows = rng.sample(range(rows + 2), rows)
    for r in range(rows):
        pool.record(table[r], history[history_rows[r]], rng.randrange(capacity + 1))
    for _ in range(rng.randrange(4)):
        pool.damage(rng.randrange(pool.canary.capacity), rng.randrange(pool.canary.capacity))
    known = [[rng.random() < 0.9 for _ in range(history_length)] for _ in history]
    for h in rng.sample(range(len(history)), 1):  # a token changed since it was recorded
        history[h][rng.randrange(history_length)] += 1
    all_rows = []
    for _ in range(3):
        starts = [rng.choice([0, rng.randrange(capacity)]) for _ in range(rows)]
        lengths = [rng.randrange(capacity - s + 1) for s in starts]
        every = rng.choice([1, 1, 2, 3])
        kwargs = dict(
            cut_slot=rng.choice([-1, 0, 5]) if pool.canary.capacity > 5 else -1,
            every=every,
            turn=rng.randrange(every),
            deferred=rng.random() < 0.3,
        )
        tokens = rng.choice(["none", "history", "known"])
        if tokens != "none":
            kwargs.update(history=history, history_rows=history_rows, known=known if tokens == "known" else None)
        slots = spec_oracle.context_slots(table, lengths, starts, block_size)[0]
        written = rng.sample(slots, min(len(slots), rng.randrange(4))) + [rng.randrange(pool.canary.capacity)]
        table_dtype = rng.choice([torch.int32, torch.int64])
        got = call(pool, table, lengths, starts, written=written, table_dtype=table_dtype, **kwargs)
        want_slots, want_rows, flags, waiting, ring = expected(pool, table, lengths, starts, written=written, **kwargs)
        assert got == (want_slots, want_rows, flags, waiting)
        all_rows += ring
    assert ring_rows(pool.canary) == sorted(all_rows)


@pytest.mark.parametrize("device", DEVICES)
def test_a_request_s_checks_one_by_one(device):
    rng = random.Random(0)
    pool = Pool(rng, device, block_size=4, num_blocks=8, padding=0)
    blocks, tokens = [3, 5, 1], list(range(100, 112))
    pool.record(blocks, tokens, 10)
    history = [tokens]
    table = [blocks]
    # A clean context: nothing flagged, every slot checked.
    slots, rows, flagged, waiting = call(pool, table, [10], [0], history=history)
    assert slots == [12, 13, 14, 15, 20, 21, 22, 23, 4, 5] and rows == [0] * 10 and not any(flagged) and waiting == 0
    # The slots the step writes wait for the deferred call, which checks only them.
    assert call(pool, table, [10], [0], written=[5, 14, 40])[0] == [12, 13, -1, 15, 20, 21, 22, 23, 4, -1]
    assert call(pool, table, [10], [0], written=[5, 14, 40])[3] == 2
    assert call(pool, table, [10], [0], written=[5, 14, 40], deferred=True)[0] == [-1, -1, 14, -1, -1, -1, -1, -1, -1, 5]
    # every 3, turn 1: block 1 (positions 4 .. 7) and the last block (8, 9).
    assert call(pool, table, [10], [0], every=3, turn=1)[0] == [-1, -1, -1, -1, 20, 21, 22, 23, 4, 5]
    # A token changed in the history, one the history does not know, and a damaged slot.
    history[0][2] += 1
    history[0][3] += 1
    known = [[p != 3 for p in range(12)]]
    pool.damage(21, 22)
    assert call(pool, table, [10], [0], history=history, known=known)[2] == [False, False, True, False, False, True] + [False] * 4
    reasons = {v.slot: v.reasons for v in pool.canary.poll()}
    assert reasons == {14: kc.FailReason.VERIFY_TOKEN_MISMATCH, 21: kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH}
    # A window from position 6: its first entry's chain goes through the cut slot, unchecked
    # when that is the padding slot, else checked against that slot's link.
    assert call(pool, table, [4], [6], cut_slot=0)[2] == [False, False, False, False]
    assert call(pool, table, [4], [6], cut_slot=-1)[2] == [False, False, False, False]
    assert call(pool, table, [4], [6], cut_slot=13)[2] == [True, False, False, False]
    assert [v.reasons for v in pool.canary.poll()] == [kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH]
    assert call(pool, [[3, 5, 2]], [2], [8])[2] == [True, True]  # another block: position and chain fail


@pytest.mark.parametrize("device", DEVICES)
def test_odd_cases(device):
    rng = random.Random(1)
    pool = Pool(rng, device, block_size=2, num_blocks=4)
    assert call(pool, [[1, 2]], [], []) == ([], [], [], 0)  # no rows (the table has one)
    assert call(pool, [[1, 2]], [0], [3]) == ([], [], [], 0)
    assert call(pool, [[1, 2], [3, 0]], [0, 0], [0, 1], history=[[1, 2, 3, 4]] * 2, every=2, turn=1) == ([], [], [], 0)
    # written given but empty, history rows as an int32 permutation, an int64 table
    got = call(pool, [[1, 2], [3, 0]], [1, 1], [0, 0], written=[], history=[[7] * 4, [8] * 4], history_rows=[1, 0], table_dtype=torch.int64)
    assert got[0] == [2, 6] and got[1] == [0, 1] and got[3] == 0
    assert ring_rows(pool.canary)[0][3:5] == [0, 8]  # stored token 0 (never recorded), expected history[1][0]


def test_many_entries_on_several_threads():
    rng = random.Random(2)
    pool = Pool(rng, "cpu", block_size=16, num_blocks=1100)
    blocks = list(range(1, 1025))
    pool.record(blocks, [7] * 16384, 16384)
    pool.damage(16 * 700 + 3, 5)
    table = [blocks]
    written = [16 * 1000 + 1, 16 * 2 + 5]
    want = expected(pool, table, [16384], [0], written=written, history=[[7] * 16384])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = call(pool, table, [16384], [0], written=written, history=[[7] * 16384])
            assert got == want[:4] and sum(got[2]) == 1 and got[3] == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
def test_refusals_name_what_to_change_and_write_nothing(device):
    rng = random.Random(3)
    pool = Pool(rng, device, block_size=4, num_blocks=4)
    pool.record([1, 2], list(range(8)), 8)
    before = pool.canary.stats()
    ones = lambda *shape, dtype=torch.int64: torch.ones(*shape, dtype=dtype, device=device)  # noqa: E731

    def raw(table=None, **kwargs):
        table = ones(1, 2, dtype=torch.int32) if table is None else table
        return pool.canary.verify_context(table, torch.tensor([0, 8], device=device), ones(1) - 1, block_size=4, num_entries=8, **kwargs)

    cases = [
        (lambda: call(pool, [[1, 2]], [8], [0], every=0), ValueError, "every must be >= 1"),
        (lambda: call(pool, [[1, 2]], [8], [0], every=2, turn=2), ValueError, "turn must be in [0, every)"),
        (lambda: raw(history_known=ones(1, 8, dtype=torch.bool)), ValueError, "history_known needs history"),
        (lambda: raw(history_rows=ones(1)), ValueError, "history_rows needs history"),
        (
            lambda: raw(history=ones(1, 9), history_known=ones(1, 4, dtype=torch.bool)),
            ValueError,
            "history_known must be shaped like history",
        ),
        (lambda: raw(history=ones(1, 9), history_rows=ones(2)), ValueError, "history_rows must be 1-D with 1 entries"),
        (lambda: raw(written=ones(2, dtype=torch.int32)), TypeError, "written must be an int64 tensor"),
        (lambda: raw(history=torch.ones(1, 9, device=device)), TypeError, "history must be an int32 or int64"),
        (lambda: raw(table=ones(1, 1)), IndexError, "reaches position 7"),
    ]
    if device == "cpu":  # the checks that read data on the host
        cases += [
            (lambda: raw(written=torch.tensor([5, 1])), ValueError, "written must be sorted ascending"),
            (lambda: raw(history=ones(1, 9), history_rows=ones(1)), IndexError, "history_rows must be in [0, 1)"),
            (lambda: raw(history=ones(1, 6)), IndexError, "history holds 6 positions per row"),
        ]
    for make_call, error, message in cases:
        with pytest.raises(error, match="^kv-canary: .*" + re.escape(message)):
            make_call()
    assert pool.canary.stats() == before  # a refused call verified nothing
    assert ring_rows(pool.canary) == []
