"""torch.ops.kvcanary.digest through `kv_digest`: docs/spec.md's digest transcribed in plain
ints (spec_oracle), the invariances (ranks, pages, chunks, calls) and the transfer bugs. The
PT2 contracts are in test_op_contracts.py, the refused arguments in test_digest_refusals.py."""

from __future__ import annotations

import random

import pytest
import spec_oracle as oracle
import torch
from helpers import DEVICES, random_bytes, random_digest_case, random_entries, torch_threads

import torch_kvcanary as kc


def expected(views, offsets, slots, positions, groups=None, num_groups=1) -> list[int]:
    return oracle.digest(views, slots, positions, offsets, groups, num_groups)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(40))
def test_random_views_match_the_spec(seed, device):
    views, offsets, slots, positions, groups, num_groups = random_digest_case(seed, device)
    got = kc.kv_digest(views, slots, positions, unit_offsets=offsets, groups=groups, num_groups=num_groups)
    assert got.dtype == torch.int64 and got.shape == (num_groups,) and got.device.type == device
    assert got.tolist() == expected(views, offsets, slots, positions, groups, num_groups)


def test_cpu_path_matches_the_spec():
    """On this process's CPU path; test_cpu_paths.py reruns it on every other path."""
    for seed in range(100, 130):
        views, offsets, slots, positions, groups, num_groups = random_digest_case(seed)
        got = kc.kv_digest(views, slots, positions, unit_offsets=offsets, groups=groups, num_groups=num_groups)
        assert got.tolist() == expected(views, offsets, slots, positions, groups, num_groups), seed


def test_hand_computed_term():
    """One fp32 unit of 4 bytes, zero-padded to one word: the term is mix3(id, position, h)
    with h = splitmix64(0 ^ word), computed here from the spec's constants."""
    view = torch.tensor([[[1.0]]], dtype=torch.float32)  # [1 page, 1 slot, 1 unit]
    word = 0x3F800000  # the bytes of 1.0f, then four zero bytes
    h = oracle.splitmix64(word)
    term = oracle.mix3(7, 3, h)
    got = kc.kv_digest([view], torch.tensor([0]), torch.tensor([3]), unit_offsets=[7])
    assert got.tolist() == [oracle.signed(term)]
    # the spec's ANCHOR pins the splitmix64 transcription itself
    assert oracle.splitmix64(0xC0FFEE1234567890) == 0xDE7FAE23A9A1B716


@pytest.mark.parametrize("device", DEVICES)
def test_last_unit_of_a_tight_view(device):
    """Views whose last unit ends the allocation (units of 4 and 12 bytes, whose last word is
    padded): digesting the last slot reads nothing past it (the sanitizer build runs this). On
    this process's CPU path; test_cpu_paths.py reruns it on every other path."""
    gen = torch.Generator().manual_seed(8)
    views = [random_bytes([2, 3, 5], torch.float32, gen, device), random_bytes([2, 3, 2, 6], torch.float16, gen, device)]
    for view in views:
        slots = torch.tensor([5, 5, 4] * 30, device=device)  # enough terms to fill every lane
        positions = torch.arange(90, device=device)
        got = kc.kv_digest([view], slots, positions, unit_offsets=[3])
        assert got.tolist() == expected([view], [3], slots, positions)


@pytest.mark.parametrize("device", DEVICES)
def test_odd_strides_and_offsets(device):
    """Units at odd byte addresses (a stride of 21 bytes, a storage offset of 1) and units of
    several 6-byte runs: read in the pieces their alignment allows, same digest as the spec."""
    gen = torch.Generator().manual_seed(12)
    base = random_bytes([3 * 4 * 3 * 21 + 1], torch.uint8, gen, device)
    odd = base[1:].view(3, 4, 3, 21)[..., :20]
    runs = random_bytes([3, 4, 2, 2, 8], torch.uint8, gen, device)[..., :6]  # units of 12 bytes in 6-byte runs
    slots = torch.tensor([0, 11, 5, -1, 7, 11] * 12, device=device)
    positions = torch.arange(72, device=device)
    for view in (odd, runs):
        got = kc.kv_digest([view], slots, positions, unit_offsets=[1 << 40])
        assert got.tolist() == expected([view], [1 << 40], slots, positions)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_and_empty_input_add_nothing(device):
    gen = torch.Generator().manual_seed(0)
    view = random_bytes([4, 2, 3, 16], torch.bfloat16, gen, device)
    zeros = torch.zeros(3, dtype=torch.int64, device=device)
    pad = torch.tensor([-1, -7], device=device)
    assert torch.equal(kc.kv_digest([view], pad, pad, unit_offsets=[0], groups=torch.tensor([0, 2], device=device), num_groups=3), zeros)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    assert torch.equal(kc.kv_digest([view], empty, empty, unit_offsets=[0], num_groups=3), zeros)
    assert torch.equal(
        kc.kv_digest([], torch.tensor([0, 5], device=device), torch.tensor([0, 1], device=device), unit_offsets=[]), zeros[:1]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_entries_of_any_shape(device):
    views, offsets, slots, positions, groups, num_groups = random_digest_case(3, device, max_entries=0)
    capacity = min(v.shape[0] * v.shape[1] for v in views)
    slots = torch.arange(12, device=device).remainder(capacity).view(3, 4)
    positions = torch.arange(12, device=device).view(3, 4)
    flat = kc.kv_digest(views, slots.flatten(), positions.flatten(), unit_offsets=offsets)
    assert torch.equal(kc.kv_digest(views, slots, positions, unit_offsets=offsets), flat)
    assert torch.equal(kc.kv_digest(views, slots.t(), positions.t(), unit_offsets=offsets), flat)  # non-contiguous


# --- invariances ---------------------------------------------------------------------------------


def wrapping_sum(digests) -> list[int]:
    total = torch.stack(list(digests)).sum(0)  # int64 addition wraps
    return total.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_calls_chunks_and_groups_add_up(device):
    views, offsets, slots, positions, groups, num_groups = random_digest_case(11, device, max_entries=0)
    rng = random.Random(5)
    capacity = min(v.shape[0] * v.shape[1] for v in views)
    slots, positions, groups = random_entries(rng, capacity, 200, 5, device)
    whole = kc.kv_digest(views, slots, positions, unit_offsets=offsets)
    # split into calls
    cuts = [0, 1, 37, 64, 65, 150, 200]
    calls = [kc.kv_digest(views, slots[a:b], positions[a:b], unit_offsets=offsets) for a, b in zip(cuts, cuts[1:])]
    assert wrapping_sum(calls) == whole.tolist()
    # split into groups (chunks): the groups add up to the ungrouped digest
    per_group = kc.kv_digest(views, slots, positions, unit_offsets=offsets, groups=groups, num_groups=5)
    assert per_group.sum().item() == whole.item()  # int64 sums wrap
    # split over views: each view on its own
    by_view = [kc.kv_digest([v], slots, positions, unit_offsets=[u]) for v, u in zip(views, offsets)]
    assert wrapping_sum(by_view) == whole.tolist()
    # the order of the entries does not matter
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(kc.kv_digest(views, slots[order], positions[order], unit_offsets=offsets), whole)


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_and_pages_add_up(device):
    """The same KV of 4 heads over 10 tokens, held whole in pages of 4, and split over two
    "ranks" of 2 heads each in rows (page size 1) at other slots: the ranks' digests add up to
    the whole's."""
    gen = torch.Generator().manual_seed(2)
    heads, dim, tokens = 4, 16, 10
    kv = random_bytes([tokens, heads, dim], torch.bfloat16, gen, device)
    pages = torch.zeros(4, 4, heads, dim, dtype=torch.bfloat16, device=device)
    page_slots = torch.tensor([5, 6, 7, 12, 13, 14, 15, 0, 1, 2], device=device)
    pages.view(-1, heads, dim)[page_slots] = kv
    positions = torch.arange(tokens, device=device)
    whole = kc.kv_digest([pages], page_slots, positions, unit_offsets=[100])
    row_slots = torch.tensor([9, 3, 4, 8, 0, 1, 2, 5, 6, 7], device=device)
    ranks = []
    for rank in range(2):
        rows = torch.zeros(tokens, 1, 2, dim, dtype=torch.bfloat16, device=device)
        rows[row_slots, 0] = kv[:, 2 * rank : 2 * rank + 2]
        ranks.append(kc.kv_digest([rows], row_slots, positions, unit_offsets=[100 + 2 * rank]))
    assert wrapping_sum(ranks) == whole.tolist()
    assert whole.tolist() == expected([pages], [100], page_slots, positions)


def test_threads_agree(monkeypatch):
    """A batch of many tasks gives the same digest on one thread and on all of them, and
    as the sum of its halves."""
    gen = torch.Generator().manual_seed(4)
    views = [random_bytes([64, 16, 8, 64], torch.bfloat16, gen), random_bytes([64, 16, 8], torch.float32, gen)]
    slots = torch.randint(-1, 1024, (6000,), generator=gen)
    positions = torch.randint(0, 1 << 20, (6000,), generator=gen)
    groups = torch.randint(0, 7, (6000,), generator=gen)
    args = dict(unit_offsets=[0, 4096], groups=groups, num_groups=7)
    with torch_threads(1):
        one = kc.kv_digest(views, slots, positions, **args)
    assert torch.equal(kc.kv_digest(views, slots, positions, **args), one)
    halves = [
        kc.kv_digest(views, slots[s], positions[s], unit_offsets=[0, 4096], groups=groups[s], num_groups=7)
        for s in (slice(0, 2500), slice(2500, None))
    ]
    assert wrapping_sum(halves) == one.tolist()
    small = slice(0, 300)
    assert one.tolist() != [0] * 7
    assert kc.kv_digest(views, slots[small], positions[small], **{**args, "groups": groups[small]}).tolist() == expected(
        views, [0, 4096], slots[small], positions[small], groups[small], 7
    )


# --- what a transfer can get wrong ---------------------------------------------------------------


def _word_sum(views, slots) -> int:
    """A linear checksum (the sum of a unit's 8-byte words, as one vLLM fork does), to show
    which corruption it cannot see."""
    total = 0
    for view in views:
        for s in slots.tolist():
            data = view[s // view.shape[1], s % view.shape[1]].contiguous().view(torch.uint8).reshape(-1).tolist()
            total += sum(int.from_bytes(bytes(data[i : i + 8]), "little") for i in range(0, len(data), 8))
    return total & ((1 << 64) - 1)


@pytest.mark.parametrize("device", DEVICES)
def test_each_transfer_bug_changes_the_digest(device):
    gen = torch.Generator().manual_seed(9)
    kv = random_bytes([3, 4, 2, 32], torch.float8_e4m3fn, gen, device)  # pages of 4 tokens, 2 heads of 32 bytes
    scales = random_bytes([3, 4, 2], torch.float32, gen, device)
    slots = torch.arange(10, device=device)
    positions = torch.arange(10, device=device)
    offsets = [0, 2]

    def digest(kv_view, scale_view, slots=slots, positions=positions):
        return kc.kv_digest([kv_view, scale_view], slots, positions, unit_offsets=offsets).item()

    good = digest(kv, scales)
    flipped = kv.clone()
    flipped.view(torch.uint8)[1, 2, 1, 17] ^= 0x10
    swapped = positions.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    stale = kv.clone()
    stale[1] = random_bytes([4, 2, 32], torch.float8_e4m3fn, gen, device)  # page 1 never arrived
    lost_scales = torch.ones_like(scales)
    two_top_bits = kv.clone()
    two_top_bits.view(torch.uint8)[0, 1, 0, 7] ^= 0x80  # top bit of word 0 of a unit
    two_top_bits.view(torch.uint8)[0, 1, 0, 15] ^= 0x80  # top bit of word 1 of the same unit
    bugs = {
        "one flipped bit": digest(flipped, scales),
        "two positions swapped": digest(kv, scales, positions=swapped),
        "one page never sent": digest(stale, scales),
        "scales lost": digest(kv, lost_scales),
        "two top-bit flips in one unit": digest(two_top_bits, scales),
    }
    assert {name: value != good for name, value in bugs.items()} == dict.fromkeys(bugs, True)
    # the two top-bit flips cancel in a linear checksum of the same bytes
    assert _word_sum([two_top_bits], slots.cpu()) == _word_sum([kv], slots.cpu())
    # swapped heads (unit ids) and layers change it too
    assert digest(kv.flip(2), scales) != good
