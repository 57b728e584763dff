"""Every invalid argument of KvCanary's constructor and calls raises a Python exception whose
message starts with `kv-canary:` and names what to change; a refused call writes nothing
(the sanitizer job runs this file)."""

import pytest
import torch
from helpers import CUDA, DEVICES, RAW_OP_REFUSAL, refusal_table_test

import torch_kvcanary as kc
from torch_kvcanary import layouts

U8 = torch.zeros(4, 2, 64, dtype=torch.uint8)  # a good view: 4 pages of 2 slots of 64 bytes
GOOD = kc.view_source(U8, read_bytes=64)

# (name, call, exception, message start after "kv-canary: ")
CASES = [
    ("canary: no sources", lambda: kc.KvCanary([]), ValueError, "KvCanary needs at least one source"),
    ("canary: capacity", lambda: kc.KvCanary(GOOD, capacity=0), ValueError, "KvCanary capacity must be in [1, 8]"),
    (
        "canary: devices",
        lambda: kc.KvCanary([GOOD, kc.view_source(U8.to("meta"), read_bytes=16)]),
        ValueError,
        "KvCanary sources must share one device",
    ),
    (
        "canary: copy_records dtype",
        lambda: kc.KvCanary(GOOD).copy_records(torch.tensor([0.0]), torch.tensor([1])),
        TypeError,
        "src_slots must be an int32 or int64 tensor",
    ),
    (
        "canary: copy_records shapes",
        lambda: kc.KvCanary(GOOD).copy_records(torch.tensor([0, 1]), torch.tensor([2])),
        ValueError,
        "src_slots and dst_slots must have one shape",
    ),
    (
        "canary: copy_records range",
        lambda: kc.KvCanary(GOOD).copy_records(torch.tensor([0]), torch.tensor([8])),
        IndexError,
        "dst_slots must lie in [0, 8), got values in [8, 8]",
    ),
    (
        "canary: refold dtype",
        lambda: kc.KvCanary(GOOD).refold(torch.tensor([1.0])),
        TypeError,
        "slots must be an int32 or int64 tensor",
    ),
    (
        "canary: refold range",
        lambda: kc.KvCanary(GOOD).refold(torch.tensor([3, 8])),
        IndexError,
        "slots holds slot 8, out of range for a canary of capacity 8",
    ),
    (
        "canary: copy_records destinations",
        lambda: kc.KvCanary(GOOD).copy_records(torch.tensor([0, 1]), torch.tensor([2, 2])),
        ValueError,
        "dst_slots must be distinct",
    ),
]


test_bad_input = refusal_table_test(CASES)


def _canary_pool(device: str) -> torch.Tensor:
    """A vLLM [2, blocks, block_size, heads, dim] bf16 pool: a canary of capacity 128."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 8, 16, 2, 32, generator=gen).to(torch.bfloat16).to(device)


def test_canary_constructor_refuses_bad_arguments():
    sources = layouts.vllm(_canary_pool("cpu"), layout="NHD")
    for kwargs, match in (
        ({"capacity": 129}, r"^kv-canary: KvCanary capacity must be in \[1, 128\]"),
        ({"mode": 7}, "^kv-canary: mode must be a HashMode"),
        ({"ring_capacity": 0}, r"^kv-canary: KvCanary ring_capacity must be an int >= 1, got 0"),
        ({"ring_capacity": 2.0}, r"^kv-canary: KvCanary ring_capacity must be an int >= 1"),
        ({"padding_slot": 128}, r"^kv-canary: KvCanary padding_slot must be None or a slot in \[0, 128\), got 128"),
        ({"on_violation": "print"}, "^kv-canary: on_violation must be"),
        ({"on_violation": "warn"}, "^kv-canary: on_violation must be 'log', 'raise', a callable"),
    ):
        with pytest.raises(ValueError, match=match):
            kc.KvCanary(sources, **kwargs)
    with pytest.raises(ValueError, match="^kv-canary: KvCanary needs at least one source$"):
        kc.KvCanary(())
    with pytest.raises(TypeError, match="^kv-canary: KvCanary name must be a str"):
        kc.KvCanary(sources, name=3)


@pytest.mark.parametrize("device", DEVICES)
def test_canary_slots_past_its_capacity(device):
    canary = kc.KvCanary(layouts.vllm(_canary_pool(device), layout="NHD"), capacity=100)
    canary.record(torch.tensor([-1, 5, -3], device=device))
    before = canary.records.clone()
    with pytest.raises(IndexError, match=r"^kv-canary: slots holds slot 100, out of range for a canary of capacity 100"):
        canary.record(torch.tensor([7, 100, 8], device=device))  # 100 is past the capacity
    assert torch.equal(canary.records, before)  # a refused call writes nothing
    with pytest.raises(IndexError, match=r"^kv-canary: slots holds slot 127, out of range"):
        canary.verify(torch.tensor([5, 127], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_canary_refused_calls_write_nothing(device):
    canary = kc.KvCanary(layouts.vllm(_canary_pool(device), layout="NHD"), capacity=100)
    canary.record(torch.arange(8, device=device))
    before = [t.clone() for t in (canary._records, canary._owner_tags, canary._counters, canary._ring)]
    slots = torch.arange(4, device=device)
    bad = [
        (IndexError, "^kv-canary: prev_slots holds slot 100, out of range for a canary of capacity 100", {"prev_slots": torch.tensor([-1, 0, 100, 1], device=device)}),
        (IndexError, "^kv-canary: slots holds slot 120, out of range", {"slots": torch.tensor([1, 120], device=device)}),
        (ValueError, r"^kv-canary: positions has 3 entries \(shape \[3\]\) but slots has 4", {"positions": torch.arange(3, device=device)}),
        (TypeError, "^kv-canary: tokens must be an int32 or int64 tensor, got Float", {"tokens": torch.zeros(4, device=device)}),
        (TypeError, "^kv-canary: prev_slots must be an int32 or int64 tensor shaped like slots, got list", {"prev_slots": [1, 2, 3, 4]}),
        (ValueError, r"^kv-canary: tag has 2 values", {"tag": torch.tensor([1, 2], device=device)}),
        (TypeError, "^kv-canary: tag must be an int or an int64 tensor", {"tag": 1.5}),
        (ValueError, r"^kv-canary: roots has 3 values \(shape \[3\]\) but slots has 4 \(shape \[4\]\); pass one root per slot", {"roots": torch.zeros(3, dtype=torch.int64, device=device), "prev_slots": slots - 1}),
        (TypeError, "^kv-canary: roots must be an int64 tensor shaped like slots, got torch.int32; pass roots as int64", {"roots": slots.int()}),
        (TypeError, "^kv-canary: roots must be an int64 tensor shaped like slots, got list", {"roots": [1, 2, 3, 4]}),
        (ValueError, "^kv-canary: roots is on meta but slots are on", {"roots": torch.zeros(4, dtype=torch.int64, device="meta"), "prev_slots": slots - 1}),
    ]  # fmt: skip
    for error, match, change in bad:
        kwargs = {"slots": slots, **change}
        for call in (canary.record, canary.verify):
            with pytest.raises(error, match=match):
                call(**kwargs)
    if device == "cpu" and CUDA:
        with pytest.raises(ValueError, match="^kv-canary: positions is on cuda"):
            canary.record(slots, positions=slots.cuda())
        with pytest.raises(ValueError, match="^kv-canary: roots is on cuda.* but slots are on cpu; put them on one device"):
            canary.verify(slots, prev_slots=slots - 1, roots=slots.cuda())
    for table, saved in zip((canary._records, canary._owner_tags, canary._counters, canary._ring), before):
        assert torch.equal(table, saved)


@pytest.mark.parametrize("op", ["record", "verify"])
def test_the_raw_ops_refuse_roots_of_another_dtype(op):
    # KvCanary checks the dtype first (TypeError); the kernels' own check is for direct callers.
    canary = kc.KvCanary(layouts.vllm(_canary_pool("cpu"), layout="NHD"))
    slots = torch.arange(4)
    tables = (canary._records, canary._owner_tags, canary._counters, canary._ring)
    tail = (True,) if op == "record" else (-1, True)
    with pytest.raises(RAW_OP_REFUSAL, match="^kv-canary: roots must be an int64 tensor \\(64-bit hashes\\), got Int; pass roots as int64"):
        getattr(torch.ops.kvcanary, op).bound(canary._bound.table, slots, None, None, None, None, *tables, *tail, slots.int())
