"""The kind of a failed NIXL transfer, without NIXL or a server: D reads the prefill side's
records that landed at a load's first differing slot and counts the load's failed slots
under what they say (a block landed one block early: ``shifted``; another request's rows:
``other_request``; records that agree with the request over changed bytes: ``bytes``),
names the kind in its line, and exports the count as
``vllm:kv_canary_transfer_slots_failed_total{kind}``."""

import logging

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm.connector import nixl  # noqa: E402

PROMPT = 40


class Landing:
    """D's worker over the plugin's canary on buffers shaped as vLLM's runner holds them, with
    P's rows of the prompts of requests 0 and 1 (40 tokens each) written into the region."""

    def __init__(self):
        from torch_kvcanary.integrations.vllm import worker
        from torch_kvcanary.integrations.vllm.config import Settings
        from torch_kvcanary.integrations.vllm.connector.nixl import region
        from torch_kvcanary.sources import HashMode
        from torch_kvcanary.testing import fake_runner

        self.buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=PROMPT, decode_steps=2)
        self.canary = worker.WorkerCanary(self.buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(self.buffers))
        self.canary.end_step(self.canary.begin_step(lambda: self.buffers.step(PROMPT)))
        self.size = size = fake_runner.BLOCK_SIZE
        self.blocks = [[self.buffers.block_of(r, position) for position in range(0, PROMPT, size)] for r in range(2)]
        self.slots = [torch.from_numpy(nixl.slots_of(blocks, PROMPT, size)) for blocks in self.blocks]
        self.worker = nixl.NixlWorker(size, sharding=nixl.Sharding(1, fake_runner.NUM_KV_HEADS), rank=0)
        self.worker.region = region.RecordsRegion(
            self.buffers.caches[0].shape[0], fake_runner.NUM_KV_HEADS, size, size, self.canary.canary.device
        )  # fmt: skip
        handovers = [nixl.HandOverOrder(f"request-{r}", self.blocks[r], PROMPT) for r in range(2)]
        self.worker.after_save(self.canary.port, nixl.NixlOrders(handovers=handovers))  # P's rows
        self.tokens = self.canary.canary.records[self.slots[0], 0].tolist()

    def rows_of_block(self, block: int) -> torch.Tensor:
        return self.worker.region.tensor[block]

    def land_and_read(self, caplog) -> tuple[int, str]:
        """Lands request 0's prompt, has a step read it: (slots failed, D's line)."""
        load = nixl.LoadOrder("request-0", 1, self.tokens, self.blocks[0], 0, PROMPT)
        self.worker.before_load(self.canary.port, nixl.NixlOrders(loads=[load]))
        self.worker.on_done(self.canary.port, (), {"request-0"}, ())
        flagged = self.canary.canary.verify(self.slots[0]).nonzero().flatten().tolist()
        self.canary.canary.poll()
        with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
            failed = self.worker.on_flagged(self.canary.port, {int(self.slots[0][i]) for i in flagged})
        (said,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("kv-canary: request")]
        return failed, said


def _counted(landing: Landing) -> dict[str, int]:
    return {kind: n for kind, n in landing.worker.take_counts()["transfer_slots_failed"].items() if n}


def test_a_load_whose_blocks_landed_one_block_early_is_shifted(caplog):
    landing = Landing()
    blocks = landing.blocks[0]
    for early, late in zip(blocks, blocks[1:]):  # each block holds the next one's rows: P's blocks paired one early
        landing.rows_of_block(early).copy_(landing.rows_of_block(late).clone())
    failed, said = landing.land_and_read(caplog)
    assert failed >= landing.size
    assert _counted(landing) == {"shifted": failed}
    assert said.endswith(f"say token {landing.tokens[landing.size]} at position {landing.size} (counted as shifted)"), said


def test_a_load_holding_another_requests_rows_is_other_request(caplog):
    landing = Landing()
    landing.rows_of_block(landing.blocks[0][0]).copy_(landing.rows_of_block(landing.blocks[1][0]).clone())
    other = landing.canary.canary.records[landing.slots[1][0], 0].item()
    assert other != landing.tokens[0]
    failed, said = landing.land_and_read(caplog)
    assert failed == landing.size
    assert _counted(landing) == {"other_request": landing.size}
    assert said.endswith(f"say token {other} at position 0 (counted as other_request)"), said


def test_a_flipped_byte_under_intact_records_is_bytes(caplog):
    landing = Landing()
    flipped = int(landing.slots[0][20])
    element = landing.buffers.caches[0][flipped // landing.size, 0, flipped % landing.size].view(torch.int16)
    element[:1].bitwise_xor_(0x1000)  # the KV that landed differs from what P recorded; its rows are P's, intact
    failed, said = landing.land_and_read(caplog)
    assert failed == 1
    assert _counted(landing) == {"bytes": 1}
    assert "(first at position 20)" in said and said.endswith(
        f"there the request has token {landing.tokens[20]}, and the prefill side's records that landed say token "
        f"{landing.tokens[20]} at position 20 (counted as bytes)"
    ), said


def test_failed_transfers_reach_the_line_and_metrics_by_kind():
    from connector_driver import summed_counts

    line, by_kind = summed_counts(
        "vllm:kv_canary_transfer_slots_failed_total",
        "kind",
        {"transfer_slots_failed": {"shifted": 16, "bytes": 1}},
        {"transfer_slots_failed": {"shifted": 16}},
    )
    assert line["kv_canary_transfer_slots_failed"] == 33
    assert line["kv_canary_transfer_slots_failed_shifted"] == 32 and line["kv_canary_transfer_slots_failed_bytes"] == 1
    assert "kv_canary_transfer_slots_failed_other_request" not in line  # the line names nonzero kinds alone
    assert by_kind.items() >= {"shifted": 32.0, "bytes": 1.0, "other_request": 0.0}.items(), by_kind


# (token, position, chain) rows: the request's record at the first differing slot, P's row there.
KINDS = [
    ("P's row equals the request's record", (7, 3, 901), [1, 2, 5, 7], (7, 3, 901), None, "bytes"),
    ("a row P never wrote", (7, 3, 901), [1, 2, 5, 7], (0, 0, 0), None, "unknown"),
    ("the request's token of position 1, its chain there", (7, 3, 901), [1, 2, 5, 7], (2, 1, 455), (2, 1, 455), "shifted"),
    ("the request's token of a position D did not land", (7, 3, 901), [1, 2, 5, 7], (2, 1, 455), None, "shifted"),
    ("the request's token of position 1, another chain", (7, 3, 901), [1, 2, 5, 7], (2, 1, 300), (2, 1, 455), "other_request"),
    ("another token at the same position", (7, 3, 901), [1, 2, 5, 7], (8, 3, 902), None, "other_request"),
    ("a position past the request's tokens", (7, 3, 901), [1, 2, 5, 7], (7, 9, 901), None, "other_request"),
]


@pytest.mark.parametrize("expected, tokens, theirs, there, kind", [case[1:] for case in KINDS], ids=[case[0] for case in KINDS])
def test_the_kind_of_a_first_differing_slot(expected, tokens, theirs, there, kind):
    from torch_kvcanary.integrations.vllm.connector.nixl import worker

    assert worker.fault_kind(list(expected), list(theirs), tokens, None if there is None else list(there)) == kind
