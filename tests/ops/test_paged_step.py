"""PagedStep (kvcanary::paged_step): a paged serving step's canary work in one call, equal to
its contract transcribed in plain Python (spec_oracle.PagedStep over the spec's records) on
simulated engines: prefill chunks and decodes over KV cache groups of full, sliding-window and
chunked attention sharing one pool, a request reading a block another writes in the same step,
block-packed backends (two calls a step), token histories (known in part), sampling, damaged
bytes and a block table pointing at the wrong block; a context longer than one thread's share
and block tables with strides; odd cases; refusals that change nothing. CPU: the
CUDA kernel's checks are in test_paged_step_cuda.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import spec_oracle
import torch
from helpers import torch_threads

import torch_kvcanary as kc
from torch_kvcanary import layouts
from torch_kvcanary.paged_step import MailboxWord, PagedStep, StepPhase

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

MAX_REQS, MAX_TOKENS, MAX_BLOCKS = 6, 64, 12


@dataclass
class Request:
    tokens: list[int]  # every token it will have: prompt, then decodes
    blocks: list[list[int]]  # per group
    computed: int = 0
    history_row: int = 0


def sources_of(kv: torch.Tensor) -> list:
    """The canary's sources over ``[layers, 2, num_blocks, block_size, heads, head_size]``:
    each layer's K and V, as vLLM's NHD layout gives them."""
    return [source for layer in kv for source in layouts.vllm(layer, layout="NHD")]


@dataclass
class Engine:
    """A paged pool of ``layers`` vLLM layers shared by KV cache groups, its canary and the
    spec's records, and the step buffers an engine refills in place."""

    rng: random.Random
    block_size: int
    groups: list[tuple[int, int]]  # (sliding window, chunk size) per group
    blocks_packed: bool = False
    padding: int | None = 0
    mode: kc.HashMode = kc.HashMode.ALL
    table_dtype: torch.dtype = torch.int32
    num_blocks: int = 160
    layers: int = 1
    max_blocks: int = MAX_BLOCKS  # per block table row
    max_tokens: int = MAX_TOKENS  # a step's most tokens
    strided_tables: bool = False  # block tables as views of every other column of wider ones
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self):
        gen = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
        shape = (self.layers, 2, self.num_blocks, self.block_size, 1, 16)
        self.kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.bfloat16)
        self.canary = kc.KvCanary(sources_of(self.kv), mode=self.mode, on_violation=None, padding_slot=self.padding, ring_capacity=4096)
        self.oracle_records = spec_oracle.Records(self.canary.capacity)
        self.free = list(range(1, self.num_blocks))
        self.rng.shuffle(self.free)
        groups = len(self.groups)
        columns = 2 if self.strided_tables else 1
        tables = [torch.full((MAX_REQS + 1, self.max_blocks * columns), 0, dtype=self.table_dtype) for _ in range(groups)]
        self.tables = [table[:, ::columns] for table in tables]
        self.mappings = [torch.full((self.max_tokens + 5,), -1, dtype=torch.int64) for _ in range(groups)]
        self.qsl = torch.zeros(MAX_REQS + 2, dtype=torch.int32)
        self.seq_lens = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
        self.positions = torch.zeros(self.max_tokens + 3, dtype=torch.int64)
        self.input_ids = torch.zeros(self.max_tokens + 3, dtype=torch.int32)
        self.history = torch.full((MAX_REQS * 4, self.max_blocks * self.block_size), -1, dtype=torch.int32)
        self.history_rows = torch.zeros(MAX_REQS + 1, dtype=torch.int32)
        self.step_op = PagedStep(
            self.canary, self.tables, self.mappings, block_size=self.block_size,
            sliding_windows=[w for w, _ in self.groups], chunk_sizes=[c for _, c in self.groups],
        )  # fmt: skip
        self.steps = 0

    def folds(self, slots: list[int]) -> list[int]:
        s = torch.tensor(slots, dtype=torch.int64)
        return kc.reference_fold(list(self.canary.sources), s, mode=self.canary.mode).tolist()

    def slot_bytes(self, slot: int) -> None:
        """The forward's write: new bytes for ``slot``'s K and V."""
        b, o = divmod(slot, self.block_size)
        self.kv[:, :, b, o] = torch.randn(self.kv[:, :, b, o].shape).to(torch.bfloat16)

    def add(self, length: int, prefix: Request | None = None) -> Request:
        tokens = [self.rng.randrange(1000) for _ in range(length)]
        request = Request(tokens, [[] for _ in self.groups], history_row=len(self.requests))
        if prefix is not None:  # a prefix hit on the first block of a request scheduled in this step
            request.tokens[: self.block_size] = prefix.tokens[: self.block_size]
            request.blocks = [[blocks[0]] for blocks in prefix.blocks]
            request.computed = self.block_size
        self.requests.append(request)
        self.history[request.history_row, : len(request.tokens)] = torch.tensor(request.tokens, dtype=torch.int32)
        return request

    def run(self, batch: list[tuple[Request, int]], *, every=1, tokens="history", damage=None, known=None):
        """One step: each (request, tokens it runs) in batch order, the history's tokens
        checked where ``known`` (bool, shaped like the history; None: everywhere); the ring
        rows the op and the spec give, each with its origin."""
        rows = len(batch)
        bs = self.block_size
        qsl, seq_lens, positions, input_ids, mapping_values = [0], [], [], [], [[] for _ in self.groups]
        for r, (request, n) in enumerate(batch):
            for g, blocks in enumerate(request.blocks):
                while len(blocks) * bs < request.computed + n:
                    blocks.append(self.free.pop())
                window, chunk = self.groups[g]
                first = max(0, request.computed - window + 1) if window else (request.computed // chunk * chunk if chunk else 0)
                for b in range(first // bs):  # blocks wholly below the window: freed, the null block
                    blocks[b] = 0
                self.tables[g][r].fill_(0)
                self.tables[g][r, : len(blocks)] = torch.tensor(blocks, dtype=self.table_dtype)
                mapping_values[g] += [blocks[p // bs] * bs + p % bs for p in range(request.computed, request.computed + n)]
            positions += list(range(request.computed, request.computed + n))
            input_ids += request.tokens[request.computed : request.computed + n]
            qsl.append(qsl[-1] + n)
            seq_lens.append(request.computed + n)
            self.history_rows[r] = request.history_row
        num_tokens = qsl[-1]
        for g, values in enumerate(mapping_values):
            self.mappings[g][:num_tokens] = torch.tensor(values, dtype=torch.int64)
            self.mappings[g][num_tokens:] = -1
        for buffer, values in ((self.qsl, qsl), (self.seq_lens, seq_lens), (self.positions, positions), (self.input_ids, input_ids)):
            buffer[: len(values)] = torch.tensor(values, dtype=buffer.dtype)
        history = dict(history=self.history, history_rows=self.history_rows[:rows].tolist()) if tokens == "history" else {}
        oracle = spec_oracle.PagedStep(
            self.oracle_records, self.folds, [[row.tolist() for row in t] for t in self.tables],
            [m.tolist() for m in self.mappings], [w for w, _ in self.groups], [c for _, c in self.groups], bs,
        )  # fmt: skip
        oracle_history = {}
        if history:
            oracle_history = dict(history=self.history.tolist(), history_rows=history["history_rows"])
            if known is not None:
                oracle_history["known"] = known.tolist()
        call = dict(num_reqs=rows, num_tokens=num_tokens, step=self.steps, every=every)
        if tokens == "history":
            call.update(history=self.history, history_rows=self.history_rows, history_known=known)
        spec = dict(phase=0, step=self.steps, every=every, padding_slot=self.padding, **oracle_history)
        args = (qsl, seq_lens, positions, input_ids)
        written = [s for values in mapping_values for s in values]
        if self.blocks_packed:
            self.step_op(self.qsl, self.seq_lens, self.positions, self.input_ids, phase=StepPhase.BEFORE_FORWARD, **call)
            want = oracle.step(*args, **{**spec, "phase": 1})
            for slot in written:  # a packed block's write changes its other slots' bytes too
                for other in range(slot // bs * bs, slot // bs * bs + bs):
                    self.slot_bytes(other)
            self.step_op(self.qsl, self.seq_lens, self.positions, self.input_ids, phase=StepPhase.AFTER_FORWARD, **call)
            want += oracle.step(*args, **{**spec, "phase": 2})
        else:
            for slot in written:
                self.slot_bytes(slot)
            self.step_op(self.qsl, self.seq_lens, self.positions, self.input_ids, **call)
            want = oracle.step(*args, **spec)
        for request, n in batch:
            request.computed += n
        got = [[int(v.kind), v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain, v.expected_aux, int(v.reasons), v.step, v.group, v.row] for v in self.canary.poll()]  # fmt: skip
        assert sorted(got) == sorted([*row, *origin] for row, origin in want)
        assert self.canary.records.tolist() == self.oracle_records.records
        assert self.step_op.mailbox.tolist()[MailboxWord.STEP] == self.steps
        self.steps += 1
        return got


def random_batch(engine: Engine, rng: random.Random) -> list[tuple[Request, int]]:
    live = [r for r in engine.requests if r.computed < len(r.tokens)]
    rng.shuffle(live)
    batch = []
    budget = MAX_TOKENS
    for request in live[:MAX_REQS]:
        left = len(request.tokens) - request.computed
        n = min(left, budget, rng.choice([1, 1, rng.randrange(1, 3 * engine.block_size + 2)]))
        if n:
            batch.append((request, n))
            budget -= n
    return batch


def random_groups(rng: random.Random) -> tuple[int, list[tuple[int, int]]]:
    """A random block size and KV cache groups: full attention, then none, one or both of a
    sliding-window group and a chunked one."""
    block_size = rng.choice([1, 2, 4, 16])
    kinds = [(0, 0), (rng.choice([1, 3, 2 * block_size + 1]), 0), (0, rng.choice([block_size, 2 * block_size]))]
    return block_size, [kinds[0]] + rng.sample(kinds[1:], rng.randrange(3))


def damage_a_recorded_slot(engine: Engine, rng: random.Random, block_size: int) -> None:
    """Changes the bytes of a random position some request has recorded (none where its block
    in group 0 is block 0, the null block)."""
    done = [r for r in engine.requests if r.computed]
    victim = rng.choice(done)
    p = rng.randrange(victim.computed)
    block = victim.blocks[0][p // block_size]
    if block:
        engine.slot_bytes(block * block_size + p % block_size)


@pytest.mark.parametrize("seed", range(16))
def test_random_engines_match_the_spec(seed):
    rng = random.Random(seed)
    block_size, groups = random_groups(rng)
    engine = Engine(
        rng, block_size, groups, blocks_packed=rng.random() < 0.4, padding=rng.choice([None, 0]),
        mode=rng.choice(list(kc.HashMode)), table_dtype=rng.choice([torch.int32, torch.int64]),
    )  # fmt: skip
    limit = MAX_BLOCKS * block_size
    for _ in range(4):
        engine.add(rng.randrange(1, min(limit, 40)))
    flagged = 0
    for _ in range(10):
        if rng.random() < 0.3 and len(engine.requests) < MAX_REQS * 4:
            engine.add(rng.randrange(1, min(limit, 40)))
        batch = random_batch(engine, rng)
        if not batch:
            break
        every = rng.choice([1, 1, 2, 3])
        flagged += len(engine.run(batch, every=every, tokens=rng.choice(["history", "none"])))
        if rng.random() < 0.5:
            damage_a_recorded_slot(engine, rng, block_size)


def read_a_block_written_in_the_same_step(engine: Engine) -> tuple[Request, Request]:
    """A (9 tokens) prefills its first block of 4 while B, a prefix hit on that block, writes
    its next position: B's first entry chains through A's last slot, written in the same call,
    and B (first in the batch) must be recorded after A. No step flags anything."""
    a = engine.add(9)
    engine.run([(a, 2)])
    b = engine.add(9, prefix=a)
    assert engine.run([(b, 1), (a, 2)]) == []
    assert engine.run([(b, 1), (a, 1)]) == []
    return a, b


def test_a_request_reads_a_block_another_writes_in_the_same_step():
    engine = Engine(random.Random(3), 4, [(0, 0)], padding=0)
    a, b = read_a_block_written_in_the_same_step(engine)
    chain = engine.canary.records[b.blocks[0][1] * 4, 2].item()  # position 4's chain: the link of position 3
    assert chain == engine.oracle_records.link(a.blocks[0][0] * 4 + 3)


def test_a_violation_names_its_step_group_and_request():
    rng = random.Random(4)
    engine = Engine(rng, 4, [(0, 0), (3, 0)], padding=0)
    a, b = engine.add(12), engine.add(12)
    engine.run([(a, 8), (b, 8)])
    engine.slot_bytes(b.blocks[0][1] * 4 + 2)  # position 6 of b in group 0
    got = engine.run([(a, 1), (b, 1)])
    assert [(v[1], v[-3:]) for v in got] == [(b.blocks[0][1] * 4 + 2, [1, 0, 1])]
    assert got[0][7] == int(kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    # A block table pointing at another request's block: position and chain fail for b.
    engine.run([(a, 1), (b, 1)])
    b.blocks[0][0], a.blocks[0][0] = a.blocks[0][0], b.blocks[0][0]
    got = engine.run([(a, 1), (b, 1)])
    assert {tuple(v[-3:]) for v in got} == {(3, 0, 0), (3, 0, 1)}


def _prefilled(seed: int, tokens: int, prefill: int) -> tuple[Engine, Request]:
    """An engine of one full-attention group (blocks of 4) and a request of ``tokens`` tokens
    whose first ``prefill`` it has run."""
    engine = Engine(random.Random(seed), 4, [(0, 0)])
    a = engine.add(tokens)
    engine.run([(a, prefill)])
    return engine, a


def test_every_turn_samples_the_context():
    engine, a = _prefilled(5, 30, 20)
    engine.slot_bytes(a.blocks[0][1] * 4)  # block 1: in turn 1 of every 3, not in turns 2 and 0
    assert len(engine.run([(a, 1)], every=3)) == 1  # step 1: turn 1
    assert engine.run([(a, 1)], every=3) == []  # turn 2
    assert engine.run([(a, 1)], every=3) == []  # turn 0
    assert len(engine.run([(a, 1)], every=3)) == 1  # turn 1 again
    assert len(engine.run([(a, 1)])) == 1  # every step


def test_the_history_is_checked_where_known():
    engine, a = _prefilled(10, 12, 8)
    engine.history[a.history_row, 2] += 1  # the history disagrees with the records at positions 2 and 5
    engine.history[a.history_row, 5] += 1
    known = torch.ones(engine.history.shape, dtype=torch.bool)
    known[a.history_row, 5] = False  # not known at position 5: not checked there
    got = engine.run([(a, 1)], known=known)
    assert [(v[2], v[7]) for v in got] == [(2, int(kc.FailReason.VERIFY_TOKEN_MISMATCH))]


def test_a_context_past_one_thread_s_share_on_one_and_two_threads():
    # 16,400 context entries, more than the 16,384 a thread takes: the walk over them is split
    # among torch's threads.
    rng = random.Random(11)
    engine = Engine(rng, 16, [(0, 0)], num_blocks=1100, max_blocks=1040, max_tokens=16400)
    a = engine.add(16403)
    engine.run([(a, 16400)])
    damaged = 700 * 16 + 3
    for count in (1, 2):
        with torch_threads(count):
            engine.slot_bytes(a.blocks[0][damaged // 16] * 16 + damaged % 16)
            assert [v[2] for v in engine.run([(a, 1)])] == [damaged]


def test_a_block_table_view_with_strides():
    rng = random.Random(12)
    engine = Engine(rng, 4, [(0, 0), (3, 0)], strided_tables=True)
    assert not engine.tables[0].is_contiguous()
    a, b = engine.add(20), engine.add(9)
    engine.run([(a, 9), (b, 9)])
    engine.slot_bytes(a.blocks[0][1] * 4 + 1)  # position 5 of a in group 0
    got = engine.run([(a, 1), (b, 0)])
    assert [(v[2], v[-3:]) for v in got] == [(5, [1, 0, 0])]


def test_odd_cases():
    rng = random.Random(6)
    engine = Engine(rng, 4, [(0, 0)])
    assert engine.run([]) == []  # no requests, no tokens
    a = engine.add(5)
    assert engine.run([(a, 0)]) == []  # a request that runs no token
    assert engine.run([(a, 5)]) == []
    stats = engine.canary.stats()
    assert stats["slots_recorded"] == 5 and stats["violations"] == 0


def fresh_call(engine: Engine, **changes):
    """The op's arguments for a one-request step, with ``changes``."""
    args = dict(query_start_loc=engine.qsl, seq_lens=engine.seq_lens, positions=engine.positions, input_ids=engine.input_ids)
    kwargs = dict(num_reqs=1, num_tokens=2, step=0)
    for key, value in changes.items():
        (args if key in args else kwargs)[key] = value
    return args, kwargs


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_start_loc=torch.tensor([0, 3, 1], dtype=torch.int32)), "request 0 runs tokens"),
        (dict(query_start_loc=torch.tensor([1, 2], dtype=torch.int32)), "query_start_loc\\[0\\] must be 0"),
        (dict(seq_lens=torch.tensor([1], dtype=torch.int32)), "seq_lens counts the tokens"),
        (dict(seq_lens=torch.tensor([10_000], dtype=torch.int32)), "block_tables\\[0\\] holds"),
        (dict(positions=torch.zeros(1, dtype=torch.int64)), "positions has 1 entries but the step needs 2"),
        (dict(positions=torch.zeros(4, dtype=torch.float32)), "positions must be an int32 or int64 tensor"),
        (dict(input_ids=torch.zeros(8, dtype=torch.int64)[::2]), "input_ids must be a contiguous 1-D tensor"),
        (dict(num_reqs=MAX_REQS + 5), "must be \\[>= num_reqs"),
        (dict(phase=3), "phase must be 0"),
        (dict(every=0), "every must be >= 1"),
        (dict(history_rows=torch.zeros(4, dtype=torch.int32)), "history_rows needs history"),
        (dict(history_known=torch.ones(2, 8, dtype=torch.bool)), "history_known needs history"),
        (dict(history=torch.zeros(2, 8)), "history must be an int32 or int64 tensor, got Float"),
        (dict(history=torch.zeros(8, dtype=torch.int32)), "history must be \\[history_rows, max_positions\\], got shape \\[8\\]"),
        (
            dict(history=torch.zeros(2, 8, dtype=torch.int32), history_known=torch.ones(2, 8, dtype=torch.int32)),
            "history_known must be a bool tensor, got Int",
        ),
        (
            dict(history=torch.zeros(2, 8, dtype=torch.int32), history_known=torch.ones(2, 4, dtype=torch.bool)),
            "history_known must be shaped like history, \\[2, 8\\], got shape \\[2, 4\\]",
        ),
        (dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device="meta")), "pass the step's buffers on the canary's device"),
        (dict(roots=torch.zeros(1, dtype=torch.int32)), "roots must be an int64 tensor with one value per request, got torch.int32"),
        (dict(roots=torch.zeros(0, dtype=torch.int64)), "roots has 0 entries but the step needs 1 \\(one per request\\)"),
        (dict(roots=torch.zeros(2, 1, dtype=torch.int64)), "roots must be a contiguous 1-D tensor, got shape \\[2, 1\\]"),
        (dict(roots=torch.zeros(1, dtype=torch.int64, device="meta")), "roots is on meta but the canary is on cpu"),
    ],
)
def test_refusals_change_nothing(change, message):
    engine = Engine(random.Random(7), 4, [(0, 0)])
    engine.qsl[:2] = torch.tensor([0, 2])
    engine.seq_lens[0] = 2
    before = [t.clone() for t in (engine.canary._records, engine.canary._counters, engine.canary._ring, engine.step_op.mailbox)]
    args, kwargs = fresh_call(engine, **change)
    with pytest.raises((ValueError, TypeError), match=f"^kv-canary: .*{message}"):
        engine.step_op(*args.values(), **kwargs)
    after = (engine.canary._records, engine.canary._counters, engine.canary._ring, engine.step_op.mailbox)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize(
    "scratch, message",
    [
        (torch.zeros(4, dtype=torch.float32), "got Float of shape \\[4\\] on cpu"),
        (torch.zeros(2, 2, dtype=torch.int64), "got Long of shape \\[2, 2\\]"),
        (torch.zeros(4, dtype=torch.int64, device="meta"), "got .* of shape \\[4\\] on meta"),
    ],
)
def test_a_scratch_of_the_wrong_kind_is_refused(scratch, message):
    engine = Engine(random.Random(7), 4, [(0, 0)])
    engine.qsl[:2] = torch.tensor([0, 2])
    engine.seq_lens[0] = 2
    engine.step_op.scratch = scratch
    engine.step_op._tables = (*engine.step_op._tables[:-1], scratch)
    args, kwargs = fresh_call(engine)
    with pytest.raises(
        ValueError,
        match=f"^kv-canary: paged_step's scratch must be a contiguous 1-D int64 tensor on the canary's device \\(cpu\\), {message}",
    ):
        engine.step_op(*args.values(), **kwargs)
    assert int(engine.canary._counters.sum()) == 0


def test_the_scratch_size_grows_with_each_of_its_arguments_and_refuses_bad_ones():
    size = torch.ops.kvcanary.paged_step_scratch_size
    base = size(2, 64, 8, 1024)
    assert base > 0
    for grown in (size(3, 64, 8, 1024), size(2, 65, 8, 1024), size(2, 64, 9, 1024), size(2, 64, 8, 1025)):
        assert grown > base
    # The CUDA kernels' per-slot and per-entry arrays: it grows linearly in each.
    assert size(2, 64, 8, 2048) - size(2, 64, 8, 1024) == size(2, 64, 8, 3072) - size(2, 64, 8, 2048)
    assert size(2, 128, 8, 1024) - size(2, 64, 8, 1024) == size(4, 64, 8, 1024) - base
    for bad in ((-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1), (1, 1, 1, -1), (9, 1, 1, 1), (1, 1 << 48, 1, 1)):
        with pytest.raises(ValueError, match="^kv-canary: paged_step_scratch_size takes num_groups in \\[0, 8\\]"):
            size(*bad)


def test_a_cpu_step_binds_no_scratch():
    engine = Engine(random.Random(7), 4, [(0, 0), (3, 0)])
    assert engine.step_op.scratch.shape == (0,) and engine.step_op.scratch.dtype == torch.int64


def test_a_released_table_is_refused():
    engine = Engine(random.Random(8), 4, [(0, 0)])
    engine.canary._bound.release()
    args, kwargs = fresh_call(engine, num_tokens=0, num_reqs=0)
    with pytest.raises(ValueError, match="^kv-canary: sources_table is not a live table"):
        engine.step_op(*args.values(), **kwargs)


def test_opcheck():
    engine = Engine(random.Random(9), 4, [(0, 0), (5, 0)])
    a = engine.add(6)
    engine.run([(a, 3)])
    op = torch.ops.kvcanary.paged_step.default
    groups = engine.step_op._groups
    tables = engine.step_op._tables
    sample = (*groups, engine.qsl, engine.seq_lens, engine.positions, engine.input_ids, engine.history, None, engine.history_rows, *tables, 1, 3, 4, 0, 1, 1, 0)  # fmt: skip
    torch.library.opcheck(op, sample, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(op, (*sample, torch.zeros(2, dtype=torch.int64)), test_utils=("test_schema", "test_faketensor"))
