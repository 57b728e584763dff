"""`KvCanary.invalidate`, which the vLLM connector breaks records with: invalidated slots
fail verify on their bytes alone until recorded again; with ``where``, only the marked ones,
without waiting on the device."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_kvcanary as kc
from torch_kvcanary import FailReason, layouts


def _canary_and_block(seed: int, block_index: int, first_token: int) -> tuple[kc.KvCanary, torch.Tensor, dict]:
    """A canary over a random vLLM NHD pool of 8 blocks of 16 slots, the slots of one block,
    and a request's inputs for them: positions 0 to 15, tokens from `first_token`, each slot
    chaining through the one before."""
    kv = torch.randn(2, 8, 16, 2, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)
    block = torch.arange(16 * block_index, 16 * block_index + 16)
    prev_slots = torch.cat([torch.tensor([-1]), block[:-1]])
    return canary, block, dict(positions=torch.arange(16), tokens=torch.arange(first_token, first_token + 16), prev_slots=prev_slots)


def test_invalidate_makes_verify_flag_the_slots_until_recorded_again():
    """`KvCanary.invalidate`, which the vLLM connector breaks records with: the slots fail
    verify on their bytes alone (token, position, chain and owner kept), however often they
    are invalidated, until a record call writes them again; negative slots are skipped."""
    canary, block, checks = _canary_and_block(0, 1, 200)
    canary.record(block, tag=3, **checks)
    before = canary.records.clone()
    canary.invalidate(torch.tensor([-1, 18, 19, 19], dtype=torch.int32))
    canary.invalidate(torch.tensor([19, 20]))  # a second time: still broken
    assert canary.verify(block, 3, **checks).nonzero().flatten().tolist() == [2, 3, 4]
    violations = canary.poll()
    assert {v.slot for v in violations} == {18, 19, 20} and all(v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in violations)
    assert torch.equal(canary.records[:, :3], before[:, :3]) and (canary.owners(block) == 3).all()
    canary.record(block[2:5], tag=3, positions=checks["positions"][2:5], tokens=checks["tokens"][2:5], prev_slots=checks["prev_slots"][2:5])
    assert not canary.verify(block, 3, **checks).any()
    with pytest.raises(IndexError):
        canary.invalidate(torch.tensor([canary.capacity]))


@pytest.mark.parametrize("refold", [True, False])
def test_invalidate_where_breaks_only_the_slots_it_marks_without_waiting_on_the_device(refold):
    """`KvCanary.invalidate` with ``where`` (a transfer's verdict still on the device): the
    marked slots fail verify on their bytes alone, the others pass, nothing in the call waits
    on the device (no op that hands a value to the host), and a ``where`` of another shape
    or dtype is refused with nothing changed. With ``refold=False`` (slots just recorded
    from their bytes as they are) no refold is dispatched, and the verdicts are the same."""
    canary, block, checks = _canary_and_block(1, 2, 300)
    canary.record(block, **checks, check_bounds=False)
    before = canary.records.clone()
    where = torch.zeros(16, dtype=torch.bool)
    where[[1, 7]] = True

    class Calls(TorchDispatchMode):
        names: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Calls() as seen:
        canary.invalidate(block, where=where, refold=refold)
    assert ("kvcanary.refold" in seen.names) == refold, seen.names
    waits = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select"}
    assert not waits & set(seen.names), seen.names
    assert canary.verify(block, **checks).nonzero().flatten().tolist() == [1, 7]
    assert all(v.reasons == FailReason.VERIFY_REAL_KV_HASH_MISMATCH for v in canary.poll())
    assert torch.equal(canary.records[:, :3], before[:, :3])
    broken = canary.records.clone()
    for bad in (where[:3], where.long(), [True] * 16):
        with pytest.raises(ValueError, match=r"^kv-canary: where must be a bool tensor shaped like slots \(16,\)"):
            canary.invalidate(block, where=bad)
    assert torch.equal(canary.records, broken)
