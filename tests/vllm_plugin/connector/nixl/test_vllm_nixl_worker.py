"""The NIXL transport's worker without NIXL or a server, on the plugin's canary over buffers
shaped as vLLM's runner holds them (`fake_runner`): P's write of a prompt's records and D's
comparison of what landed wait on nothing; loads landing together are compared at once."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import worker  # noqa: E402
from torch_kvcanary.integrations.vllm.config import Settings  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import nixl  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import region  # noqa: E402
from torch_kvcanary.sources import HashMode  # noqa: E402
from torch_kvcanary.testing import fake_runner  # noqa: E402

# Ops that hand a value to the host, and so wait on a GPU: none may be on either side's step path.
SYNCING_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select")


class OpRecorder(TorchDispatchMode):
    """Notes each op dispatched within it, as (name, args) in ``calls``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket), args))
        return func(*args, **(kwargs or {}))


def _prefilled():
    """fake_runner's buffers of two requests, and the plugin's canary over them after a step
    that prefilled 40 tokens of each."""
    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=40, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(40)))
    return buffers, canary


def test_the_prefill_side_writes_a_prompts_records_without_waiting_on_the_device():
    """P's write of a handed-over prompt's records, on the plugin's canary over buffers
    shaped as vLLM's runner holds them (`fake_runner`): no op that waits on the device
    (``item``, ``nonzero``, a copy to the host) and the digest's range check, which syncs
    on a GPU, skipped; the rows written are the canary's records of the prompt's slots."""
    buffers, canary = _prefilled()
    blocks = [buffers.block_of(0, position) for position in range(0, 40, fake_runner.BLOCK_SIZE)]
    nixl_worker = nixl.NixlWorker(fake_runner.BLOCK_SIZE, sharding=nixl.Sharding(1, fake_runner.NUM_KV_HEADS), rank=0)
    num_blocks = buffers.caches[0].shape[0]
    nixl_worker.region = region.RecordsRegion(
        num_blocks, fake_runner.NUM_KV_HEADS, fake_runner.BLOCK_SIZE, fake_runner.BLOCK_SIZE, canary.canary.device
    )
    orders = nixl.NixlOrders(handovers=[nixl.HandOverOrder("request-0", blocks, 40)])

    with OpRecorder() as seen:
        nixl_worker.after_save(canary.port, orders)
    names = [name for name, _ in seen.calls]
    assert "aten.index_put_" in names and not [name for name in names if name in SYNCING_OPS], names
    digests = [args for name, args in seen.calls if name == "kvcanary.digest"]
    assert digests and all(args[-1] is False for args in digests), sorted(set(names))  # the range check is skipped
    slots = torch.from_numpy(nixl.slots_of(blocks, 40, fake_runner.BLOCK_SIZE))
    rows = nixl_worker.region.read(slots)
    assert torch.equal(rows[:, 0, : region.DIGEST], canary.canary.records[slots])
    counts = nixl_worker.take_counts()
    assert counts["transfer_slots_handed_over"] == 40 and not any(counts["transfers_unverified"].values())


def test_the_decode_side_compares_what_landed_without_waiting_on_the_device():
    """D's comparison of a landed prompt with the rows that landed with it, on the plugin's
    canary over buffers shaped as vLLM's runner holds them (`fake_runner`): no op that
    waits on the device, the record's range check skipped; the one slot whose row differs
    (its position, as if another prompt's block had landed) has its record broken, so that
    verify flags it on its bytes and no other slot; the step that reads it names that slot
    of the request once (`on_flagged`), and no later step."""
    buffers, canary = _prefilled()
    blocks = [buffers.block_of(0, position) for position in range(0, 40, fake_runner.BLOCK_SIZE)]
    slots = torch.from_numpy(nixl.slots_of(blocks, 40, fake_runner.BLOCK_SIZE))
    nixl_worker = nixl.NixlWorker(fake_runner.BLOCK_SIZE, sharding=nixl.Sharding(1, fake_runner.NUM_KV_HEADS), rank=0)
    nixl_worker.region = region.RecordsRegion(
        buffers.caches[0].shape[0], fake_runner.NUM_KV_HEADS, fake_runner.BLOCK_SIZE, fake_runner.BLOCK_SIZE, canary.canary.device
    )
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=[nixl.HandOverOrder("request-0", blocks, 40)]))  # P's rows
    block, offset = divmod(int(slots[9]), fake_runner.BLOCK_SIZE)
    nixl_worker.region.tensor[block, :, offset, region.FIELDS.index("position")] += 1
    tokens = canary.canary.records[slots, 0].tolist()
    nixl_worker.before_load(canary.port, nixl.NixlOrders(loads=[nixl.LoadOrder("request-0", 1, tokens, blocks, 0, 40)]))

    with OpRecorder() as seen:
        assert nixl_worker.on_done(canary.port, (), {"request-0"}, ()) == (40, 0)
    names = [name for name, _ in seen.calls]
    assert "kvcanary.record" in names and not [name for name in names if name in SYNCING_OPS], names
    assert all(args[-1] is False for name, args in seen.calls if name == "kvcanary.record")  # no range check
    assert canary.canary.verify(slots).nonzero().flatten().tolist() == [9]
    canary.canary.poll()
    assert nixl_worker.on_flagged(canary.port, {int(slots[9]), 10_000}) == 1
    assert nixl_worker.on_flagged(canary.port, {int(slots[9])}) == 0  # read once: no longer the transfer's


def test_loads_landing_together_are_compared_at_once_each_in_its_own_way():
    """Three loads NIXL reports landed in one call, compared in one pass: one whose heads
    are sharded alike on both sides, from a prefix hit on (its whole records compare: a
    changed position and a changed fold are each found), one compared by head digests (the
    fold is not compared, a changed digest is found) and one that carries no records (every
    slot is bad). Exactly those slots fail verify afterwards, on their bytes."""
    buffers, canary = _prefilled()
    blocks = [[buffers.block_of(request, p) for p in range(0, 40, fake_runner.BLOCK_SIZE)] for request in range(2)]
    slots = [torch.from_numpy(nixl.slots_of(blocks[request], 40, fake_runner.BLOCK_SIZE)) for request in range(2)]
    heads = fake_runner.NUM_KV_HEADS
    nixl_worker = nixl.NixlWorker(fake_runner.BLOCK_SIZE, sharding=nixl.Sharding(1, heads), rank=0)
    nixl_worker.region = region.RecordsRegion(
        buffers.caches[0].shape[0], heads, fake_runner.BLOCK_SIZE, fake_runner.BLOCK_SIZE, canary.canary.device
    )
    handovers = [nixl.HandOverOrder(f"request-{request}", blocks[request], 40) for request in range(2)]
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=handovers))  # P's rows

    def change(request: int, position: int, field: str) -> None:
        block, offset = divmod(int(slots[request][position]), fake_runner.BLOCK_SIZE)
        nixl_worker.region.tensor[block, :, offset, region.FIELDS.index(field)] += 1

    change(0, 20, "position")
    change(0, 33, "fold")
    change(1, 3, "fold")  # compared by digests: the fold is not compared
    change(1, 21, "digest")
    tokens = [canary.canary.records[slots[request], 0].tolist() for request in range(2)]
    whole = nixl.LoadOrder("whole", 1, tokens[0], blocks[0], 16, 40)
    by_digests = nixl.LoadOrder("by-digests", 1, tokens[1], blocks[1], 0, 24)
    unrecorded = nixl.LoadOrder("unrecorded", None, tokens[1], blocks[1], 24, 40)
    nixl_worker.before_load(canary.port, nixl.NixlOrders(loads=[whole, unrecorded]))
    # One KV head on either side is sharded alike; the digests compare just as well there.
    nixl_worker._pending["by-digests"] = nixl.PendingLoad(by_digests, nixl.Sharding(1, heads), "", same_heads=False)

    with OpRecorder() as seen:
        # The slots compared with P's rows; the unrecorded load's 16 are bad without a comparison.
        assert nixl_worker.on_done(canary.port, (), {"whole", "by-digests", "unrecorded"}, ()) == (24 + 24, 0)
    names = [name for name, _ in seen.calls]
    assert names.count("kvcanary.record") == 1 and not [name for name in names if name in SYNCING_OPS], names
    assert "kvcanary.refold" not in names  # the slots were just recorded: no refold before the break
    assert canary.canary.verify(slots[0]).nonzero().flatten().tolist() == [20, 33]
    assert canary.canary.verify(slots[1]).nonzero().flatten().tolist() == [21, *range(24, 40)]
