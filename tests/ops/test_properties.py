"""Property tests: on any layout hypothesis draws (row and view forms, strides, holes,
storage offsets, dtypes with fp8, page sizes, up to 8 sources, padding, int32 slots,
empty inputs), the C++ kernels equal the pure-torch reference bit for bit."""

import pytest
import torch
from helpers import DEVICES, DTYPES
from hypothesis import given
from hypothesis import strategies as st

import torch_kvcanary as kc


@st.composite
def view_sources(draw, device):
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_chunk = 16 // itemsize
    pages, page_size = draw(st.integers(0, 5)), draw(st.integers(1, 17))
    token = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)) + [per_chunk * draw(st.integers(1, 4))]
    pads = [draw(st.integers(0, 2)), draw(st.integers(0, 1))] + [draw(st.integers(0, 1)) for _ in token[:-1]]
    pads.append(per_chunk * draw(st.integers(0, 2)))
    sizes = [pages, page_size] + token
    order = draw(st.permutations(range(len(sizes) - 1)))  # memory order of all but the innermost dim
    base_shape = [sizes[i] + pads[i] for i in order] + [sizes[-1] + pads[-1]]
    offset_chunks = draw(st.integers(0, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    flat = torch.randint(0, 256, (offset_chunks * 16 + torch.Size(base_shape).numel() * itemsize,), dtype=torch.uint8, generator=gen)
    base = flat[offset_chunks * 16 :].view(dtype).view(base_shape).to(device)
    inverse = [order.index(i) for i in range(len(order))]
    view = base.permute(*inverse, len(order))[tuple(slice(0, n) for n in sizes)]
    token_bytes = torch.Size(token).numel() * itemsize
    read_bytes = draw(st.sampled_from([2**63 - 1, 0, 16 * draw(st.integers(1, token_bytes // 16))]))
    return kc.view_source(view, read_bytes=read_bytes)


@st.composite
def row_sources(draw, device):
    page_size, token = draw(st.integers(1, 5)), 16 * draw(st.integers(1, 5))
    rows, tail, gap = draw(st.integers(1, 6)), 16 * draw(st.integers(0, 2)), 16 * draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    buffer = torch.randint(0, 256, (rows, page_size * token + tail + gap), dtype=torch.uint8, generator=gen).to(device)
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float8_e4m3fn, torch.int32]))
    tensor = buffer[:, : page_size * token + tail].view(dtype)
    return kc.RealKvSource(tensor=tensor, page_size=page_size, num_bytes_per_token=token, read_bytes=16 * draw(st.integers(1, token // 16)))


@st.composite
def fold_cases(draw, device):
    sources = draw(st.lists(st.one_of(view_sources(device), row_sources(device)), min_size=0, max_size=8))
    capacity = min((s.capacity for s in sources), default=50)
    slot = st.integers(-3, capacity - 1) if capacity > 0 else st.integers(-3, -1)
    slots = draw(st.lists(slot, min_size=0, max_size=80))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    mode = draw(st.sampled_from(list(kc.HashMode)))
    return sources, torch.tensor(slots, dtype=dtype, device=device), mode


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_equals_reference(device):
    @given(fold_cases(device))
    def check(case):
        sources, slots, mode = case
        assert torch.equal(kc.fold(sources, slots, mode=mode), kc.reference_fold(sources, slots, mode=mode))

    check()


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_slots_unchecked_give_zero(device):
    @given(fold_cases(device), st.lists(st.integers(0, 2**40), min_size=1, max_size=10))
    def check(case, beyond):
        sources, slots, mode = case
        active = [s for s in sources if s.read_bytes > 0]  # sources that read nothing are left out
        if not active:
            return
        capacity = min(s.capacity for s in active)
        wild = torch.tensor([capacity + b for b in beyond], dtype=torch.int64, device=device)
        mixed = torch.cat([slots.long(), wild])
        out = kc.fold(sources, mixed, mode=mode, check_bounds=False)
        assert torch.equal(out[: len(slots)], kc.fold(sources, slots.long(), mode=mode))
        assert (out[len(slots) :] == 0).all()

    check()
