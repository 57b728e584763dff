"""KvCanary: exactly the changed slots are flagged (compiled and in CUDA graphs: test_op_contracts.py)."""

import pytest
import torch
from helpers import DEVICES

import torch_kvcanary as kc
from torch_kvcanary import layouts


def _paged_pool(device, blocks=8, block_size=16, heads=2, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, blocks, block_size, heads, dim, generator=gen).to(torch.bfloat16).to(device)


def _canary(device, **canary_args) -> tuple[torch.Tensor, kc.KvCanary]:
    """A vLLM NHD pool of 8 blocks of 16 slots on `device` (`_paged_pool`) and a canary over it."""
    kv = _paged_pool(device)
    return kv, kc.KvCanary(layouts.vllm(kv, layout="NHD"), **canary_args)


@pytest.mark.parametrize("device", DEVICES)
def test_flags_exactly_the_changed_slots(device):
    kv, canary = _canary(device)
    assert canary.capacity == 8 * 16 and canary.device.type == device
    slots = torch.arange(128, device=device)
    canary.record(slots)
    assert canary.violations(slots) == []
    kv[1, 3, 5, 1, 31] = 7.0  # V of slot 3 * 16 + 5, its last bytes
    kv[0, 0, 0, 0, 0] = -1.0  # K of slot 0, its first bytes
    assert canary.violations(slots) == [0, 53]
    flags = canary.verify(slots.view(8, 16))
    assert flags.shape == (8, 16) and flags.sum() == 2
    canary.record(torch.tensor([53, -1, 0], device=device))  # re-record after a legitimate write
    assert canary.violations(slots) == []


@pytest.mark.parametrize("device", DEVICES)
def test_partial_misses_what_all_catches(device):
    kv = _paged_pool(device)
    sources = layouts.vllm(kv, layout="NHD")
    full, partial = kc.KvCanary(sources), kc.KvCanary(sources, mode=kc.HashMode.PARTIAL)
    slots = torch.arange(128, device=device)
    full.record(slots)
    partial.record(slots)
    kv.view(torch.int16)[0, 2, 2, 1, 3] ^= 1  # one bit, past the first 16 bytes of slot 34
    assert full.violations(slots) == [34] and partial.violations(slots) == []


@pytest.mark.parametrize("device", DEVICES)
def test_padding_and_a_smaller_capacity(device):
    kv, canary = _canary(device, capacity=100)
    canary.record(torch.tensor([-1, 5, -3], device=device))
    assert canary.fingerprints.shape == (100,) and int((canary.fingerprints != 0).sum()) == 1
    flags = canary.verify(torch.tensor([-1, 5, -7], device=device))
    assert flags.tolist() == [False, False, False]


@pytest.mark.parametrize("device", DEVICES)
def test_tags_catch_a_slot_recorded_by_another_owner(device):
    kv, canary = _canary(device)
    mine = torch.arange(16, 32, device=device)  # block 1 belongs to request 7
    canary.record(mine, tag=7)
    assert canary.violations(mine, tag=7) == []
    # The block is freed while request 7 still reads it; request 9 writes and records slot 20.
    kv[:, 1, 4] = 0.5
    canary.record(torch.tensor([20], device=device), tag=9)
    assert canary.violations(mine) == []  # the bytes match their last record...
    assert canary.violations(mine, tag=7) == [20]  # ...but not their owner
    assert canary.owners(torch.tensor([20, 16, -1], device=device)).tolist() == [9, 7, -1]
    tags = torch.full((16,), 7, device=device)
    assert canary.verify(mine, tags).nonzero().flatten().tolist() == [4]


@pytest.mark.parametrize("device", DEVICES)
def test_copied_records_follow_copied_bytes(device):
    """A block copied whole (vLLM's copy-on-write) verifies once its records are copied too,
    and swapped blocks (sources read before any destination is written) verify swapped."""
    kv, canary = _canary(device)
    block = torch.arange(16, device=device)
    positions, tokens = torch.arange(32, 48, device=device), torch.arange(100, 116, device=device)
    prev = torch.cat([torch.tensor([-1], device=device), 32 + block[:-1]])
    canary.record(32 + block, positions=positions, tokens=tokens, prev_slots=prev)  # block 2
    canary.record(48 + block)  # block 3, bytes only
    kv[:, 5] = kv[:, 2]  # the engine copies block 2 to block 5
    copied_prev = torch.cat([torch.tensor([-1], device=device), 80 + block[:-1]])
    checks = dict(positions=positions, tokens=tokens, prev_slots=copied_prev)
    assert canary.verify(80 + block, **checks).all()  # block 5 holds stale records
    canary.poll()
    canary.copy_records(32 + block, 80 + block)
    assert not canary.verify(80 + block, **checks).any()
    assert (canary.owners(80 + block) == canary.owners(32 + block)).all()
    kv[:, [2, 3]] = kv[:, [3, 2]]  # the engine swaps blocks 2 and 3
    canary.copy_records(torch.cat([32 + block, 48 + block]), torch.cat([48 + block, 32 + block]).int())
    assert not canary.verify(48 + block, positions=positions, tokens=tokens).any()
    assert not canary.verify(32 + block).any()
    assert canary.poll() == []


@pytest.mark.parametrize("device", DEVICES)
def test_refold_takes_new_bytes_and_keeps_the_rest_of_each_record(device):
    """After a legitimate write to other slots' bytes (a block-packed backend), refold gives
    the slots the fold a fresh record of their bytes has, and keeps token, position, chain
    and owner; negative slots are skipped."""
    kv, canary = _canary(device)
    block = torch.arange(16, 32, device=device)
    positions, tokens = torch.arange(16, device=device), torch.arange(200, 216, device=device)
    prev = torch.cat([torch.tensor([-1], device=device), block[:-1]])
    canary.record(block, positions=positions, tokens=tokens, prev_slots=prev, tag=3)
    before = canary.records.clone()
    kv[:, 1, 2:9] += 1.0  # slots 18 .. 24
    checks = dict(positions=positions, tokens=tokens, prev_slots=prev)
    assert canary.verify(block, **checks).nonzero().flatten().tolist() == list(range(2, 9))
    canary.poll()
    canary.refold(torch.tensor([-1, 18, 19, 20, 21, 22, 23, -5], device=device))
    canary.refold(torch.tensor([24], dtype=torch.int32, device=device))
    assert not canary.verify(block, 3, **checks).any()
    fresh = kc.KvCanary(layouts.vllm(kv, layout="NHD"))
    fresh.record(block)
    assert torch.equal(canary.records[16:32, 3], fresh.records[16:32, 3])  # the fold of a fresh record
    assert torch.equal(canary.records[16:32, :3], before[16:32, :3])  # token, position, chain kept
    assert torch.equal(canary.records[32:], before[32:]) and torch.equal(canary.records[:16], before[:16])
    assert (canary.owners(block) == 3).all()
    assert canary.poll() == []
