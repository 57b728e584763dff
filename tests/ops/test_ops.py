"""torch.ops.kvcanary.fold through the public `fold`: golden vectors, random layouts
against the reference, result shapes, modes and padding. The PT2 contracts are in
test_op_contracts.py."""

import random
import sys

import pytest
import torch
from golden import load_golden
from helpers import (
    DEVICES,
    golden_source,
    random_case,
    random_row_source,
    random_slots,
    random_view_source,
)

import torch_kvcanary as kc

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

GOLDEN = load_golden()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GOLDEN, ids=[f"{c['name']}-{c['mode']}" for c in GOLDEN])
def test_golden(case, device):
    sources = [golden_source(spec, device) for spec in case["sources"]]
    mode = kc.HashMode[case["mode"]]
    expected = torch.tensor(case["expected"], dtype=torch.int64)
    for dtype in (torch.int64, torch.int32):
        slots = torch.tensor(case["slots"], dtype=dtype, device=device)
        assert torch.equal(kc.fold(sources, slots, mode=mode).cpu(), expected)
    assert torch.equal(kc.reference_fold(sources, slots, mode=mode).cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60))
def test_random_layouts_match_reference(seed, device):
    sources, slots, mode = random_case(seed, device)
    assert torch.equal(kc.fold(sources, slots, mode=mode), kc.reference_fold(sources, slots, mode=mode))


@pytest.mark.parametrize("device", DEVICES)
def test_result_is_shaped_like_slots(device):
    gen = torch.Generator().manual_seed(0)
    source = random_view_source(random.Random(1), gen, device)
    slots = torch.tensor([[0, -1, 1], [1, 0, -5]], device=device)
    out = kc.fold(source, slots)
    assert out.shape == (2, 3) and out.dtype == torch.int64
    assert torch.equal(out.flatten(), kc.fold(source, slots.flatten()))
    assert torch.equal(kc.fold(source, slots.t()), out.t())  # non-contiguous slots
    assert kc.fold(source, slots[:0]).shape == (0, 3)
    assert (out[slots < 0] == 0).all() and (out[slots >= 0] != 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_off_and_empty_sources_give_zeros(device):
    source = kc.view_source(torch.ones(4, 2, 16, dtype=torch.uint8, device=device), read_bytes=16)
    slots = torch.tensor([0, 1, 7], device=device)
    assert torch.equal(kc.fold(source, slots, mode=kc.HashMode.OFF), torch.zeros(3, dtype=torch.int64, device=device))
    assert torch.equal(kc.fold([], slots), torch.zeros(3, dtype=torch.int64, device=device))
    zero_read = kc.view_source(torch.ones(4, 2, 16, dtype=torch.uint8, device=device), read_bytes=0)
    assert torch.equal(kc.fold([zero_read, source], slots), kc.fold(source, slots))


@pytest.mark.parametrize("device", DEVICES)
def test_partial_reads_sixteen_bytes(device):
    pool = torch.zeros(8, 64, dtype=torch.uint8, device=device)
    source = kc.make_row_source(layer_buffer=pool, read_bytes=sys.maxsize)
    slots = torch.arange(8, device=device)
    before = [kc.fold(source, slots, mode=m) for m in (kc.HashMode.PARTIAL, kc.HashMode.ALL)]
    pool[3, 16] = 1  # past the first 16 bytes
    assert torch.equal(kc.fold(source, slots, mode=kc.HashMode.PARTIAL), before[0])
    changed = kc.fold(source, slots) != before[1]
    assert changed.tolist() == [s == 3 for s in range(8)]


@pytest.mark.parametrize("device", DEVICES)
def test_many_sources_in_one_call(device):
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    sources = [random_row_source(rng, gen, device) for _ in range(24)]
    capacity = min(s.capacity for s in sources)
    slots = random_slots(rng, capacity, 50, device=device)
    assert torch.equal(kc.fold(sources, slots), kc.reference_fold(sources, slots))


def test_check_bounds_off_gives_zero_for_out_of_range():
    source = kc.view_source(torch.ones(2, 4, 16, dtype=torch.uint8), read_bytes=16)
    out = kc.fold(source, torch.tensor([7, 8, 1 << 40, -1]), check_bounds=False)
    assert out[0] != 0 and out[1:].tolist() == [0, 0, 0]
