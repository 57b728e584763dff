"""A load whose params carry no claim of P's records (a router stripped or rebuilt them) is
compared all the same: D loads only from a prefill side that registers the records' region
(NixlConnector's handshake refuses a peer whose regions differ), and the rows ride NIXL's
read of the blocks whatever the params say. It is compared by what does not depend on the
fold mode: each slot's token, position and chain, and its head digests. A flipped byte,
another request's rows and rows P never wrote are load errors of their kind; a prefill side
in another fold mode passes; the load is counted in ``transfers_unclaimed``, not unverified.
Without NIXL or a server: D's scheduler over fakes of vLLM's requests and blocks, the worker
over the plugin's canary on buffers shaped as vLLM's runner holds them (`fake_runner`)."""

import logging

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from nixl_fakes import ordered_load, vllm_config  # noqa: E402

from torch_kvcanary.integrations.vllm import adapter, worker  # noqa: E402
from torch_kvcanary.integrations.vllm.config import Settings  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import nixl, stats  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import region  # noqa: E402
from torch_kvcanary.sources import HashMode  # noqa: E402
from torch_kvcanary.testing import fake_runner  # noqa: E402

BLOCK_SIZE, HEADS, PROMPT = fake_runner.BLOCK_SIZE, fake_runner.NUM_KV_HEADS, 40


@pytest.fixture
def decode_scheduler(monkeypatch):
    monkeypatch.setenv("KVCANARY_VLLM", "repair")
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    return nixl.NixlScheduler.build(vllm_config(heads=HEADS), BLOCK_SIZE)


def unclaimed_load(scheduler, tokens: list[int], block_ids: list[int], **params) -> nixl.LoadOrder:
    """The load D's scheduler orders for request 0, whose params carry no claim of P's records."""
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-a", "remote_block_ids": [block_ids], "tp_size": 1} | params
    return ordered_load(scheduler, params, tokens, block_ids, PROMPT)


class Pair:
    """P and D over buffers alike (`fake_runner` is seeded), each with its canary in its fold
    mode; P has prefilled request 0 and written its rows (or not), which NIXL's read brings D
    with the blocks (`land`)."""

    def __init__(self, prefill_mode=HashMode.ALL, *, written=True):
        self.p_buffers, self.p = self._prefilled(prefill_mode)
        self.d_buffers, self.d = self._prefilled(HashMode.ALL)
        self.blocks = [self.p_buffers.block_of(0, position) for position in range(0, PROMPT, BLOCK_SIZE)]
        self.other_blocks = [self.p_buffers.block_of(1, position) for position in range(0, PROMPT, BLOCK_SIZE)]
        self.slots = torch.from_numpy(nixl.slots_of(self.blocks, PROMPT, BLOCK_SIZE))
        self.tokens = self.d.canary.records[self.slots, 0].tolist()
        self.p_worker, self.d_worker = (self._worker(canary) for canary in (self.p, self.d))
        if written:
            handovers = [nixl.HandOverOrder(f"request-{i}", blocks, PROMPT) for i, blocks in enumerate((self.blocks, self.other_blocks))]
            self.p_worker.after_save(self.p.port, nixl.NixlOrders(handovers=handovers))
            self.p_worker.on_flagged(self.p.port, set())  # P's step: no violation

    @staticmethod
    def _prefilled(mode):
        buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=PROMPT, decode_steps=2)
        canary = worker.WorkerCanary(buffers, Settings("log", mode), runner_view=fake_runner.FakeRunner(buffers))
        canary.end_step(canary.begin_step(lambda: buffers.step(PROMPT)))
        return buffers, canary

    def _worker(self, canary):
        nixl_worker = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(1, HEADS), rank=0)
        nixl_worker.region = region.RecordsRegion(self.p_buffers.caches[0].shape[0], HEADS, BLOCK_SIZE, BLOCK_SIZE, canary.canary.device)
        return nixl_worker

    def land(self, load: nixl.LoadOrder, p_blocks: list[int] | None = None) -> tuple[int, list[int]]:
        """NIXL's read of P's blocks ``p_blocks`` (request 0's by default) into D's blocks of
        the load, KV and rows alike, then D's comparison: the slots it compared, and the
        indices of the prompt's slots whose records it broke."""
        for mine, theirs in zip(load.block_ids, p_blocks or self.blocks):
            for d_cache, p_cache in zip(self.d_buffers.caches, self.p_buffers.caches):
                d_cache[mine] = p_cache[theirs]
            self.d_worker.region.tensor[mine] = self.p_worker.region.tensor[theirs]
        self.d_worker.before_load(self.d.port, nixl.NixlOrders(loads=[load]))
        compared, _ = self.d_worker.on_done(self.d.port, (), {load.request_id}, ())
        return compared, self.d.canary.verify(self.slots).nonzero().flatten().tolist()

    def failed_kind(self, bad: list[int]) -> dict:
        """The step that reads the load: the kinds its failed slots are counted under."""
        self.d.canary.poll()
        assert self.d_worker.on_flagged(self.d.port, {int(self.slots[i]) for i in bad}) == len(bad)
        return {kind: n for kind, n in self.d_worker.take_counts()[stats.FAILED].items() if n}


def test_a_load_without_a_claim_whose_rows_match_is_compared_and_verified(decode_scheduler):
    pair = Pair()
    load = unclaimed_load(decode_scheduler, pair.tokens, pair.blocks)
    assert load.unverified is None
    assert pair.land(load) == (PROMPT, [])  # every slot compared, none bad
    counts = pair.d_worker.take_counts()
    assert counts["transfers_unclaimed"] == 1 and not any(counts[stats.UNVERIFIED].values()), counts
    assert "transfers_unclaimed" in stats.BY_NAME and "no_claim" not in stats.UNVERIFIED_REASONS


def test_a_load_without_a_claim_is_said_once_per_prefill_engine(decode_scheduler, caplog):
    pair = Pair()
    with caplog.at_level(logging.WARNING, logger=adapter.LOGGER):
        for _ in range(2):
            unclaimed_load(decode_scheduler, pair.tokens, pair.blocks)
    (said,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert "prefill engine prefill-a" in said and "compared all the same" in said and "unverified" not in said, said


def test_a_flipped_byte_in_a_load_without_a_claim_is_a_load_error_of_its_bytes(decode_scheduler):
    pair = Pair()
    load = unclaimed_load(decode_scheduler, pair.tokens, pair.blocks)
    block, offset = divmod(int(pair.slots[9]), BLOCK_SIZE)
    pair.p_buffers.caches[0][block, 0, offset].view(torch.int16)[0] ^= 0x4000  # P's KV of slot 9, after its rows were written
    compared, bad = pair.land(load)
    assert (compared, bad) == (PROMPT, [9])
    assert pair.failed_kind(bad) == {"bytes": 1}


def test_another_requests_blocks_without_a_claim_are_a_load_error_of_another_request(decode_scheduler):
    pair = Pair()
    load = unclaimed_load(decode_scheduler, pair.tokens, pair.blocks, remote_block_ids=[pair.other_blocks])
    compared, bad = pair.land(load, pair.other_blocks)  # NIXL read request 1's blocks, KV and rows
    assert compared == PROMPT and bad == list(range(PROMPT)), bad
    assert pair.failed_kind(bad) == {"other_request": PROMPT}


def test_rows_p_never_wrote_without_a_claim_are_a_load_error_of_unknown_kind(decode_scheduler):
    pair = Pair(written=False)  # P's canary off: its region holds zeros
    load = unclaimed_load(decode_scheduler, pair.tokens, pair.blocks)
    compared, bad = pair.land(load)
    assert compared == PROMPT and bad == list(range(PROMPT)), bad
    assert pair.failed_kind(bad) == {"unknown": PROMPT}


def test_a_load_without_a_claim_from_p_in_another_fold_mode_passes(decode_scheduler):
    pair = Pair(HashMode.PARTIAL)
    rows = pair.p_worker.region.read(pair.slots)
    assert not torch.equal(rows[:, 0, region.FIELDS.index("fold")], pair.d.canary.records[pair.slots, 3])  # the folds differ
    load = unclaimed_load(decode_scheduler, pair.tokens, pair.blocks)
    assert pair.land(load) == (PROMPT, [])
    assert pair.d_worker.take_counts()["transfers_unclaimed"] == 1
