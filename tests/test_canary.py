"""KvCanary: exactly the changed slots are flagged (compiled and in CUDA graphs: test_op_contracts.py)."""

import pytest
import torch
from helpers import DEVICES

import torch_kvcanary as kc
from torch_kvcanary import layouts


def _paged_pool(device, blocks=8, block_size=16, heads=2, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, blocks, block_size, heads, dim, generator=gen).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_flags_exactly_the_changed_slots(device):
    kv = _paged_pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"))
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
    kv = _paged_pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), capacity=100)
    canary.record(torch.tensor([-1, 5, -3], device=device))
    assert canary.fingerprints.shape == (100,) and int((canary.fingerprints != 0).sum()) == 1
    flags = canary.verify(torch.tensor([-1, 5, -7], device=device))
    assert flags.tolist() == [False, False, False]


@pytest.mark.parametrize("device", DEVICES)
def test_tags_catch_a_slot_recorded_by_another_owner(device):
    kv = _paged_pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"))
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
