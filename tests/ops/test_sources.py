"""The upstream read_bytes contract and the source helpers (views, never copies)."""

import sys

import expecttest
import pytest
import torch

import torch_kvcanary as kc
from torch_kvcanary.sources import token_bytes


def test_read_align_and_modes():
    assert kc.READ_ALIGN == 16
    assert [int(m) for m in (kc.HashMode.OFF, kc.HashMode.PARTIAL, kc.HashMode.ALL)] == [0, 1, 2]
    assert [kc.resolve_read_bytes(m) for m in kc.HashMode] == [0, 16, sys.maxsize]


@pytest.mark.parametrize(
    "requested, nb, expected",
    [(0, 64, 0), (sys.maxsize, 64, 64), (16, 64, 16), (64, 64, 64), (48, 64, 48), (0, 16, 0)],
)
def test_clip_read_bytes_values(requested, nb, expected):
    assert kc.clip_read_bytes(requested=requested, num_bytes_per_token=nb) == expected


def _shares_memory(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


class TestRealKvSource(expecttest.TestCase):
    def test_as_view_is_the_row_window(self):
        pool = torch.arange(3 * 80, dtype=torch.int32).view(3, 80).to(torch.uint8)
        view = kc.RealKvSource(tensor=pool, page_size=2, num_bytes_per_token=32, read_bytes=16).as_view()
        assert view.shape == (3, 2, 32) and _shares_memory(view, pool)
        assert torch.equal(view[1, 1], pool[1, 32:64])


def test_make_row_source_gives_byte_rows_like_upstream():
    layer = torch.zeros(10, 4, 16, dtype=torch.bfloat16)
    (source,) = kc.make_row_source(layer_buffer=layer, read_bytes=sys.maxsize)
    assert source.tensor.dtype == torch.uint8 and source.tensor.shape == (10, 128)
    assert source.tensor.data_ptr() == layer.data_ptr()


def test_make_row_source_views_a_strided_layer_without_copy():
    # K half of a fused [slots, 2, heads, dim] buffer: rows are not contiguous across slots.
    fused = torch.randn(10, 2, 4, 16, dtype=torch.bfloat16)
    (source,) = kc.make_row_source(layer_buffer=fused[:, 0], read_bytes=sys.maxsize)
    assert source.page_size == 1 and source.num_bytes_per_token == 4 * 16 * 2 and source.read_bytes == 128
    view = source.as_view()
    assert _shares_memory(view, fused) and view.data_ptr() == fused.data_ptr()
    slots = torch.arange(10)
    copied = kc.make_row_source(layer_buffer=fused[:, 0].contiguous(), read_bytes=sys.maxsize)
    assert torch.equal(kc.fold(source, slots), kc.fold(copied, slots))


def test_make_row_source_non_mergeable_token_dims():
    # A head-strided layer (dims 1.. not one run) still folds every byte of the token, in order.
    pool = torch.randint(0, 255, (6, 3, 64), dtype=torch.uint8)
    layer = pool[:, :, :32]
    (source,) = kc.make_row_source(layer_buffer=layer, read_bytes=sys.maxsize)
    assert _shares_memory(source.as_view(), pool)
    (copied,) = kc.make_row_source(layer_buffer=layer.contiguous(), read_bytes=sys.maxsize)
    slots = torch.arange(6)
    assert torch.equal(kc.fold(source, slots), kc.fold(copied, slots))


@pytest.mark.parametrize("read_bytes, buffer", [(0, torch.zeros(4, 16)), (16, torch.zeros(0, 16)), (16, torch.zeros(()))])
def test_make_row_source_empty(read_bytes, buffer):
    assert kc.make_row_source(layer_buffer=buffer, read_bytes=read_bytes) == ()


def test_make_row_source_clips_like_upstream():
    (source,) = kc.make_row_source(layer_buffer=torch.zeros(4, 8, dtype=torch.float32), read_bytes=16)
    assert (source.num_bytes_per_token, source.read_bytes) == (32, 16)


def test_make_packed_source():
    pages = torch.zeros(5, 16, 2, 32, dtype=torch.float16)  # [pages, page_size, heads, dim]
    (source,) = kc.make_packed_source(page_buffer=pages, page_size=16, bytes_per_token=128, read_bytes=sys.maxsize)
    # like upstream, the tensor is the buffer's bytes per page: here a view, not a copy
    assert source.read_bytes == 128 and source.tensor.dtype == torch.uint8 and source.tensor.shape == (5, 16 * 128)
    assert source.as_view().shape == (5, 16, 128) and source.as_view().data_ptr() == pages.data_ptr()
    (flat,) = kc.make_packed_source(page_buffer=torch.zeros(256, dtype=torch.uint8), page_size=4, bytes_per_token=64, read_bytes=32)
    assert flat.tensor.shape == (1, 256) and flat.as_view().shape == (1, 4, 64)
    assert kc.make_packed_source(page_buffer=pages, page_size=16, bytes_per_token=128, read_bytes=0) == ()
    assert kc.make_packed_source(page_buffer=pages[:0], page_size=16, bytes_per_token=128, read_bytes=16) == ()
    a = kc.make_packed_source(page_buffer=pages, page_size=16, bytes_per_token=128, read_bytes=16)
    assert len(a + kc.make_row_source(layer_buffer=pages.view(80, 64), read_bytes=16)) == 2


def test_view_source():
    cache = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16)  # HF [batch, heads, max_len, dim]
    source = kc.view_source(cache.permute(0, 2, 1, 3), read_bytes=sys.maxsize)
    assert source.read_bytes == token_bytes(source.view) == 4 * 16 * 2
    assert kc.view_source(cache, read_bytes=0).read_bytes == 0


def test_every_source_knows_its_capacity_and_device():
    rows = kc.RealKvSource(tensor=torch.zeros(5, 96, dtype=torch.uint8), page_size=3, num_bytes_per_token=32, read_bytes=16)
    view = kc.view_source(torch.zeros(4, 16, 2, 8, dtype=torch.float16).permute(0, 2, 1, 3), read_bytes=16)
    assert isinstance(rows, kc.sources.KvSource) and isinstance(view, kc.sources.KvSource)
    assert (rows.capacity, view.capacity) == (5 * 3, 4 * 2)
    assert rows.device == view.device == torch.device("cpu")


def test_read_bytes_in_mode():
    source = kc.view_source(torch.zeros(4, 2, 64, dtype=torch.uint8), read_bytes=48)
    modes = (kc.HashMode.OFF, kc.HashMode.PARTIAL, kc.HashMode.ALL)
    assert [kc.sources.folded_bytes(source, m) for m in modes[1:]] == [16, 48]
    assert [kc.sources.read_bytes_in_mode(m, 48) for m in modes] == [0, 16, 48]
