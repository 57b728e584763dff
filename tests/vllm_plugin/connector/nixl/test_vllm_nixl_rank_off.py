"""A decode side of two tensor-parallel ranks goes on verifying when one rank's canary turns
itself off: its scheduler, told so by the step's stats as vLLM sums the ranks' (`CanaryStats`,
`aggregate`), stops claiming records for what it hands over and goes on judging the claims
it receives; a rank still watching compares what lands with P's rows and finds nothing bad;
the rank whose canary is off counts each load it takes unverified (``canary_off``). Without
NIXL or a server: the scheduler over fakes of vLLM's requests and blocks, the worker over the
plugin's canary on buffers shaped as vLLM's runner holds them (`fake_runner`)."""

import logging
from types import SimpleNamespace

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


def steps_stats(*ranks_off: bool) -> stats.CanaryStats:
    """A step's connector stats as vLLM's output aggregator builds them: each rank's, summed (`aggregate`)."""
    per_rank = []
    for off in ranks_off:
        taken = stats.CanaryStats()
        if off:
            taken.mark_off()
        per_rank.append(taken)
    total = per_rank[0]
    for other in per_rank[1:]:
        total = total.aggregate(other)
    return total


@pytest.fixture
def decode_scheduler(monkeypatch):
    monkeypatch.setenv("KVCANARY_VLLM", "repair")
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    return nixl.NixlScheduler.build(vllm_config(tp=2, heads=HEADS), BLOCK_SIZE)


def load_after_a_rank_turned_off(scheduler, tokens: list[int], block_ids: list[int]) -> nixl.LoadOrder:
    """The load D's scheduler orders for a request whose params carry P's claim (P of the same
    facts), in a step after rank 1's canary turned itself off."""
    scheduler.on_output(SimpleNamespace(kv_connector_stats=steps_stats(False, False)))
    scheduler.on_output(SimpleNamespace(kv_connector_stats=steps_stats(False, True)))
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-a", nixl.RECORDS_KEY: scheduler.claims.own}
    return ordered_load(scheduler, params, tokens, block_ids, PROMPT)


def test_the_scheduler_judges_claims_after_one_rank_turned_off_and_claims_none(decode_scheduler, caplog):
    with caplog.at_level(logging.WARNING, logger=adapter.LOGGER):
        load = load_after_a_rank_turned_off(decode_scheduler, list(range(PROMPT)), [3, 4, 5])
    assert (load.remote_tp_size, load.unverified) == (2, None)
    assert decode_scheduler.claims.claim() is None  # what it hands over from now on carries no claim
    assert "canary has turned itself off" in caplog.text


def test_a_rank_still_watching_compares_what_lands_and_finds_nothing_bad(decode_scheduler):
    """P wrote the prompt's rows (rank 0's heads alike on both sides); D's rank 0, still
    watching, compares the load its scheduler ordered after rank 1 turned off: no slot bad."""
    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=PROMPT, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(PROMPT)))
    blocks = [buffers.block_of(0, position) for position in range(0, PROMPT, BLOCK_SIZE)]
    slots = torch.from_numpy(nixl.slots_of(blocks, PROMPT, BLOCK_SIZE))
    nixl_worker = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(1, HEADS), rank=0)
    nixl_worker.region = region.RecordsRegion(buffers.caches[0].shape[0], HEADS, BLOCK_SIZE, BLOCK_SIZE, canary.canary.device)
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=[nixl.HandOverOrder("request-0", blocks, PROMPT)]))
    nixl_worker.on_flagged(canary.port, set())  # P's step: no violation

    load = load_after_a_rank_turned_off(decode_scheduler, canary.canary.records[slots, 0].tolist(), blocks)
    nixl_worker.before_load(canary.port, nixl.NixlOrders(loads=[load]))
    assert nixl_worker.on_done(canary.port, (), {"request-0"}, ()) == (PROMPT, 0)
    assert canary.canary.verify(slots).nonzero().flatten().tolist() == []


def test_the_rank_whose_canary_is_off_counts_each_load_unverified_and_fails_none():
    nixl_worker = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(2, HEADS), rank=1)
    loads = [nixl.LoadOrder(f"request-{i}", 2, list(range(PROMPT)), [3, 4, 5], 0, PROMPT) for i in range(3)]
    nixl_worker.land_unwatched(nixl.NixlOrders(loads=loads))
    nixl_worker.land_unwatched(None)  # a step without orders
    counts = nixl_worker.take_counts()
    assert counts["transfers_unverified"]["canary_off"] == 3 and not any(counts["transfer_slots_failed"].values())
    assert "canary_off" in stats.UNVERIFIED_REASONS


def test_the_connector_of_a_rank_whose_canary_is_off_counts_its_loads_in_its_stats():
    # The facade hands a rank's loads to `land_unwatched` once its canary is off, and the
    # counts reach the stats vLLM sums over the ranks.
    from torch_kvcanary.integrations.vllm.connector.facade import KvCanaryConnector, KvCanaryMetadata
    from torch_kvcanary.integrations.vllm.connector.guard import Guard

    connector = object.__new__(KvCanaryConnector)  # the worker side's state, without an engine
    connector.inner, connector.stats, connector.guard, connector.drill, connector._steps = None, stats.CanaryStats(), Guard(), None, 0
    connector.port = connector.records = SimpleNamespace(watching=False)
    connector._verifier = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(2, HEADS), rank=1)
    loads = [nixl.LoadOrder(f"request-{i}", 2, list(range(PROMPT)), [3, 4, 5], 0, PROMPT) for i in range(2)]
    connector.bind_connector_metadata(KvCanaryMetadata(forward=True, orders=nixl.NixlOrders(loads=loads)))
    connector.start_load_kv(forward_context=None)
    taken = connector.get_kv_connector_stats()
    assert taken.data["transfers_unverified"]["canary_off"] == 2 and taken.data["canary_off"] == 1
    assert not any(taken.data["canary_faults"].values())
