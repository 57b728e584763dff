"""The contracts every op of the kvcanary library keeps, driven by one table (OPS): opcheck on
the raw op's arguments; torch.compile(fullgraph=True, dynamic=True) of the public function that
calls the op, equal to eager and to an independent oracle; and (CUDA) that function captured
in a CUDA graph and replayed with its inputs refilled in place, equal to the oracle. The
oracles are reference_fold (pure torch) and spec_oracle (docs/spec.md in plain ints). The ops
that take and return no tensor are host queries, with a table of their own."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import spec_oracle
import torch
from helpers import DEVICES, random_bytes, random_case, random_digest_case, random_slots, ring_rows

import torch_kvcanary as kc
from torch_kvcanary import layouts, ops, paged_step

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

# --- the table -------------------------------------------------------------------------------


@dataclass
class Program:
    """An op through its public function. `fn` is what gets compiled and captured;
    `expect(*args)` is the oracle's result of `fn(*args)` after the calls before it, slots
    past the capacity read as padding (what a graph replay does, where no check can sync)."""

    fn: Callable[..., torch.Tensor]
    batches: list[tuple]  # compile: fn's arguments of several shapes, called in order
    replays: list[tuple]  # CUDA graph: arguments of one shape; the first is captured, each later one copied in and replayed
    expect: Callable[..., list]
    state: Callable[[], dict] = dict  # what the calls leave behind: the same compiled as eager
    expected_state: Callable[[], dict] = dict  # the oracle's entries of `state`


@dataclass(frozen=True)
class OpCase:
    op: str  # its name in torch.ops.kvcanary
    samples: Callable[[str], list[tuple]]  # the raw op's arguments on a device (opcheck)
    program: Callable[[str], Program]  # built afresh on a device for each test


def _as_padding(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    return torch.where(slots < capacity, slots, -1)


def _ints(values: torch.Tensor | None) -> list[int] | None:
    return None if values is None else values.reshape(-1).tolist()


def _longs(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


# fold ---------------------------------------------------------------------------------------


def _fold_samples(device: str) -> list[tuple]:
    rng = random.Random(7)
    samples = []
    for seed in range(6):
        sources, slots, _ = random_case(seed, device)
        samples.append(([ops.integer_view(s.as_view()) for s in sources], slots, [s.read_bytes for s in sources], True))
    pool = torch.randint(0, 255, (4, 16, 32), dtype=torch.uint8, device=device)
    samples.append(([pool], torch.empty(0, dtype=torch.int64, device=device), [32], True))
    samples.append(([], random_slots(rng, 10, 5, device=device), [], False))
    # float views work too, except float8: opcheck compares inputs with arithmetic float8
    # lacks, which is why `fold` passes every view as an integer dtype of its size
    samples.append(([torch.randn(4, 2, 2, 8, device=device)], torch.tensor([0, 7, -1], device=device), [64], True))
    return samples


def _kv_sources(pool: torch.Tensor) -> list:
    # vLLM-style [2, blocks, block_size, heads, dim] pool: K and V halves as two sources.
    return [kc.view_source(pool[i], read_bytes=kc.resolve_read_bytes(kc.HashMode.ALL)) for i in range(2)]


def _k_and_v(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return kc.fold(_kv_sources(pool), slots)


def _fold_program(device: str) -> Program:
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 255, (2, 6, 4, 2, 16), dtype=torch.uint8, generator=gen).to(device)
    batches = [(pool, torch.randint(-1, 24, (n,), generator=gen).to(device)) for n in (3, 17, 24)]
    bigger = torch.randint(0, 255, (2, 9, 4, 2, 32), dtype=torch.uint8, generator=gen).to(device)
    batches.append((bigger, torch.randint(-1, 36, (11,), generator=gen).to(device)))

    kv = torch.randint(-128, 127, (2, 64, 16, 2, 64), dtype=torch.int8, generator=gen).view(torch.bfloat16).to(device)
    capacity = 64 * 16
    replays = [(kv, torch.full((256,), -1, device=device))]
    replays += [(kv, torch.randint(-1, capacity, (256,), generator=gen).to(device)) for _ in range(3)]
    replays.append((kv, torch.full((256,), capacity + 5, device=device)))  # past the capacity: read nothing, give 0

    def expect(pool: torch.Tensor, slots: torch.Tensor) -> list:
        return kc.reference_fold(_kv_sources(pool), _as_padding(slots, pool.shape[1] * pool.shape[2])).tolist()

    return Program(_k_and_v, batches, replays, expect)


# record and verify --------------------------------------------------------------------------


def _kv_pool(device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 8, 16, 2, 32, generator=gen).to(torch.bfloat16).to(device)  # capacity 128


def _canary(device: str) -> tuple[torch.Tensor, kc.KvCanary]:
    kv = _kv_pool(device)
    return kv, kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)


def _canary_samples(device: str) -> tuple[tuple, tuple]:
    """(record's arguments, verify's arguments) over one canary's tables."""
    _, canary = _canary(device)
    slots = torch.tensor([3, 4, -1, 9], device=device)
    positions, tokens = torch.arange(4, device=device), torch.tensor([5, 6, 7, -1], device=device)
    prev = torch.tensor([-1, 3, -1, 4], device=device, dtype=torch.int32)
    tags = torch.tensor([2], device=device)
    head = (canary._views, canary._read_bytes, slots, positions, tokens, prev, tags)
    tables = (canary._records, canary._owner_tags, canary._counters, canary._ring)
    return (*head, *tables, True), (*head, *tables, -1, True)


def _roots(device: str) -> torch.Tensor:
    """A root per entry of `_canary_samples`: its entries 0 and 2 are first positions."""
    return torch.tensor([7, -8, 1 << 40, 5], dtype=torch.int64, device=device)


def _record_samples(device: str) -> list[tuple]:
    record = _canary_samples(device)[0]
    return [record, (*record, _roots(device))]


def _verify_samples(device: str) -> list[tuple]:
    verify = _canary_samples(device)[1]
    no_checks = (*verify[:3], None, None, None, None, *verify[7:11], 0, True)  # only the fold checked; padding slot 0
    return [verify, no_checks, (*verify, _roots(device))]


def _request(slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The entries of a request whose position p sits at slot p: (slots, positions, tokens,
    prev_slots), each slot chained through the one before it."""
    return slots, slots.clone(), slots * 3, slots - 1


def _oracle_inputs(positions, tokens, prev_slots, tags) -> dict:
    """The optional per-entry inputs as spec_oracle.Records takes them: lists, or None."""
    return {"positions": _ints(positions), "tokens": _ints(tokens), "prev_slots": _ints(prev_slots), "tags": _ints(tags)}


def _reference_folds(canary: kc.KvCanary, slots: torch.Tensor) -> list[int]:
    return kc.reference_fold(list(canary.sources), torch.where(slots >= 0, slots, -1), mode=canary.mode).reshape(-1).tolist()


def _ring_rows(violations) -> list[list[int]]:
    return sorted(ring_rows(violations))  # CUDA claims ring rows in no fixed order


def _record_program(device: str) -> Program:
    _, canary = _canary(device)
    oracle = spec_oracle.Records(canary.capacity)

    def fn(slots, positions, tokens, prev_slots, tags):
        canary.record(slots, -1 if tags is None else tags, positions=positions, tokens=tokens, prev_slots=prev_slots)
        return canary.records

    def expect(slots, positions, tokens, prev_slots, tags):
        oracle.record(_ints(slots), _reference_folds(canary, slots), **_oracle_inputs(positions, tokens, prev_slots, tags))
        return oracle.records

    int32_slots = torch.arange(40, 47, dtype=torch.int32, device=device)
    batches = [
        (_longs([3, 17, -1, 90, 91], device), None, None, None, None),
        *((*_request(torch.arange(10, 10 + n, device=device)), None) for n in (5, 9, 3)),
        (*_request(int32_slots), torch.arange(7, device=device) % 3),  # int32 entries, an owner tag per slot
    ]
    idle = torch.zeros(32, dtype=torch.int64, device=device)
    replays = [
        (idle - 1, idle, idle, idle, None),
        (*_request(torch.arange(32, device=device)), None),
        (*_request(torch.arange(64, 96, device=device)), None),
    ]
    owners = torch.arange(canary.capacity, device=device)
    return Program(
        fn, batches, replays, expect,
        state=lambda: {"owners": canary.owners(owners).tolist(), "stats": canary.stats()},
        expected_state=lambda: {"owners": oracle.owners},
    )  # fmt: skip


def _verify_program(device: str) -> Program:
    kv, canary = _canary(device)
    oracle = spec_oracle.Records(canary.capacity)
    slots, positions, tokens, prev_slots = _request(torch.arange(canary.capacity, device=device))  # one request, every slot
    canary.record(slots, positions=positions, tokens=tokens, prev_slots=prev_slots)
    oracle.record(_ints(slots), _reference_folds(canary, slots), **_oracle_inputs(positions, tokens, prev_slots, None))
    kv[0, 5, 11, 0, 4] += 1  # the K bytes of slot 5 * 16 + 11 = 91 change
    rows = []

    def fn(slots, positions, tokens, prev_slots, tags):
        return canary.verify(slots, tags, positions=positions, tokens=tokens, prev_slots=prev_slots)

    def expect(slots, positions, tokens, prev_slots, tags):
        flags, flagged = oracle.verify(_ints(slots), _reference_folds(canary, slots), **_oracle_inputs(positions, tokens, prev_slots, tags))
        rows.extend(flagged)
        return flags

    def shifted(slots):  # every position off by one
        slots, positions, tokens, prev = _request(slots)
        return slots, positions + 1, tokens, prev

    int32_slots = torch.arange(20, 23, dtype=torch.int32, device=device)
    batches = [
        (_longs([3, 17, -1, 90, 91], device), None, None, None, None),
        (_longs([91, 3, 17], device), None, None, None, None),
        (*shifted(torch.arange(10, 15, device=device)), None),
        (*_request(torch.arange(85, 94, device=device)), None),
        (*_request(int32_slots), torch.full((3,), 2, device=device)),  # int32 entries, another owner
    ]
    idle = torch.zeros(32, dtype=torch.int64, device=device)
    replays = [
        (idle - 1, idle, idle, idle, None),
        (*_request(torch.arange(80, 112, device=device)), None),
        (*shifted(torch.arange(32, device=device)), None),
    ]
    return Program(
        fn, batches, replays, expect,
        state=lambda: {"rows": _ring_rows(canary.poll()), "stats": canary.stats()},
        expected_state=lambda: {"rows": sorted(rows)},
    )  # fmt: skip


# digest -------------------------------------------------------------------------------------


def _digest_samples(device: str) -> list[tuple]:
    samples = []
    for seed in range(5):
        views, offsets, slots, positions, groups, num_groups = random_digest_case(seed, device)
        views = [ops.integer_view(v) for v in views]
        samples.append((views, slots, positions, groups, offsets, num_groups, True))
        samples.append((views, slots, positions, None, offsets, 1, False))
    pool = torch.randn(4, 2, 3, 8, device=device)  # a float view works too (not float8: see _fold_samples)
    entries = torch.tensor([0, 7, -1], device=device)
    samples.append(([pool], entries, entries, None, [5], 2, True))
    return samples


UNIT_OFFSETS = [0, 2, 4]


def _request_digest(pool, scales, slots, positions, groups):
    return kc.kv_digest([pool[0], pool[1], scales], slots, positions, unit_offsets=UNIT_OFFSETS, groups=groups, num_groups=3)


def _digest_program(device: str) -> Program:
    gen = torch.Generator().manual_seed(0)
    pool = random_bytes([2, 6, 4, 2, 16], torch.bfloat16, gen, device)  # capacity 24
    scales = random_bytes([6, 4, 2], torch.float32, gen, device)

    def entries(n: int) -> tuple[torch.Tensor, ...]:
        slots = torch.randint(-1, 24, (n,), generator=gen).to(device)
        positions = torch.randint(0, 99, (n,), generator=gen).to(device)
        return slots, positions, torch.randint(0, 3, (n,), generator=gen).to(device)

    batches = [(pool, scales, *entries(n)) for n in (3, 17, 24)]
    slots = torch.tensor([0, 5, -1, 23, 30], device=device)  # 30 is past the capacity: a replay leaves it out
    past_capacity = (slots, torch.arange(5, device=device), torch.tensor([0, 1, 2, 1, 0], device=device))
    replays = [(pool, scales, *entries(5)), (pool, scales, *past_capacity), (pool, scales, *entries(5))]

    def expect(pool, scales, slots, positions, groups):
        views = [pool[0], pool[1], scales]
        return spec_oracle.digest(views, _as_padding(slots, 24), positions, UNIT_OFFSETS, groups, num_groups=3)

    return Program(_request_digest, batches, replays, expect)


# refold -------------------------------------------------------------------------------------


def _refold_samples(device: str) -> list[tuple]:
    _, canary = _canary(device)
    slots = torch.tensor([3, -1, 90, 4], device=device)
    return [
        (canary._views, canary._read_bytes, slots, canary._records, True),
        (canary._views, canary._read_bytes, slots.int()[::2], canary._records, False),  # int32, strided
    ]


def _refold_program(device: str) -> Program:
    kv, canary = _canary(device)
    oracle = spec_oracle.Records(canary.capacity)
    slots, positions, tokens, prev_slots = _request(torch.arange(canary.capacity, device=device))
    canary.record(slots, positions=positions, tokens=tokens, prev_slots=prev_slots)
    oracle.record(_ints(slots), _reference_folds(canary, slots), **_oracle_inputs(positions, tokens, prev_slots, None))
    kv[0, 1:3] += 1  # the K bytes of slots 16 .. 47 change

    def fn(slots):
        canary.refold(slots)
        return canary.records

    def expect(slots):
        for slot, fold in zip(_ints(slots), _reference_folds(canary, slots)):
            if 0 <= slot < canary.capacity:
                oracle.records[slot][3] = fold
        return oracle.records

    batches = [(_longs([16, -1, 17], device),), (torch.arange(18, 40, dtype=torch.int32, device=device),), (_longs([], device),)]
    replays = [(_longs([-1] * 8, device),), (torch.arange(40, 48, device=device),), (_longs([16, 20, 24, 28, 32, 36, 40, 44], device),)]
    return Program(fn, batches, replays, expect)


# paged_step ---------------------------------------------------------------------------------


WHOLE_STEP, BEFORE_FORWARD, AFTER_FORWARD = paged_step.StepPhase


def _paged_step_sample(
    device: str, *, table_dtype=torch.int32, tokens=True, every=1, phase=WHOLE_STEP, roots=False
) -> tuple[kc.KvCanary, tuple]:
    """The canary and paged_step's arguments for step 1 of two requests over two KV cache groups (full
    attention; a sliding window of 8) of a fresh canary (padding slot 0, the null block),
    after step 0 prefilled them: each runs one more token. The step buffers are padded past
    the step's requests and tokens, as an engine keeps them. A clean step: no ring row, so
    CUDA, which claims rows in no fixed order, gives opcheck the same results every run (with
    ``roots``, both steps give each request its root). The arguments hold the canary's
    sources table, which lives as long as the canary."""
    kv = _kv_pool(device)  # 8 blocks of 16
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None, padding_slot=0)
    blocks = ([[1, 2], [3, 0], [0, 0]], [[4, 5], [6, 0], [0, 0]])  # per group, a row per request and a padding row
    tables = [torch.tensor(rows, dtype=table_dtype, device=device) for rows in blocks]
    mappings = [torch.full((28,), -1, dtype=torch.int64, device=device) for _ in tables]
    step = paged_step.PagedStep(canary, tables, mappings, block_size=16, sliding_windows=[0, 8])
    history = (torch.arange(2 * 32, dtype=torch.int32) * 7 % 101).reshape(2, 32)
    history_rows = [1, 0, 0]

    def buffers(runs: list[tuple[int, int]]) -> tuple:
        """The step buffers of requests each running ``n`` tokens after ``c`` in the cache."""
        qsl, seq_lens, positions, input_ids = [0], [], [], []
        for r, (c, n) in enumerate(runs):
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            positions += range(c, c + n)
            input_ids += history[history_rows[r], c : c + n].tolist()
        for table, mapping in zip(tables, mappings):
            slots = [int(table[r, p // 16]) * 16 + p % 16 for r, (c, n) in enumerate(runs) for p in range(c, c + n)]
            mapping.fill_(-1)[: len(slots)] = torch.tensor(slots, device=device)

        def padded(values: list[int], size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values + [0] * (size - len(values)), dtype=dtype, device=device)

        return (padded(qsl, 4, torch.int32), padded(seq_lens, 3, torch.int32), padded(positions, 24, torch.int64),
                padded(input_ids, 24, torch.int32), qsl[-1])  # fmt: skip

    history, history_rows = history.to(device), torch.tensor(history_rows, dtype=torch.int32, device=device)
    request_roots = torch.tensor([-5, 1 << 50, 0], dtype=torch.int64, device=device) if roots else None
    *step0, num_tokens = buffers([(0, 20), (0, 5)])
    for step0_phase in [WHOLE_STEP] if phase == WHOLE_STEP else [BEFORE_FORWARD, AFTER_FORWARD]:
        step(
            *step0, num_reqs=2, num_tokens=num_tokens, step=0, phase=step0_phase, history=history, history_rows=history_rows,
            roots=request_roots,
        )  # fmt: skip
    qsl, seq_lens, positions, input_ids, num_tokens = buffers([(20, 1), (5, 1)])
    checked = (input_ids, history, torch.ones_like(history, dtype=torch.bool), history_rows) if tokens else (None,) * 4
    # The mailbox on the canary's device (which CUDA takes too): opcheck's copies of a pinned
    # host mailbox would not be pinned.
    *tables, mailbox, scratch = step._tables
    tables = (*tables, mailbox.to(device), scratch)
    args = (*step._groups, qsl, seq_lens, positions, *checked, *tables, 2, num_tokens, 16, int(phase), 1, every, 0)
    return canary, args if request_roots is None else (*args, request_roots)


def _paged_step_samples(device: str) -> Iterator[tuple]:
    # One at a time, each canary alive while its sample is used.
    variants = [{}, {"table_dtype": torch.int64, "tokens": False, "every": 2}, {"roots": True}]
    if device == "cpu":  # the two calls of a block-packed backend's step: CPU backends only
        variants += [{"phase": BEFORE_FORWARD}, {"phase": AFTER_FORWARD}]
    for variant in variants:
        canary, args = _paged_step_sample(device, **variant)
        yield args


OPS = [
    OpCase("fold", _fold_samples, _fold_program),
    OpCase("record", _record_samples, _record_program),
    OpCase("verify", _verify_samples, _verify_program),
    OpCase("digest", _digest_samples, _digest_program),
    OpCase("refold", _refold_samples, _refold_program),
]

# Ops without tensors, and the values each may return. They describe the library to the
# host and are called outside any graph (a string has no place in one), so of the contracts
# only opcheck's schema, autograd-registration and fake-tensor checks apply to them.
HOST_QUERIES = {
    "canary_counters": [["record_calls", "verify_calls", "slots_recorded", "slots_verified", "violations", "ring_write", "ring_overflow"]],
    "cpu_isa": ["scalar", "avx2", "avx512"],
}
HOST_QUERY_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")

# Ops that answer a size on the host from int arguments, for a caller to allocate by once:
# the same checks as the queries', on their samples.
HOST_SIZES = {"paged_step_scratch_size": [(1, 0, 0, 0), (2, 64, 8, 1024), (8, 4096, 256, 1 << 20)]}

# Ops that are a serving step's whole canary work, called through an object bound to the
# engine's own step buffers (paged_step: PagedStep). Their samples on a device; of the
# contracts, opcheck's apply here (the op against its spec: tests/ops/test_paged_step.py).
STEP_OPS = {"paged_step": _paged_step_samples}

CUDA_DEVICES = [device for device in DEVICES if device != "cpu"]  # with their skip mark where there is no GPU


# The ops' bound overloads (`op.bound`: the sources as one table of bind_sources), each with
# how its arguments follow from those of the op's Tensor[] form; and bind_sources itself,
# host work whatever the sources' device.
def _bound_args(args: tuple) -> tuple:
    sources, read_bytes, *rest = args
    return (torch.ops.kvcanary.bind_sources(sources, read_bytes), *rest)


def _bound_fold_args(args: tuple) -> tuple:
    sources, slots, read_bytes, check_bounds = args
    return torch.ops.kvcanary.bind_sources(sources, read_bytes), slots, check_bounds


BOUND = {"fold": _bound_fold_args, "record": _bound_args, "verify": _bound_args, "refold": _bound_args}
BOUND_CASES = [case for case in OPS if case.op in BOUND]


def test_every_op_is_in_a_table():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("kvcanary::")}
    bound = {f"{op}.bound" for op in BOUND} | {"bind_sources"}
    assert registered == {case.op for case in OPS} | set(HOST_QUERIES) | set(HOST_SIZES) | set(STEP_OPS) | bound


# --- the contracts ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPS, ids=[case.op for case in OPS])
def test_opcheck(case, device):
    op = getattr(torch.ops.kvcanary, case.op).default
    for args in case.samples(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BOUND_CASES, ids=[case.op for case in BOUND_CASES])
def test_bound_opcheck(case, device):
    op = getattr(torch.ops.kvcanary, case.op).bound
    for args in case.samples(device):
        torch.library.opcheck(op, BOUND[case.op](args))


@pytest.mark.parametrize("device", DEVICES)
def test_bind_sources_opcheck(device):
    # Its table holds the sources' addresses, which opcheck's copies of them do not share: of
    # the contracts, those that do not compare values apply.
    for sources, _, read_bytes, _ in _fold_samples(device):
        torch.library.opcheck(torch.ops.kvcanary.bind_sources.default, (sources, read_bytes), test_utils=HOST_QUERY_CHECKS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(STEP_OPS))
def test_step_op_opcheck(name, device):
    op = getattr(torch.ops.kvcanary, name).default
    for args in STEP_OPS[name](device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", sorted(HOST_QUERIES))
def test_host_query_opcheck(name):
    op = getattr(torch.ops.kvcanary, name).default
    torch.library.opcheck(op, (), test_utils=HOST_QUERY_CHECKS)
    assert op() in HOST_QUERIES[name]


@pytest.mark.parametrize("name", sorted(HOST_SIZES))
def test_host_size_opcheck(name):
    op = getattr(torch.ops.kvcanary, name).default
    for args in HOST_SIZES[name]:
        torch.library.opcheck(op, args, test_utils=HOST_QUERY_CHECKS)
        assert op(*args) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPS, ids=[case.op for case in OPS])
def test_compile_fullgraph_dynamic(case, device):
    torch._dynamo.reset()
    compiled, eager = case.program(device), case.program(device)
    step = torch.compile(compiled.fn, fullgraph=True, dynamic=True)
    for args, same_args in zip(compiled.batches, eager.batches, strict=True):
        got = step(*args).tolist()
        assert got == eager.fn(*same_args).tolist()
        assert got == compiled.expect(*args)
    state, expected = compiled.state(), compiled.expected_state()
    assert state == eager.state()
    assert {key: state[key] for key in expected} == expected


def _refill(static: tuple, args: tuple) -> None:
    for into, value in zip(static, args, strict=True):
        assert (into is None) == (value is None), "every replay gives the same arguments"
        if isinstance(into, torch.Tensor) and value is not into:
            assert value.shape == into.shape and value.dtype == into.dtype, "every replay has the captured shapes"
            into.copy_(value)


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("case", OPS, ids=[case.op for case in OPS])
def test_cuda_graph_replay_with_inputs_refilled_in_place(case, device):
    program = case.program(device)
    static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in program.replays[0])
    assert program.fn(*static).tolist() == program.expect(*static)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = program.fn(*static)
    for args in program.replays[1:]:
        _refill(static, args)
        graph.replay()
        assert out.tolist() == program.expect(*args)
    expected = program.expected_state()
    assert {key: program.state()[key] for key in expected} == expected


# --- the rest of the PT2 stack ---------------------------------------------------------------


class _KV(torch.nn.Module):
    def forward(self, pool, slots):
        return _k_and_v(pool, slots)


@pytest.mark.parametrize("device", DEVICES)
def test_export(device):
    pool = torch.randint(0, 255, (2, 6, 4, 2, 16), dtype=torch.uint8).to(device)
    slots = torch.tensor([0, 5, -1, 23], device=device)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(_KV(), (pool, slots), dynamic_shapes=({}, {0: batch}))
    assert any(n.target is torch.ops.kvcanary.fold.default for n in exported.graph.nodes)
    longer = torch.tensor([1, 2, 3, 4, 5, 6, -1], device=device)
    assert torch.equal(exported.module()(pool, longer), _k_and_v(pool, longer))


def test_fold_on_meta_tensors():
    pool = torch.empty(2, 6, 4, 2, 16, dtype=torch.uint8, device="meta")
    out = _k_and_v(pool, torch.empty(5, 3, dtype=torch.int32, device="meta"))
    assert out.device.type == "meta" and out.shape == (5, 3) and out.dtype == torch.int64


def test_digest_on_meta_tensors():
    pool = torch.empty(2, 6, 4, 2, 16, dtype=torch.bfloat16, device="meta")
    scales = torch.empty(6, 4, 2, dtype=torch.float32, device="meta")
    entries = torch.empty(5, 3, dtype=torch.int32, device="meta")
    out = _request_digest(pool, scales, entries, entries, entries)
    assert out.device.type == "meta" and out.shape == (3,) and out.dtype == torch.int64


def test_the_library_names_no_module_for_its_fake_kernels():
    # The package registers the fake kernels when it loads the library, so they are there
    # whenever the ops are. The library defines its ops the stable-ABI way at the floor (2.10),
    # where the stable ABI cannot name their module to torch (set_python_module, from 2.13 on).
    stubs = {op: torch._C._dispatch_pystub(f"kvcanary::{op}", "") for op in ("fold", "record", "verify", "digest", "refold")}
    assert stubs == dict.fromkeys(stubs)
