"""What a client or router writes into ``kv_transfer_params`` reaches D's judgement of P's
claim bounded, without NIXL or a server: a ``kv_canary_*`` key D does not know is counted and
said once per name (up to `claim.SAID_LIMIT` names), the load judged by its claim alone; the
prefill engine ids and tensor-parallel sizes D says something of are remembered and said up
to a fixed number, however many a client cycles through."""

import logging
from types import SimpleNamespace

import pytest
from test_vllm_claim import FakeKvCacheManager, handed_params, vllm_config, with_claim

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm.connector import nixl, stats  # noqa: E402
from torch_kvcanary.integrations.vllm.connector.nixl import claim  # noqa: E402

LOGGER = "vllm.torch_kvcanary"


def _claims() -> claim.Claims:
    return claim.Claims(claim.facts(vllm_config(), 16, "all"))


def _warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_an_unknown_kv_canary_key_is_said_once_per_name_and_the_claim_still_judged(caplog):
    claims = _claims()
    typo = {**with_claim(), "kv_canary_recordz": {"format": 1}}
    newer = {**handed_params(), "kv_canary_records_v2": {}}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert [claims.unknown_keys(params) for params in (typo, typo, newer, with_claim())] == [1, 1, 1, 0]
        assert claims.judge(typo) == (2, None)  # verified by its claim: an added key switches nothing off
        assert claims.judge(newer) == (1, None) and claims.unclaimed(newer)  # no claim: compared all the same
    said = _warnings(caplog)
    unknown = [line for line in said if "kv_canary_" in line and "does not know" in line]
    assert len(unknown) == 2, said
    assert "'kv_canary_recordz'" in unknown[0] and "'kv_canary_records_v2'" in unknown[1]
    assert "serve both sides with the same torch_kvcanary version" in unknown[0]


def test_unknown_key_names_are_said_up_to_a_bound_however_many_a_client_sends(caplog):
    claims = _claims()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(5000):
            assert claims.unknown_keys({**with_claim(), f"kv_canary_{i}": 1, f"kv_canary_x{'y' * 10_000}{i}": 1}) == 2
    said = [line for line in _warnings(caplog) if "kv_canary_" in line]
    assert len(said) == claim.SAID_LIMIT + 1, len(said)
    assert "no more are named" in said[-1]
    assert max(len(line) for line in said) < 2000  # a long key is shortened where it is said


def test_many_prefill_engine_ids_are_remembered_and_said_up_to_a_bound(caplog):
    claims = _claims()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(5000):
            engine = f"engine-{i}" + "z" * 1000
            assert claims.judge({**with_claim(mode="partial"), "remote_engine_id": engine}) == (None, "mode_mismatch")
            assert claims.judge({**handed_params(), "remote_engine_id": engine}) == (1, None)  # no claim: compared
    said = _warnings(caplog)
    assert len(said) == 2 * (claim.SAID_LIMIT + 1), len(said)
    assert sum("no more are named" in line for line in said) == 2
    assert len(claims._said) == len(claims._unclaimed_said) == claim.SAID_LIMIT


def test_the_limit_is_stated():
    assert claim.SAID_LIMIT == 64


def _decode_scheduler() -> nixl.NixlScheduler:
    return nixl.NixlScheduler(16, _claims())


def _remote_load(request_id: str, params: dict):
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_hash=None, is_null=False)] * 2], get_block_ids=lambda: ([3, 4],))
    request = SimpleNamespace(
        request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(range(32)), lora_request=None, cache_salt=None
    )
    return request, blocks


def test_d_orders_each_load_with_its_unknown_keys_and_rank_0_counts_them_with_the_loads():
    scheduler = _decode_scheduler()
    scheduler.bind_kv_cache_manager(FakeKvCacheManager({}))
    for request_id, params in (("a", {**with_claim(), "kv_canary_recordz": 1}), ("b", with_claim()), ("c", handed_params())):
        scheduler.on_alloc(*_remote_load(request_id, params), 32)
    orders = scheduler.plan(SimpleNamespace(num_scheduled_tokens={}))
    assert [(load.remote_tp_size, load.unverified, load.unknown_keys, load.unclaimed) for load in orders.loads] == [
        (2, None, 1, False), (2, None, 0, False), (1, None, 0, True),
    ]  # fmt: skip
    for rank, expected in ((0, (3, 1)), (1, (0, 0))):
        worker = nixl.NixlWorker(16, sharding=nixl.Sharding(2, 8), rank=rank)
        worker.before_load(None, orders)
        counts = worker.take_counts()
        assert (counts["transfers_loaded"], counts["transfer_params_unknown_keys"]) == expected
        assert worker.take_counts()["transfers_loaded"] == 0


def test_the_new_counters_are_in_the_table():
    for name in ("transfers_loaded", "transfer_params_unknown_keys"):
        assert stats.BY_NAME[name].label is None


def test_many_prefill_tensor_parallel_sizes_are_said_up_to_a_bound(caplog):
    worker = nixl.NixlWorker(16, sharding=nixl.Sharding(2, 8), rank=0)
    loads = [nixl.LoadOrder("request", tp_size, [], [], 0, 0) for tp_size in range(1, 3000)]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        worker.before_load(None, nixl.NixlOrders(loads=loads))
    said = [record.getMessage() for record in caplog.records if "compares" in record.getMessage()]
    assert len(said) == claim.SAID_LIMIT, len(said)
    assert len(worker._said) == claim.SAID_LIMIT
