"""What P claims of the records its blocks carry through NixlConnector, and D's judgement of
the claim, without NIXL or a server: P claims its records format, fold mode, KV layout and
tensor-parallel size for a request whose records it wrote, and nothing while its canary is
off; D takes a transfer it cannot compare with (another format, mode or layout) unverified,
counts it by reason and says so once per prefill engine and reason, fails it only under the
strict setting, and exports the count as ``vllm:kv_canary_transfers_unverified_total{reason}``;
a transfer without a claim it compares all the same (test_vllm_nixl_unclaimed.py)."""

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from nixl_fakes import FakeKvCacheManager, vllm_config  # noqa: E402

from torch_kvcanary.integrations.vllm.connector import nixl  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import claim  # noqa: E402

# A prefill side's facts, written out: what a P serving this config claims.
P_FACTS = {
    "format": 1,
    "mode": "all",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 64,
    "cache_dtype": "auto",
    "dtype": "torch.bfloat16",
    "tp_size": 2,
}


def prefill_request(request_id, tokens=20):
    return SimpleNamespace(
        request_id=request_id, kv_transfer_params={"do_remote_decode": True}, num_computed_tokens=0, num_prompt_tokens=tokens
    )


def handed_params():
    """The params NixlConnector hands on with a request P prefilled for a decode side."""
    return {"do_remote_prefill": True, "remote_engine_id": "prefill-a", "remote_block_ids": [3, 4]}


def prefill_scheduler(monkeypatch, **env):
    monkeypatch.delenv("KVCANARY_VLLM", raising=False)
    monkeypatch.delenv("KVCANARY_VLLM_MODE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    scheduler = nixl.NixlScheduler.build(vllm_config(2), 16)
    scheduler.bind_kv_cache_manager(FakeKvCacheManager({"written": [3, 4], "unwritten": [5, 6]}))
    return scheduler


def test_p_claims_its_format_mode_layout_and_tp_size_for_a_request_whose_records_it_wrote(monkeypatch):
    scheduler = prefill_scheduler(monkeypatch, KVCANARY_VLLM="repair", KVCANARY_VLLM_MODE="partial")
    written, unwritten = prefill_request("written"), prefill_request("unwritten")
    scheduler.on_alloc(written, None, 0)
    scheduler.on_alloc(unwritten, None, 0)
    orders = scheduler.plan(SimpleNamespace(num_scheduled_tokens={"written": 20, "unwritten": 8}))
    assert [(order.request_id, order.block_ids, order.tokens) for order in orders.handovers] == [("written", [3, 4], 20)]

    params = handed_params()
    scheduler.on_finished(written, params)
    assert params[nixl.RECORDS_KEY] == {**P_FACTS, "mode": "partial"}
    params = handed_params()
    scheduler.on_finished(unwritten, params)  # its prompt was never completed: nothing written, nothing claimed
    assert nixl.RECORDS_KEY not in params


def test_p_claims_nothing_while_its_canary_is_off(monkeypatch):
    scheduler = prefill_scheduler(monkeypatch)  # KVCANARY_VLLM unset: no canary, no records written
    request = prefill_request("written")
    scheduler.on_alloc(request, None, 0)
    scheduler.plan(SimpleNamespace(num_scheduled_tokens={"written": 20}))
    params = {**handed_params(), nixl.RECORDS_KEY: {"format": 1}}  # not even a claim left over by another hop
    scheduler.on_finished(request, params)
    assert nixl.RECORDS_KEY not in params


def test_p_claims_nothing_once_its_canary_has_turned_itself_off(monkeypatch, caplog):
    from torch_kvcanary.integrations.vllm.connector import stats

    scheduler = prefill_scheduler(monkeypatch, KVCANARY_VLLM="quarantine")
    request = prefill_request("written")
    scheduler.on_alloc(request, None, 0)
    scheduler.plan(SimpleNamespace(num_scheduled_tokens={"written": 20}))
    scheduler.on_output(SimpleNamespace(kv_connector_stats=stats.CanaryStats()))  # a step's stats, the canary on
    worker_off = stats.CanaryStats()
    worker_off.data[stats.OFF] = 1  # what a worker whose canary turned itself off says at every step
    with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
        scheduler.on_output(SimpleNamespace(kv_connector_stats=worker_off))
        scheduler.on_output(SimpleNamespace(kv_connector_stats=worker_off))
    params = handed_params()
    scheduler.on_finished(request, params)
    assert nixl.RECORDS_KEY not in params
    (said,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert "canary has turned itself off" in said and "a decode side finds bad" in said


def with_claim(**changes):
    return {**handed_params(), nixl.RECORDS_KEY: {**P_FACTS, **changes}}


JUDGEMENTS = [
    ("same facts", with_claim(), (2, None)),
    ("another tensor-parallel size is compared by head digests", with_claim(tp_size=4), (4, None)),
    # No claim: compared all the same, P's tensor-parallel size the one the params give NIXL.
    ("router dropped the key", handed_params(), (1, None)),
    ("router dropped the key, NIXL's tp_size kept", {**handed_params(), "tp_size": 4}, (4, None)),
    ("claim is not a dict", {**handed_params(), nixl.RECORDS_KEY: 2}, (1, None)),
    ("another records format", with_claim(format=2), (None, "format_version")),
    ("another fold mode", with_claim(mode="partial"), (None, "mode_mismatch")),
    ("another block size", with_claim(block_size=32), (None, "layout_mismatch")),
    ("other heads", with_claim(num_kv_heads=4), (None, "layout_mismatch")),
    ("another dtype", with_claim(dtype="torch.float16"), (None, "layout_mismatch")),
    ("a tensor-parallel size that is none", with_claim(tp_size="2"), (None, "layout_mismatch")),
]


@pytest.mark.parametrize("params, judged", [case[1:] for case in JUDGEMENTS], ids=[case[0] for case in JUDGEMENTS])
def test_d_compares_the_claim_with_its_own_facts(params, judged):
    from torch_kvcanary.integrations.vllm.connector import stats

    claims = claim.Claims(claim.facts(vllm_config(2), 16, "all"))
    assert claims.judge(params) == judged
    assert judged[1] is None or judged[1] in stats.UNVERIFIED_REASONS


def test_d_with_its_canary_off_judges_nothing():
    assert claim.Claims(None).judge(handed_params()) == (None, None)


def test_each_unverifiable_peer_and_reason_is_said_once_with_its_fix(caplog):
    claims = claim.Claims(claim.facts(vllm_config(2), 16, "all"))
    other_engine = {**with_claim(mode="partial"), "remote_engine_id": "prefill-b"}
    with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
        for params in (with_claim(mode="partial"), with_claim(mode="partial"), other_engine, handed_params(), handed_params()):
            claims.judge(params)
    said = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(said) == 3, said
    assert "prefill engine prefill-a" in said[0] and "mode_mismatch" in said[0]
    assert "KVCANARY_VLLM_MODE=partial and this side with KVCANARY_VLLM_MODE=all" in said[0]
    assert "set KVCANARY_VLLM_MODE to the same value on both sides" in said[0]
    assert "is taken unverified" in said[0]
    assert "prefill engine prefill-b" in said[1]
    assert "compared all the same" in said[2] and "have the router hand kv_transfer_params on unchanged" in said[2]
    assert "unverified" not in said[2]


def test_the_strict_setting_must_be_a_bool():
    assert nixl.config.strict_transfers(vllm_config(2, extra={"kv_canary_strict_transfers": True})) is True
    assert nixl.config.strict_transfers(vllm_config(2)) is False
    with pytest.raises(ValueError, match=r"^kv-canary: KvCanaryConnector's kv_connector_extra_config 'kv_canary_strict_transfers' must be"):
        nixl.check_nixl(vllm_config(2, extra={"kv_canary_strict_transfers": "yes"}))


def decode_landing(strict: bool, rank: int = 0):
    """D's worker over the plugin's canary on buffers shaped as vLLM's runner holds them, a
    prompt of 40 tokens landed in request 0's blocks with region rows P never wrote (zeros),
    judged unverified for a mode mismatch: (canary, worker, the prompt's slots)."""
    from torch_kvcanary.integrations.vllm import worker
    from torch_kvcanary.integrations.vllm.config import Settings
    from torch_kvcanary.integrations.vllm.connector.nixl import region
    from torch_kvcanary.sources import HashMode
    from torch_kvcanary.testing import fake_runner

    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=40, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(40)))
    blocks = [buffers.block_of(0, position) for position in range(0, 40, fake_runner.BLOCK_SIZE)]
    slots = torch.from_numpy(nixl.slots_of(blocks, 40, fake_runner.BLOCK_SIZE))
    heads = fake_runner.NUM_KV_HEADS
    nixl_worker = nixl.NixlWorker(fake_runner.BLOCK_SIZE, sharding=nixl.Sharding(1, heads), rank=rank, strict=strict)
    nixl_worker.region = region.RecordsRegion(
        buffers.caches[0].shape[0], heads, fake_runner.BLOCK_SIZE, fake_runner.BLOCK_SIZE, canary.canary.device
    )
    tokens = canary.canary.records[slots, 0].tolist()
    load = nixl.LoadOrder("request-0", None, tokens, blocks, 0, 40, "mode_mismatch")
    nixl_worker.before_load(canary.port, nixl.NixlOrders(loads=[load]))
    return canary, nixl_worker, slots


def test_an_unverified_transfer_is_taken_as_it_landed_counted_and_never_a_load_error(caplog):
    canary, nixl_worker, slots = decode_landing(strict=False)
    with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
        # Its 40 slots are recorded as they landed, none compared: none is counted verified.
        assert nixl_worker.on_done(canary.port, (), {"request-0"}, ()) == (0, 0)
    # Said once per peer by the scheduler's judgement, not per request: no warning here (the
    # worker's INFO start line may be captured, by the logger's level an earlier test left).
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert canary.canary.verify(slots).nonzero().flatten().tolist() == []  # recorded as landed: no broken record
    canary.canary.poll()
    assert nixl_worker.on_flagged(canary.port, set()) == 0
    counts = nixl_worker.take_counts()
    assert counts["transfers_unverified"] == {"format_version": 0, "mode_mismatch": 1, "layout_mismatch": 0, "canary_off": 0}
    assert nixl_worker.take_counts()["transfers_unverified"]["mode_mismatch"] == 0  # taken: counted once


def test_an_unverified_transfer_is_counted_by_rank_0_alone():
    canary, nixl_worker, _ = decode_landing(strict=False, rank=1)
    nixl_worker.on_done(canary.port, (), {"request-0"}, ())
    assert not any(nixl_worker.take_counts()["transfers_unverified"].values())


def test_under_the_strict_setting_an_unverified_transfer_fails_as_a_load_error():
    canary, nixl_worker, slots = decode_landing(strict=True)
    nixl_worker.on_done(canary.port, (), {"request-0"}, ())
    assert canary.canary.verify(slots).nonzero().flatten().tolist() == list(range(40))
    assert nixl_worker.take_counts()["transfers_unverified"]["mode_mismatch"] == 1


def test_unverified_transfers_reach_metrics_by_reason():
    from connector_driver import summed_counts

    from torch_kvcanary.integrations.vllm.connector import stats

    assert stats.CanaryStats().is_empty()
    line, by_reason = summed_counts(
        "vllm:kv_canary_transfers_unverified_total",
        "reason",
        {"transfer_slots_handed_over": 3, "transfers_unverified": {"mode_mismatch": 2}},
        {"transfers_unverified": {"mode_mismatch": 1, "canary_off": 4}},
    )
    assert line["kv_canary_transfers_unverified_mode_mismatch"] == 3 and line["kv_canary_transfers_unverified_canary_off"] == 4
    assert "kv_canary_transfers_unverified_layout_mismatch" not in line  # the line names nonzero reasons alone
    assert by_reason.items() >= {"mode_mismatch": 3.0, "canary_off": 4.0, "format_version": 0.0}.items(), by_reason


def test_a_block_landed_shifted_is_said_as_a_shift(caplog):
    """D's line for a transfer whose first block holds P's rows of the prompt's next block
    (NIXL pairing D's blocks with P's shifted by one) names what the request expects at the
    first differing slot and what P's rows that landed there say: the token and position of
    16 slots on."""
    from torch_kvcanary.integrations.vllm import worker
    from torch_kvcanary.integrations.vllm.config import Settings
    from torch_kvcanary.integrations.vllm.connector.nixl import region
    from torch_kvcanary.sources import HashMode
    from torch_kvcanary.testing import fake_runner

    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=40, decode_steps=2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(40)))
    size = fake_runner.BLOCK_SIZE
    blocks = [buffers.block_of(0, position) for position in range(0, 40, size)]
    slots = torch.from_numpy(nixl.slots_of(blocks, 40, size))
    nixl_worker = nixl.NixlWorker(size, sharding=nixl.Sharding(1, fake_runner.NUM_KV_HEADS), rank=0)
    nixl_worker.region = region.RecordsRegion(
        buffers.caches[0].shape[0], fake_runner.NUM_KV_HEADS, size, size, canary.canary.device
    )  # fmt: skip
    nixl_worker.after_save(canary.port, nixl.NixlOrders(handovers=[nixl.HandOverOrder("request-0", blocks, 40)]))  # P's rows
    nixl_worker.region.tensor[blocks[0]] = nixl_worker.region.tensor[blocks[1]].clone()  # block 0 holds block 1's rows
    tokens = canary.canary.records[slots, 0].tolist()
    load = nixl.LoadOrder("request-0", 1, tokens, blocks, 0, 40)
    nixl_worker.before_load(canary.port, nixl.NixlOrders(loads=[load]))
    nixl_worker.on_done(canary.port, (), {"request-0"}, ())
    flagged = set(canary.canary.verify(slots).nonzero().flatten().tolist())
    assert flagged == set(range(size)), flagged  # the slots of the first block
    canary.canary.poll()
    with caplog.at_level(logging.WARNING, logger="vllm.torch_kvcanary"):
        assert nixl_worker.on_flagged(canary.port, {int(slots[i]) for i in flagged}) == size
    (said,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("kv-canary: request")]
    assert (
        f"(first at position 0); their blocks are load errors; there the request has token {tokens[0]}, and the prefill "
        f"side's records that landed say token {tokens[size]} at position {size}" in said
    ), said
