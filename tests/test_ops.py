"""torch.ops.kvcanary.fold through the public `fold`: golden vectors, random layouts
against the reference, the PT2 stack (opcheck, compile, export, meta) and bad input."""

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
from torch_kvcanary import ops

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


# --- the PT2 stack ---------------------------------------------------------------------------


def _opcheck_samples(device):
    rng = random.Random(7)
    samples = []
    for seed in range(6):
        sources, slots, _ = random_case(seed, device)
        views = [s.as_view() for s in sources]
        samples.append((views, slots, [s.read_bytes for s in sources], True))
    pool = torch.randint(0, 255, (4, 16, 32), dtype=torch.uint8, device=device)
    samples.append(([pool], torch.empty(0, dtype=torch.int64, device=device), [32], True))
    samples.append(([], random_slots(rng, 10, 5, device=device), [], False))
    return samples


def _as_the_shim_passes(args):
    views, slots, read_bytes, check = args
    return [ops.integer_view(v) for v in views], slots, read_bytes, check


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in _opcheck_samples(device):
        torch.library.opcheck(torch.ops.kvcanary.fold.default, _as_the_shim_passes(args))
    # float views work too, except float8: opcheck compares inputs with arithmetic float8
    # lacks, which is why `fold` passes every view as an integer dtype of its size
    pool = torch.randn(4, 2, 2, 8, device=device)
    torch.library.opcheck(torch.ops.kvcanary.fold.default, ([pool], torch.tensor([0, 7, -1], device=device), [64], True))


def _k_and_v(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # vLLM-style [2, blocks, block_size, heads, dim] pool: K and V halves as two sources.
    sources = [kc.view_source(pool[i], read_bytes=kc.resolve_read_bytes(kc.HashMode.ALL)) for i in range(2)]
    return kc.fold(sources, slots)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic(device):
    torch._dynamo.reset()
    compiled = torch.compile(_k_and_v, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 255, (2, 6, 4, 2, 16), dtype=torch.uint8, generator=gen).to(device)
    for n in (3, 17, 24):
        slots = torch.randint(-1, 24, (n,), generator=gen).to(device)
        assert torch.equal(compiled(pool, slots), _k_and_v(pool, slots))
    bigger = torch.randint(0, 255, (2, 9, 4, 2, 32), dtype=torch.uint8, generator=gen).to(device)
    slots = torch.randint(-1, 36, (11,), generator=gen).to(device)
    assert torch.equal(compiled(bigger, slots), _k_and_v(bigger, slots))


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


def test_meta_tensors():
    pool = torch.empty(2, 6, 4, 2, 16, dtype=torch.uint8, device="meta")
    out = _k_and_v(pool, torch.empty(5, 3, dtype=torch.int32, device="meta"))
    assert out.device.type == "meta" and out.shape == (5, 3) and out.dtype == torch.int64


def test_the_library_names_the_module_of_its_fake_kernels():
    # torch imports (or asks for) this module when a fake kernel is needed before it was loaded.
    assert torch._C._dispatch_pystub("kvcanary::fold", "")[0] == "torch_kvcanary.ops"
