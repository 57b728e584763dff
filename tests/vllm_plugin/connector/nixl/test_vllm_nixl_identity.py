"""D compares a NIXL load under its own request's identity, without NIXL or a server, on the
plugin's canary over buffers shaped as vLLM's runner holds them (`fake_runner`): P's rows of
a prompt recorded under P's request's root; D records what landed chained from the root it
derives for its own request (never one P sends), once the runner holds the request, and a
load of another identity is named as such and counted as ``identity``; the same identity
is silent."""

import logging

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary import identity  # noqa: E402
from torch_kvcanary.integrations.vllm import worker  # noqa: E402
from torch_kvcanary.integrations.vllm.config import Settings  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import nixl  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import region  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl.worker import fault_kind  # noqa: E402
from torch_kvcanary.sources import HashMode  # noqa: E402
from torch_kvcanary.testing import fake_runner  # noqa: E402

PROMPT = 40
ROOTS = {
    "none": identity.ANCHOR,
    "salt s1": identity.request_root(cache_salt="s1"),
    "salt s2": identity.request_root(cache_salt="s2"),
    "adapter x": identity.request_root(lora=identity.LoraIdentity("x", 11)),
}


class Rooted:
    """The worker's port, deriving each request's root from ``roots`` (None: the runner holds no such request yet)."""

    def __init__(self, port, roots: dict[str, int]):
        self._port, self.roots = port, roots

    def request_root(self, request_id: str) -> int | None:
        return self.roots.get(request_id)

    def __getattr__(self, name):
        return getattr(self._port, name)


def _handed_over(root: int):
    """The canary after a step that prefilled request 0's prompt, its records then recorded
    anew under ``root`` (as P records a request of that identity), P's rows of them written,
    and D's worker: (canary, slots, tokens, blocks, D's worker)."""
    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=PROMPT, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(PROMPT)))
    size = fake_runner.BLOCK_SIZE
    blocks = [buffers.block_of(0, position) for position in range(0, PROMPT, size)]
    slots = torch.from_numpy(nixl.slots_of(blocks, PROMPT, size))
    tokens = canary.canary.records[slots, 0].clone()
    prev_slots = torch.cat([torch.tensor([-1]), slots[:-1]])
    roots = torch.full_like(slots, root)
    canary.canary.record(slots, positions=torch.arange(PROMPT), tokens=tokens, prev_slots=prev_slots, roots=roots)
    nixl_worker = nixl.NixlWorker(size, sharding=nixl.Sharding(1, fake_runner.NUM_KV_HEADS), rank=0)
    nixl_worker.region = region.RecordsRegion(buffers.caches[0].shape[0], fake_runner.NUM_KV_HEADS, size, size, canary.canary.device)
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=[nixl.HandOverOrder("request-0", blocks, PROMPT)]))
    return canary, slots, tokens.tolist(), blocks, nixl_worker


@pytest.mark.parametrize(
    "prefilled, decoded", [("salt s1", "salt s1"), ("adapter x", "adapter x"), ("salt s1", "salt s2"), ("none", "adapter x")]
)
def test_a_load_is_compared_under_its_own_requests_identity(caplog, prefilled, decoded):
    canary, slots, tokens, blocks, nixl_worker = _handed_over(ROOTS[prefilled])
    port = Rooted(canary.port, {})
    load = nixl.LoadOrder("request-0", 1, tokens, blocks, 0, PROMPT, identified=True)
    nixl_worker.before_load(port, nixl.NixlOrders(loads=[load]))
    assert nixl_worker.on_done(port, (), {"request-0"}, ()) == (0, 0)  # its root is not known yet: nothing compared
    nixl_worker.before_forward(port)  # a step without the request
    assert nixl_worker.take_counts()["transfer_slots_verified"] == 0
    assert canary.canary.verify(slots).nonzero().numel() == 0  # nothing recorded or broken before its root is known
    canary.canary.poll()
    port.roots["request-0"] = ROOTS[decoded]
    nixl_worker.before_forward(port)  # the request's first step: its forward comes next
    flagged = canary.canary.verify(slots).nonzero().flatten().tolist()
    canary.canary.poll()
    with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
        failed = nixl_worker.on_flagged(port, {int(slots[i]) for i in flagged})
    counts = nixl_worker.take_counts()
    assert counts["transfer_slots_verified"] == PROMPT
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("kv-canary: request")]
    if prefilled == decoded:
        assert (flagged, failed, said) == ([], 0, [])
        return
    # Every slot's chain differs from P's: the first from its root on.
    assert flagged == list(range(PROMPT)) and failed == PROMPT
    assert {kind: n for kind, n in counts["transfer_slots_failed"].items() if n} == {"identity": PROMPT}
    (line,) = said
    assert line.startswith(f"kv-canary: request request-0: {PROMPT} of the {PROMPT} slots NIXL loaded differ"), line
    assert f"at slot {int(slots[0])} the request has token {tokens[0]} at position 0" in line
    assert "its identity differs" in line and line.endswith("(counted as identity)"), line


def test_the_identity_kind_is_a_first_slots_alone():
    # The request's token and position under another chain: another identity at the load's
    # first slot, where the chain starts; past it the chain came through a slot that matched,
    # so P's row is another request's that holds the same token there.
    record, other_chain = [7, 0, 100], [7, 0, 200]
    assert fault_kind(record, other_chain, [7, 8], None) == "identity"
    assert fault_kind(record, other_chain, [7, 8], None, first=False) == "other_request"
    assert fault_kind(record, list(record), [7, 8], None) == "bytes"
