"""Every invalid argument of every public function and of the raw op raises a Python
exception whose message starts with `kv-canary:` and names what to change; none crashes,
reads out of bounds (the sanitizer job runs this file) or copies a pool."""

import sys

import pytest
import torch

import torch_kvcanary as kc
from torch_kvcanary import layouts

U8 = torch.zeros(4, 2, 64, dtype=torch.uint8)  # a good view: 4 pages of 2 slots of 64 bytes
ROWS = torch.zeros(8, 64, dtype=torch.uint8)
SLOTS = torch.tensor([0, 1])
GOOD = kc.view_source(U8, read_bytes=64)
op = torch.ops.kvcanary.fold.default

# (name, call, exception, message start after "kv-canary: ")
CASES = [
    # the read_bytes contract
    ("clip: token not a multiple of 16", lambda: kc.clip_read_bytes(requested=16, num_bytes_per_token=24), ValueError, "num_bytes_per_token must be a positive multiple of 16"),
    ("clip: negative", lambda: kc.clip_read_bytes(requested=-32, num_bytes_per_token=64), ValueError, "read_bytes must be non-negative"),
    ("clip: too large", lambda: kc.clip_read_bytes(requested=80, num_bytes_per_token=64), ValueError, "read_bytes must be <= num_bytes_per_token (64)"),
    ("clip: unaligned", lambda: kc.clip_read_bytes(requested=20, num_bytes_per_token=64), ValueError, "read_bytes must be a multiple of 16"),
    ("clip: float", lambda: kc.clip_read_bytes(requested=16.0, num_bytes_per_token=64), TypeError, "read_bytes must be an int"),
    ("clip: string token", lambda: kc.clip_read_bytes(requested=16, num_bytes_per_token="64"), TypeError, "num_bytes_per_token must be an int"),
    ("mode: unknown", lambda: kc.resolve_read_bytes(5), ValueError, "mode must be a HashMode"),
    # RealKvSource
    ("source: page_size 0", lambda: kc.RealKvSource(tensor=ROWS, page_size=0, num_bytes_per_token=64, read_bytes=64), ValueError, "RealKvSource.page_size must be >= 1"),
    ("source: page_size float", lambda: kc.RealKvSource(tensor=ROWS, page_size=1.5, num_bytes_per_token=64, read_bytes=64), TypeError, "RealKvSource.page_size must be an int"),
    ("source: token 40", lambda: kc.RealKvSource(tensor=ROWS, page_size=1, num_bytes_per_token=40, read_bytes=16), ValueError, "RealKvSource.num_bytes_per_token must be a positive multiple of 16"),
    ("source: read 0", lambda: kc.RealKvSource(tensor=ROWS, page_size=1, num_bytes_per_token=64, read_bytes=0), ValueError, "RealKvSource.read_bytes must be a positive multiple of 16"),
    ("source: 1-D", lambda: kc.RealKvSource(tensor=ROWS[0], page_size=1, num_bytes_per_token=64, read_bytes=64), ValueError, "RealKvSource.tensor must be at least 2-D"),
    ("source: not a tensor", lambda: kc.RealKvSource(tensor=[1, 2], page_size=1, num_bytes_per_token=64, read_bytes=64), TypeError, "RealKvSource.tensor must be a torch.Tensor"),
    ("source: sparse", lambda: kc.RealKvSource(tensor=ROWS.to_sparse(), page_size=1, num_bytes_per_token=64, read_bytes=64), ValueError, "RealKvSource.tensor must be a strided (dense) tensor"),
    ("source: page larger than row", lambda: kc.RealKvSource(tensor=ROWS, page_size=2, num_bytes_per_token=64, read_bytes=64), ValueError, "RealKvSource page of 2 x 64 bytes does not fit"),
    ("source: rows need a copy", lambda: kc.fold(kc.RealKvSource(tensor=torch.zeros(4, 4, 24, dtype=torch.uint8)[:, :, :16], page_size=2, num_bytes_per_token=32, read_bytes=16), SLOTS), ValueError, "RealKvSource.tensor with shape (4, 4, 16)"),
    # helpers
    ("row source: not a tensor", lambda: kc.make_row_source(layer_buffer=None, read_bytes=16), TypeError, "layer_buffer must be a torch.Tensor"),
    ("row source: token 12 bytes", lambda: kc.make_row_source(layer_buffer=torch.zeros(4, 3), read_bytes=16), ValueError, "num_bytes_per_token must be a positive multiple of 16, got 12"),
    ("packed source: not a tensor", lambda: kc.make_packed_source(page_buffer=3, page_size=1, bytes_per_token=16, read_bytes=16), TypeError, "page_buffer must be a torch.Tensor"),
    ("packed source: page too big", lambda: kc.make_packed_source(page_buffer=ROWS, page_size=4, bytes_per_token=32, read_bytes=16), ValueError, "RealKvSource page of 4 x 32 bytes does not fit"),
    ("view source: rank 1", lambda: kc.view_source(torch.zeros(64, dtype=torch.uint8), read_bytes=16), ValueError, "view_source needs a view [num_pages, page_size, *token_shape]"),
    ("view source: token 8 bytes", lambda: kc.view_source(torch.zeros(4, 2, 8, dtype=torch.uint8), read_bytes=16), ValueError, "num_bytes_per_token must be a positive multiple of 16, got 8"),
    ("layouts: vllm without layout", lambda: layouts.vllm(torch.zeros(2, 4, 16, 2, 64)), ValueError, "layouts.vllm needs layout="),
    ("layouts: trtllm halves", lambda: layouts.trtllm_block_pool(torch.zeros(4, 3, 2, 16, 8)), ValueError, "a block pool is [num_blocks, 2, heads, tokens_per_block, head_dim]"),
    # fold
    ("fold: mode", lambda: kc.fold(GOOD, SLOTS, mode=-1), ValueError, "mode must be a HashMode"),
    ("fold: mode bool", lambda: kc.fold(GOOD, SLOTS, mode=True), ValueError, "mode must be a HashMode"),
    ("fold: source type", lambda: kc.fold([GOOD, "K"], SLOTS), TypeError, "sources must be RealKvSource or ViewSource objects"),
    ("fold: slots list", lambda: kc.fold(GOOD, [0, 1]), TypeError, "slots must be an int32 or int64 tensor, got list"),
    ("fold: slots float", lambda: kc.fold(GOOD, SLOTS.float()), TypeError, "slots must be an int32 or int64 tensor, got Float"),
    ("fold: slots bool", lambda: kc.fold(GOOD, SLOTS.bool()), TypeError, "slots must be an int32 or int64 tensor, got Bool"),
    ("fold: slots uint8", lambda: kc.fold(GOOD, SLOTS.to(torch.uint8)), TypeError, "slots must be an int32 or int64 tensor, got Byte"),
    ("fold: slot = capacity", lambda: kc.fold(GOOD, torch.tensor([8])), IndexError, "slot 8 is out of range for sources of capacity 8"),
    ("fold: huge slot", lambda: kc.fold(GOOD, torch.tensor([0, 2**62])), IndexError, f"slot {2**62} is out of range"),
    ("fold: int32 slot", lambda: kc.fold(GOOD, torch.tensor([9], dtype=torch.int32)), IndexError, "slot 9 is out of range"),
    ("fold: innermost stride", lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 16, 2)[..., 0], read_bytes=16), SLOTS), ValueError, "source 0 must have a contiguous innermost dim"),
    ("fold: expanded innermost", lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 1, dtype=torch.uint8).expand(4, 2, 16), read_bytes=16), SLOTS), ValueError, "source 0 must have a contiguous innermost dim"),
    ("fold: short runs", lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 4, 16, dtype=torch.uint8)[..., :8], read_bytes=16), SLOTS), ValueError, "source 0 has contiguous runs of 8 bytes"),
    ("fold: slot stride", lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 24, dtype=torch.uint8)[..., :16], read_bytes=16), SLOTS), ValueError, "source 0 has a stride of 24 bytes"),
    ("fold: misaligned", lambda: kc.fold(kc.view_source(torch.zeros(600, dtype=torch.uint8)[4:516].view(4, 2, 64), read_bytes=16), SLOTS), ValueError, "source 0 starts at an address that is not 16-byte aligned"),
    ("fold: devices", lambda: kc.fold(kc.view_source(U8.to("meta"), read_bytes=16), SLOTS), ValueError, "source 0 is on meta but slots are on cpu"),
    # the raw op
    ("op: list lengths", lambda: op([U8, U8], SLOTS, [16], True), ValueError, "got 2 sources but 1 read_bytes"),
    ("op: read 0", lambda: op([U8], SLOTS, [0], True), ValueError, "read_bytes[0] must be a positive multiple of 16"),
    ("op: read negative", lambda: op([U8], SLOTS, [-16], True), ValueError, "read_bytes[0] must be a positive multiple of 16"),
    ("op: read past token", lambda: op([U8], SLOTS, [80], True), ValueError, "read_bytes[0] must be a positive multiple of 16 and <= the source's 64 bytes"),
    ("op: rank 1", lambda: op([U8.view(-1)], SLOTS, [16], True), ValueError, "source 0 must be a view [num_pages, page_size, *token_shape]"),
    ("op: empty token", lambda: op([torch.zeros(4, 2, 0, dtype=torch.uint8)], SLOTS, [16], True), ValueError, "source 0 has 0 bytes per token"),
    ("op: slots dtype", lambda: op([U8], SLOTS.short(), [16], True), TypeError, "slots must be an int32 or int64 tensor"),
    ("op: second source bad", lambda: op([U8, U8[:, :, :8]], SLOTS, [16, 16], True), ValueError, "source 1 has 8 bytes per token"),
    ("op: slot out of range", lambda: op([U8], torch.tensor([[0, 9]]), [16], True), IndexError, "slot 9 is out of range for sources of capacity 8"),
    # KvCanary
    ("canary: no sources", lambda: kc.KvCanary([]), ValueError, "KvCanary needs at least one source"),
    ("canary: capacity", lambda: kc.KvCanary(GOOD, capacity=0), ValueError, "KvCanary capacity must be in [1, 8]"),
    ("canary: devices", lambda: kc.KvCanary([GOOD, kc.view_source(U8.to("meta"), read_bytes=16)]), ValueError, "KvCanary sources must share one device"),
]


@pytest.mark.parametrize("name, call, exception, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, call, exception, message):
    with pytest.raises(exception) as info:
        call()
    assert str(info.value).startswith("kv-canary: " + message), str(info.value)


def test_no_copy_of_the_pool():
    # The op reads the caller's memory: a write after building the sources shows up.
    pool = torch.zeros(16, 2, 4, 32, dtype=torch.bfloat16)
    source = kc.view_source(pool.permute(0, 2, 1, 3)[:, :, :, :16], read_bytes=sys.maxsize)
    before = kc.fold(source, torch.arange(64))
    pool[3, 1, 2, 5] = 1.0
    after = kc.fold(source, torch.arange(64))
    assert (before != after).nonzero().flatten().tolist() == [3 * 4 + 2]
