"""P never hands over, as matching rows, KV its own canary flagged in the step that computed
it: the rows of a prompt whose step had a violation (a flagged slot in its blocks, or its
records broken by the step's misread rule) are marked, and D, comparing what landed, finds
every slot of that prompt bad, whichever way it compares (whole records or head digests),
and no slot of the step's other prompt. On the plugin's canary over buffers shaped as vLLM's
runner holds them (`fake_runner`), one canary playing P, then D."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import adapter, worker  # noqa: E402
from torch_kvcanary.integrations.vllm.config import Settings  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import nixl  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import region  # noqa: E402
from torch_kvcanary.sources import HashMode  # noqa: E402
from torch_kvcanary.testing import fake_runner  # noqa: E402

BLOCK_SIZE, HEADS = fake_runner.BLOCK_SIZE, fake_runner.NUM_KV_HEADS
PROMPT = 40
# Ops that hand a value to the host, and so wait on a GPU (test_vllm_nixl_worker.py's list).
SYNCING_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select")


class OpNames(TorchDispatchMode):
    """Notes the name of each op dispatched within it, in ``names``."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _handed_over():
    """A step that prefilled two prompts of 40 tokens on P, and P's write of their rows
    (`after_save`); returns the canary, the worker, and each prompt's blocks and slots."""
    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=PROMPT, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(PROMPT)))
    blocks = [[buffers.block_of(request, p) for p in range(0, PROMPT, BLOCK_SIZE)] for request in range(2)]
    slots = [torch.from_numpy(nixl.slots_of(blocks[request], PROMPT, BLOCK_SIZE)) for request in range(2)]
    nixl_worker = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(1, HEADS), rank=0)
    nixl_worker.region = region.RecordsRegion(buffers.caches[0].shape[0], HEADS, BLOCK_SIZE, BLOCK_SIZE, canary.canary.device)
    handovers = [nixl.HandOverOrder(f"request-{request}", blocks[request], PROMPT) for request in range(2)]
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=handovers))
    return canary, nixl_worker, blocks, slots


def _bad_after_landing(canary, nixl_worker, blocks, slots, *, same_heads: bool) -> list[list[int]]:
    """D lands both prompts over the same blocks, compared as ``same_heads`` says (whole
    records, or token, position, chain and head digests), and verifies them: the positions
    of each prompt that verify flags."""
    tokens = [canary.canary.records[slots[request], 0].tolist() for request in range(2)]
    for request in range(2):
        load = nixl.LoadOrder(f"request-{request}", 1, tokens[request], blocks[request], 0, PROMPT)
        nixl_worker._pending[load.request_id] = nixl.PendingLoad(load, nixl.Sharding(1, HEADS), "", same_heads=same_heads)
    nixl_worker.on_done(canary.port, (), {"request-0", "request-1"}, ())
    return [canary.canary.verify(slots[request]).nonzero().flatten().tolist() for request in range(2)]


@pytest.mark.parametrize("same_heads", [True, False], ids=["whole-records", "head-digests"])
@pytest.mark.parametrize("violation", ["none", "flagged-slot", "misread"])
def test_rows_of_a_prompt_whose_step_had_a_violation_are_marked_and_d_finds_every_slot_bad(violation, same_heads):
    """The step's verdict comes after P's write (`after_save`) and before the records it
    spoiled are broken (`on_flagged`, then the facade's repair rule): a slot of request-0's
    second block flagged, or request-0's last block's records broken as the misread rule
    breaks what a misreader wrote. D then finds all 40 slots of request-0 bad and none of
    request-1; without a violation, none of either."""
    canary, nixl_worker, blocks, slots = _handed_over()
    flagged = set()
    if violation == "flagged-slot":
        flagged = {int(slots[0][BLOCK_SIZE + 3])}
    elif violation == "misread":
        canary.port.break_records(slots[0][2 * BLOCK_SIZE :])
    nixl_worker.on_flagged(canary.port, flagged)

    bad = _bad_after_landing(canary, nixl_worker, blocks, slots, same_heads=same_heads)
    assert bad == ([[], []] if violation == "none" else [list(range(PROMPT)), []])


def test_marked_rows_keep_token_position_and_chain_and_nothing_waits_on_the_device():
    """A marked row still says which token, position and chain P computed (D's log line
    reads them): only the fold and the head digests are changed. The verdict's marking runs
    no op that waits on the device."""
    canary, nixl_worker, _, slots = _handed_over()
    before = nixl_worker.region.read(slots[0]).clone()
    flagged = {int(slots[0][0])}
    with OpNames() as seen:
        nixl_worker.on_flagged(canary.port, flagged)
    assert "aten.index_put_" in seen.names and not [name for name in seen.names if name in SYNCING_OPS], seen.names
    after = nixl_worker.region.read(slots[0])
    fold = region.FIELDS.index("fold")
    assert torch.equal(after[:, :, :fold], before[:, :, :fold])
    assert (after[:, :, fold:] != before[:, :, fold:]).all()


@pytest.mark.parametrize("same_heads", [True, False], ids=["whole-records", "head-digests"])
def test_d_says_the_prefill_side_marked_the_rows_at_their_first_read(caplog, same_heads):
    """At the first read of a marked prompt D names the prefill side's mark, not a changed
    byte, and counts its slots as ``unknown`` (not classified), not as ``bytes``."""
    canary, nixl_worker, blocks, slots = _handed_over()
    nixl_worker.on_flagged(canary.port, {int(slots[0][BLOCK_SIZE + 3])})
    nixl_worker.take_counts()
    bad = _bad_after_landing(canary, nixl_worker, blocks, slots, same_heads=same_heads)
    flagged = {int(slots[0][position]) for position in bad[0]}

    with caplog.at_level("WARNING", logger=adapter.LOGGER):
        assert nixl_worker.on_flagged(canary.port, flagged) == PROMPT
    failed = nixl_worker.take_counts()["transfer_slots_failed"]
    assert failed["unknown"] == PROMPT and failed["bytes"] == 0
    assert "the prefill side marked its rows of this KV" in caplog.text
