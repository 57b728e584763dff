"""PagedStep on CUDA (kvcanary::paged_step's CUDA kernel) equal to its CPU kernel: the random
engine steps of test_paged_step.py (whose CPU calls are checked against the spec there) run
on both, and after every call the two canaries' records, owner tags, counters, ring rows with
their origins (as sorted lists: CUDA claims rows with atomics) and mailboxes are compared.
Phase 0 only: the two-call phases are for block-packed CPU backends, refused on CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from test_paged_step import (
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    Engine,
    damage_a_recorded_slot,
    random_batch,
    random_groups,
    read_a_block_written_in_the_same_step,
    sources_of,
)

import torch_kvcanary as kc
from torch_kvcanary.paged_step import MailboxWord, PagedStep, StepPhase

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="paged_step's CUDA kernel needs a CUDA device")

RING_WRITE = torch.ops.kvcanary.canary_counters().index("ring_write")


def ring_rows(canary) -> list[list[int]]:
    """The ring rows since the last poll, each with its origin, sorted."""
    n = min(int(canary._counters[RING_WRITE]), canary._ring.shape[0])
    return sorted(r + o for r, o in zip(canary._ring[:n].tolist(), canary._origins[:n].tolist()))


class Twin:
    """Stands in for an Engine's PagedStep: each call runs the CPU op, then the CUDA op on
    copies of the engine's bytes and step buffers, and compares the two canaries."""

    def __init__(self, engine: Engine, device: str):
        self.engine = engine
        self.device = device
        self.cpu = engine.step_op
        self.mailbox = self.cpu.mailbox
        self.kv = engine.kv.to(device)
        self.canary = kc.KvCanary(sources_of(self.kv), mode=engine.mode, on_violation=None, padding_slot=engine.padding, ring_capacity=4096)
        self.tables = [t.to(device) for t in engine.tables]
        self.mappings = [m.to(device) for m in engine.mappings]
        windows, chunks = [w for w, _ in engine.groups], [c for _, c in engine.groups]
        self.op = PagedStep(
            self.canary, self.tables, self.mappings, block_size=engine.block_size, sliding_windows=windows, chunk_sizes=chunks
        )
        engine.step_op = self

    def on_device(self, value):
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def __call__(self, *buffers, **call):
        self.cpu(*buffers, **call)
        self.kv.copy_(self.engine.kv)
        for mine, theirs in zip(self.tables + self.mappings, self.engine.tables + self.engine.mappings):
            mine.copy_(theirs)
        self.run_on_device(buffers, call)
        torch.cuda.synchronize()
        cpu, cuda = self.engine.canary, self.canary
        assert self.comparable(ring_rows(cuda)) == self.comparable(ring_rows(cpu))
        assert cuda._records.tolist() == cpu._records.tolist()
        assert cuda._owner_tags.tolist() == cpu._owner_tags.tolist()
        assert cuda._counters.tolist() == cpu._counters.tolist()
        assert self.comparable_mail(self.op.mailbox.tolist()) == self.comparable_mail(self.cpu.mailbox.tolist())
        cuda.poll()  # as the engine polls the CPU canary after the call

    def run_on_device(self, buffers: tuple, call: dict) -> None:
        self.op(*map(self.on_device, buffers), **{k: self.on_device(v) for k, v in call.items()})

    def comparable(self, rows: list[list[int]]) -> list[list[int]]:
        return rows

    def comparable_mail(self, mailbox: list[int]) -> list[int]:
        return mailbox


class SyncCheckedTwin(Twin):
    """A Twin whose CUDA calls run under torch's sync debug mode "error": a call that
    waits on the device (a copy to the host, .item(), a stream synchronize) raises."""

    def run_on_device(self, buffers: tuple, call: dict) -> None:
        buffers, call = [self.on_device(b) for b in buffers], {k: self.on_device(v) for k, v in call.items()}
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.op(*buffers, **call)
        finally:
            torch.cuda.set_sync_debug_mode("default")


class GraphTwin(Twin):
    """A Twin whose CUDA calls are captured in a CUDA graph, one per shape of call (the
    ints and which optional buffers it takes), after the first call of that shape ran
    eagerly; later calls of a shape refill the captured buffers in place and replay, as an
    engine replays its captured step. A replay runs with the step number it was captured
    with, so the mailbox's STEP and the ring rows' step are compared without it."""

    def __init__(self, engine: Engine, device: str):
        super().__init__(engine, device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, dict]] = {}
        self.replays = 0

    def run_on_device(self, buffers: tuple, call: dict) -> None:
        shape = tuple(sorted((k, v if not isinstance(v, torch.Tensor) else "tensor") for k, v in call.items() if k != "step"))
        if shape in self.graphs:
            graph, static_buffers, static_call = self.graphs[shape]
            for into, value in [*zip(static_buffers, buffers), *((static_call[k], v) for k, v in call.items())]:
                if isinstance(into, torch.Tensor):
                    into.copy_(value)
            graph.replay()
            self.replays += 1
            return
        static_buffers = tuple(self.on_device(b) for b in buffers)
        static_call = {k: self.on_device(v) for k, v in call.items()}
        self.op(*static_buffers, **static_call)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.op(*static_buffers, **static_call)  # captured, not run
        self.graphs[shape] = graph, static_buffers, static_call

    def comparable(self, rows: list[list[int]]) -> list[list[int]]:
        step = -3  # the origin's (step, group, row) end each row
        return sorted(row[:step] + row[step + 1 :] for row in rows)

    def comparable_mail(self, mailbox: list[int]) -> list[int]:
        return mailbox[MailboxWord.PHASE :]


# One layer, whose K and V the step's fold takes in a launch of at most 16 sources, and
# layers past that: 18 and 34 sources in one wide launch, 220 in two chained (the wide
# launch takes 208; csrc/cuda/launch_limits.h).
LAYERS = [(seed, 1) for seed in range(8)] + [(8, 9), (9, 17), (10, 110)]


@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("seed, layers", LAYERS)
def test_random_steps_match_the_cpu(device, seed, layers):
    rng = random.Random(seed)
    block_size, groups = random_groups(rng)
    engine = Engine(
        rng, block_size, groups, padding=rng.choice([None, 0]), mode=rng.choice(list(kc.HashMode)),
        table_dtype=rng.choice([torch.int32, torch.int64]), layers=layers,
    )  # fmt: skip
    Twin(engine, device)
    limit = MAX_BLOCKS * block_size
    for _ in range(4):
        engine.add(rng.randrange(1, min(limit, 40)))
    for _ in range(8):
        if rng.random() < 0.3 and len(engine.requests) < MAX_REQS * 4:
            # a prefix hit, at times on a block its request writes in this very step
            done = [r for r in engine.requests if r.computed and len(r.tokens) >= block_size]
            engine.add(rng.randrange(block_size + 1, min(limit, 40)), prefix=rng.choice(done) if done and rng.random() < 0.5 else None)
        batch = random_batch(engine, rng)
        if not batch:
            break
        engine.run(batch, every=rng.choice([1, 1, 2, 3]), tokens=rng.choice(["history", "none"]))
        if rng.random() < 0.5:
            damage_a_recorded_slot(engine, rng, block_size)


@pytest.mark.parametrize("device", ["cuda"])
def test_a_request_reads_a_block_another_writes_in_the_same_step(device):
    # B, first in the batch, chains through the slot A writes in the same call: the CUDA
    # kernel's dependent pass must record it after A, as the CPU does.
    engine = Engine(random.Random(3), 4, [(0, 0), (3, 0)], padding=0)
    Twin(engine, device)
    read_a_block_written_in_the_same_step(engine)


@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("phase", [StepPhase.BEFORE_FORWARD, StepPhase.AFTER_FORWARD])
def test_the_block_packed_phases_are_refused(device, phase):
    engine = Engine(random.Random(4), 4, [(0, 0)])
    twin = Twin(engine, device)
    before = twin.canary._counters.tolist()
    buffers = [twin.on_device(b) for b in (engine.qsl, engine.seq_lens, engine.positions, engine.input_ids)]
    with pytest.raises(ValueError, match="^kv-canary: .*block-packed CPU backends"):
        twin.op(*buffers, num_reqs=0, num_tokens=0, step=0, phase=phase)
    assert twin.canary._counters.tolist() == before


@pytest.mark.parametrize("device", ["cuda"])
def test_any_step_values_are_read_safely(device):
    # The CUDA op reads none of the step's values on the host, so it checks none: requests
    # out of order, seq_lens below their tokens, positions past the block table and slots
    # past the capacity are skipped or reported on the device, never read out of bounds.
    engine = Engine(random.Random(10), 4, [(0, 0), (3, 0), (0, 8)], padding=0)
    twin = Twin(engine, device)
    gen = torch.Generator().manual_seed(10)

    def noise(like: torch.Tensor, low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, like.shape, generator=gen, dtype=like.dtype).to(device)

    for step in range(20):
        for table in twin.tables:
            table.copy_(noise(table, -2, engine.num_blocks + 3))
        for mapping in twin.mappings:
            mapping.copy_(noise(mapping, -2, twin.canary.capacity + 5))
        twin.op(
            noise(engine.qsl, -3, MAX_TOKENS + 8), noise(engine.seq_lens, -5, 1 << 20), noise(engine.positions, -2, 100),
            noise(engine.input_ids, -1, 1000), num_reqs=MAX_REQS + 1, num_tokens=MAX_TOKENS + 3, step=step,
            history=engine.history.to(device), history_rows=noise(engine.history_rows, -2, MAX_REQS * 4 + 3),
        )  # fmt: skip
        torch.cuda.synchronize()
    assert twin.op.finished(19)


@pytest.mark.parametrize("device", ["cuda"])
def test_a_scratch_too_small_is_refused_and_the_bound_one_fits(device):
    engine = Engine(random.Random(0), 4, [(0, 0), (3, 0)])
    twin = Twin(engine, device)
    size = torch.ops.kvcanary.paged_step_scratch_size
    bound = size(2, twin.mappings[0].shape[0], twin.tables[0].shape[0], twin.canary.capacity)
    assert twin.op.scratch.shape == (bound,) and twin.op.scratch.device.type == "cuda"
    # The largest call the buffers allow: every table row a request, every position a token.
    num_reqs, num_tokens = engine.seq_lens.shape[0], engine.positions.shape[0]
    needed = size(2, num_tokens, num_reqs, twin.canary.capacity)
    assert needed <= bound
    bound_scratch = twin.op._tables[-1]
    twin.op._tables = (*twin.op._tables[:-1], torch.empty(needed - 1, dtype=torch.int64, device=device))
    buffers = map(twin.on_device, (engine.qsl, engine.seq_lens, engine.positions))
    with pytest.raises(ValueError, match=f"^kv-canary: paged_step's scratch holds {needed - 1} values; this call on CUDA needs {needed} "):
        twin.op(*buffers, num_reqs=num_reqs, num_tokens=num_tokens, step=0)
    twin.op._tables = (*twin.op._tables[:-1], bound_scratch)


def _decode(engine: Engine, rng: random.Random, steps: int) -> None:
    """Three requests prefilled, then ``steps`` decode steps of all three (the same shape
    of call each step), a byte of a recorded context slot flipped before some."""
    requests = [engine.add(24) for _ in range(3)]
    engine.run([(r, 12) for r in requests])
    for _ in range(steps):
        if rng.random() < 0.5:
            victim = rng.choice(requests)
            p = rng.randrange(victim.computed)
            engine.slot_bytes(victim.blocks[0][p // engine.block_size] * engine.block_size + p % engine.block_size)
        engine.run([(r, 1) for r in requests])


@pytest.mark.parametrize("device", ["cuda"])
def test_a_step_waits_on_nothing(device):
    # Under sync debug mode "error" every CUDA call of the steps raises if it waits on the device.
    engine = Engine(random.Random(12), 4, [(0, 0), (3, 0)], padding=0)
    SyncCheckedTwin(engine, device)
    _decode(engine, random.Random(12), 8)


@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("seed", range(3))
def test_a_step_captured_in_a_cuda_graph_replays_as_the_cpu_runs_it(device, seed):
    engine = Engine(random.Random(seed), 4, [(0, 0), (3, 0), (0, 8)], padding=0)
    twin = GraphTwin(engine, device)
    _decode(engine, random.Random(seed), 8)
    assert twin.replays == 7  # every decode step but the first, which ran eagerly before its capture
