"""Sources bound once (``kvcanary::bind_sources``, `SourceTable`) and the ops' ``.bound``
overloads that take the table: bit-exact with the ``Tensor[]`` forms and with the spec's
oracle (tests/spec_oracle.py) over every layout the ``Tensor[]`` ops accept; the table's
checks (not a table, a released one, slots on another device), each a ``kv-canary:`` error
that says to bind again; `SourceTable.check` for a source changed since binding; the fake
kernels. opcheck of the bound overloads and of bind_sources: test_op_contracts.py."""

from __future__ import annotations

import pytest
import spec_oracle
import torch
from helpers import DEVICES, RAW_OP_REFUSAL, random_case

import torch_kvcanary as kc
from torch_kvcanary import layouts, ops
from torch_kvcanary.binding import LAYOUT_WORDS, TABLE_HEADER_WORDS

BIND_AGAIN = "bind the sources again"


def _op_views(sources: list) -> tuple[list[torch.Tensor], list[int]]:
    """The views and read_bytes the ops take for ``sources`` (ALL mode), as `fold` passes them."""
    return [ops.integer_view(s.as_view()) for s in sources], [s.read_bytes for s in sources]


def _oracle_folds(views: list[torch.Tensor], read_bytes: list[int], slots: torch.Tensor) -> list[int]:
    oracle = [spec_oracle.view_form(view.cpu(), n) for view, n in zip(views, read_bytes, strict=True)]
    return [spec_oracle.fold(oracle, slot, "ALL") for slot in slots.reshape(-1).tolist()]


def _pool(shape, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)


# Odd cases by name: (views, read_bytes) and the slots to fold.
def _odd_cases(device: str) -> dict[str, tuple[list[torch.Tensor], list[int], torch.Tensor]]:
    kv = _pool((2, 5, 4, 2, 32), device)  # vLLM NHD K and V: capacity 20
    mla = _pool((7, 3, 48), device)  # one latent source of 48-byte tokens, 21 slots
    strided = _pool((6, 4, 3, 48), device)[1:, ::2, ::2, 16:]  # a storage offset, strides in every dim
    layers = [_pool((3, 4, 16), device, seed) for seed in range(40)]  # 40 sources, one capacity
    mixed = [kv[0], _pool((20, 1, 16), device, 9), strided, layers[0]]  # capacities 20, 20, 10, 12
    edge = torch.tensor([0, 19, -1, 18], device=device)
    return {
        "one source": ([kv[0]], [64], torch.tensor([0, 5, -2, 19], device=device)),
        "K and V": ([kv[0], kv[1]], [64, 16], torch.arange(-1, 20, device=device, dtype=torch.int32)),
        "MLA latent": ([mla], [48], torch.arange(21, device=device).flip(0)),
        "non-contiguous": ([strided], [64], torch.arange(10, device=device)),
        "many sources": (layers, [16] * len(layers), torch.arange(12, device=device)),
        "mixed layouts": (mixed, [64, 16, 32, 16], torch.tensor([0, 9, -1, 3], device=device)),
        "capacity edge": ([kv[0], kv[1]], [64, 64], edge),  # the last slot of the smallest source
        "no slots": ([kv[0]], [64], torch.empty(0, dtype=torch.int64, device=device)),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_odd_cases("cpu")))
def test_bound_fold_is_the_tensor_list_fold_and_the_oracle(name, device):
    views, read_bytes, slots = _odd_cases(device)[name]
    table = torch.ops.kvcanary.bind_sources(views, read_bytes)
    bound = torch.ops.kvcanary.fold.bound(table, slots)
    assert bound.tolist() == torch.ops.kvcanary.fold(views, slots, read_bytes).tolist()
    assert bound.reshape(-1).tolist() == _oracle_folds(views, read_bytes, slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_bound_fold_on_random_layouts(seed, device):
    # View- and row-form sources with padding and permuted dims, as test_ops.py draws them.
    sources, slots, _ = random_case(seed, device)
    views, read_bytes = _op_views(sources)
    bound = torch.ops.kvcanary.fold.bound(torch.ops.kvcanary.bind_sources(views, read_bytes), slots)
    assert bound.reshape(-1).tolist() == _oracle_folds(views, read_bytes, slots)
    assert bound.tolist() == kc.fold(sources, slots).tolist()


def test_the_table_is_its_header_and_one_row_per_source():
    views, read_bytes, _ = _odd_cases("cpu")["K and V"]
    table = torch.ops.kvcanary.bind_sources(views, read_bytes)
    assert table.dtype == torch.int64 and table.device.type == "cpu"
    assert table.numel() == TABLE_HEADER_WORDS + 2 * LAYOUT_WORDS
    assert table[2:4].tolist() == [2, 20]  # num_sources, the smallest capacity
    assert table[TABLE_HEADER_WORDS].item() == views[0].data_ptr()  # a row starts with its data pointer
    assert table[TABLE_HEADER_WORDS + LAYOUT_WORDS].item() == views[1].data_ptr()


def test_no_sources_bind_and_fold_to_zero():
    table = torch.ops.kvcanary.bind_sources([], [])
    assert torch.ops.kvcanary.fold.bound(table, torch.tensor([0, 5])).tolist() == [0, 0]


# --- the canary ops, bound and not ----------------------------------------------------------


def _canary_tables(capacity: int, device: str) -> tuple[torch.Tensor, ...]:
    counters = len(torch.ops.kvcanary.canary_counters())
    return (
        torch.zeros(capacity, 4, dtype=torch.int64, device=device),
        torch.full((capacity,), -1, dtype=torch.int64, device=device),
        torch.zeros(counters, dtype=torch.int64, device=device),
        torch.zeros(16, 8, dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["K and V", "MLA latent", "many sources", "mixed layouts"])
def test_bound_record_verify_refold_are_the_tensor_list_ops_and_the_oracle(name, device):
    views, read_bytes, _ = _odd_cases(device)[name]
    table = torch.ops.kvcanary.bind_sources(views, read_bytes)
    capacity = int(table[3])
    slots = torch.arange(capacity, device=device)
    positions, tokens = slots.clone(), slots * 7 % 11
    prev = torch.cat([torch.tensor([-1], device=device), slots[:-1]])
    tags = torch.tensor([3], device=device)
    entries = (slots, positions, tokens, prev, tags)
    listed, bound = _canary_tables(capacity, device), _canary_tables(capacity, device)
    oracle = spec_oracle.Records(capacity)

    torch.ops.kvcanary.record(views, read_bytes, *entries, *listed)
    torch.ops.kvcanary.record.bound(table, *entries, *bound)
    folds = _oracle_folds(views, read_bytes, slots)
    oracle.record(slots.tolist(), folds, positions.tolist(), tokens.tolist(), prev.tolist(), [3] * capacity)
    assert bound[0].tolist() == listed[0].tolist() == oracle.records
    assert bound[1].tolist() == listed[1].tolist() == oracle.owners

    views[0][0, 1].view(torch.uint8).reshape(-1)[0] += 1  # slot 1's bytes change
    flagged = torch.ops.kvcanary.verify.bound(table, *entries, *bound, -1, True)
    assert flagged.tolist() == torch.ops.kvcanary.verify(views, read_bytes, *entries, *listed, -1, True).tolist()
    expected, rows = oracle.verify(
        slots.tolist(), _oracle_folds(views, read_bytes, slots), positions.tolist(), tokens.tolist(), prev.tolist(), [3] * capacity
    )
    assert flagged.tolist() == expected and sum(expected) == 1
    assert bound[2].tolist() == listed[2].tolist() and bound[3].tolist() == listed[3].tolist()
    assert bound[3][0].tolist() == rows[0]

    redone = torch.tensor([1, -1, capacity - 1], device=device, dtype=torch.int32)
    torch.ops.kvcanary.refold.bound(table, redone, bound[0])
    torch.ops.kvcanary.refold(views, read_bytes, redone, listed[0])
    oracle.records[1][3] = _oracle_folds(views, read_bytes, slots[1:2])[0]
    assert bound[0].tolist() == listed[0].tolist() == oracle.records


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bind_refuses_what_fold_refuses_with_its_message(device):
    kv = _pool((4, 2, 16), device)
    with pytest.raises(RAW_OP_REFUSAL, match="kv-canary: read_bytes\\[0\\] must be a positive multiple of 16"):
        torch.ops.kvcanary.bind_sources([kv], [8])
    with pytest.raises(RAW_OP_REFUSAL, match="kv-canary: got 1 sources but 2 read_bytes"):
        torch.ops.kvcanary.bind_sources([kv], [16, 16])
    with pytest.raises(RAW_OP_REFUSAL, match="kv-canary: source 0 has 8 bytes per token"):
        torch.ops.kvcanary.bind_sources([_pool((4, 2, 8), device)], [16])
    with pytest.raises(RAW_OP_REFUSAL, match="kv-canary: source 0 must have a contiguous innermost dim"):
        torch.ops.kvcanary.bind_sources([_pool((4, 16, 2), device).transpose(1, 2)], [16])


@pytest.mark.parametrize("other", ["meta", *(d for d in DEVICES if d != "cpu")])  # meta: the fake kernel's check
def test_bind_refuses_sources_on_two_devices(other):
    sources = [_pool((4, 2, 16), "cpu"), _pool((4, 2, 16), "cpu").to(other)]
    shown = "cuda:0" if other == "cuda" else other
    with pytest.raises(RAW_OP_REFUSAL, match=f"kv-canary: source 1 is on {shown} but source 0 is on cpu; put them on one device"):
        torch.ops.kvcanary.bind_sources(sources, [16, 16])


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_that_is_not_a_table_is_refused(device):
    slots = torch.tensor([0], device=device)
    live = torch.ops.kvcanary.bind_sources([_pool((4, 2, 16), device)], [16])
    not_tables = {
        "an int32 tensor": live.int(),
        "a 2-D tensor": live.reshape(1, -1),
        "a strided tensor": live.repeat_interleave(2)[::2],
        "too short": live[:3],
        "never a table": torch.zeros_like(live),
        "a row short": live[:-1],
    }
    if device != "cpu":
        not_tables["on the device"] = live.to(device)
    for name, table in not_tables.items():
        with pytest.raises(RAW_OP_REFUSAL, match=f"kv-canary: sources_table .*{BIND_AGAIN}"):
            torch.ops.kvcanary.fold.bound(table, slots)
            pytest.fail(name)


@pytest.mark.parametrize("device", DEVICES)
def test_a_released_table_is_refused_by_every_bound_op(device):
    views, read_bytes, _ = _odd_cases(device)["K and V"]
    bound = kc.SourceTable(views, read_bytes)
    table = bound.table
    slots = torch.tensor([0, 1], device=device)
    tables = _canary_tables(20, device)
    bound.release()
    assert bound.released and bound.views == ()
    message = f"kv-canary: sources_table is not a live table of bind_sources \\(released, or never one\\); {BIND_AGAIN}"
    calls = {
        "fold": lambda: torch.ops.kvcanary.fold.bound(table, slots),
        "record": lambda: torch.ops.kvcanary.record.bound(table, slots, None, None, None, None, *tables),
        "verify": lambda: torch.ops.kvcanary.verify.bound(table, slots, None, None, None, None, *tables),
        "refold": lambda: torch.ops.kvcanary.refold.bound(table, slots, tables[0]),
    }
    for call in calls.values():
        with pytest.raises(RAW_OP_REFUSAL, match=message):
            call()
    assert tables[0].count_nonzero() == 0 and tables[2].count_nonzero() == 0  # nothing written
    with pytest.raises(ValueError, match=f"kv-canary: this SourceTable was released; {BIND_AGAIN}"):
        bound.table  # noqa: B018


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_slots_on_another_device_than_the_sources_are_refused(device):
    table = torch.ops.kvcanary.bind_sources([_pool((4, 2, 16), "cpu")], [16])
    with pytest.raises(
        RAW_OP_REFUSAL, match="kv-canary: the bound sources are on cpu but slots are on cuda:0; put slots on the sources' device"
    ):
        torch.ops.kvcanary.fold.bound(table, torch.tensor([0], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_slots_of_another_dtype_are_refused(device):
    table = torch.ops.kvcanary.bind_sources([_pool((4, 2, 16), device)], [16])
    with pytest.raises(RAW_OP_REFUSAL, match="kv-canary: slots must be an int32 or int64 tensor, got Short"):
        torch.ops.kvcanary.fold.bound(table, torch.tensor([0], dtype=torch.int16, device=device))


# --- the owner: SourceTable, KvCanary --------------------------------------------------------


def test_check_names_a_source_changed_since_binding():
    kv = _pool((2, 5, 4, 2, 32), "cpu")
    views = [kv[0].clone(), kv[1].clone()]
    bound = kc.SourceTable(views, [64, 64])
    bound.check()  # unchanged
    views[1].set_(torch.zeros_like(views[1]))  # another storage under the same view
    with pytest.raises(ValueError, match=f"kv-canary: source 1 changed since it was bound \\(data pointer .*\\); {BIND_AGAIN}"):
        bound.check()
    views[0].resize_(2, 4, 2, 32)  # another shape (a smaller cache)
    with pytest.raises(ValueError, match="kv-canary: source 0 changed since it was bound \\(shape \\(5, 4, 2, 32\\) -> \\(2, 4, 2, 32\\)"):
        bound.check()
    bound.release()
    with pytest.raises(ValueError, match=f"kv-canary: this SourceTable was released; {BIND_AGAIN}"):
        bound.check()


def test_a_table_kept_past_its_owner_is_refused():
    bound = kc.SourceTable([_pool((4, 2, 16), "cpu")], [16])
    table = bound.table
    assert torch.ops.kvcanary.fold.bound(table, torch.tensor([1])).tolist() != [0]
    del bound  # the views go with their owner
    with pytest.raises(RAW_OP_REFUSAL, match=f"kv-canary: sources_table is not a live table of bind_sources .*{BIND_AGAIN}"):
        torch.ops.kvcanary.fold.bound(table, torch.tensor([1]))


def test_a_canary_checks_its_sources():
    kv = _pool((2, 5, 4, 2, 32), "cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)
    canary.check_sources()
    canary._views[0].set_(torch.zeros_like(canary._views[0]))
    with pytest.raises(ValueError, match="kv-canary: source 0 changed since it was bound"):
        canary.check_sources()


# --- fake kernels ----------------------------------------------------------------------------


def test_the_bound_ops_run_on_meta_slots():
    table = torch.ops.kvcanary.bind_sources([_pool((4, 2, 16), "cpu")], [16])
    meta = torch.empty(5, dtype=torch.int64, device="meta")
    assert torch.ops.kvcanary.fold.bound(table, meta).shape == (5,)
    tables = _canary_tables(8, "meta")
    assert torch.ops.kvcanary.verify.bound(table, meta, None, None, None, None, *tables).dtype == torch.bool
    torch.ops.kvcanary.record.bound(table, meta, None, None, None, None, *tables)
    torch.ops.kvcanary.refold.bound(table, meta, tables[0])
    with pytest.raises(ValueError, match=f"kv-canary: sources_table must be a table made by bind_sources .*{BIND_AGAIN}"):
        torch.ops.kvcanary.fold.bound(table.int(), meta)


def test_bind_sources_on_fake_tensors_gives_the_table_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    views = [_pool((4, 2, 16), "cpu"), _pool((4, 2, 32), "cpu")]
    real = torch.ops.kvcanary.bind_sources(views, [16, 32])
    with FakeTensorMode() as mode:
        fake = torch.ops.kvcanary.bind_sources([mode.from_tensor(v) for v in views], [16, 32])
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)
