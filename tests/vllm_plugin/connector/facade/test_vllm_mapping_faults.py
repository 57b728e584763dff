"""Faults of any size and duration under the connector's policies, on the pooled repair and
quarantine engines (conftest.py): more violations in one step than the canary's
ring holds (every request of the step is reported, the engine goes on), and a fault that
comes back after every repair (the request's repairs of that block are bounded by
``KVCANARY_VLLM_MAX_REPAIRS``; it then goes on, counted and logged with the block's holders).
"""

import random

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from connector_driver import Reported, _greedy, _metric, _worker_connector, clean_answers  # noqa: E402
from engine_driver import BLOCK_SIZE, decoding, parse_violations, random_tokens  # noqa: E402
from test_vllm_connector import _clean_then_decoding, _prompts, _run_to_end  # noqa: E402

from torch_kvcanary.integrations.vllm import plugin  # noqa: E402

# Requests sharing a prefix of four blocks, each with a tail of its own: a step of them all
# reads each of its context slots once per request, more than a ring of 1,024 violations holds
# once every slot is flipped (the engines hold 8 requests and 24 blocks).
_READERS, _PREFIX = 8, 4 * BLOCK_SIZE


def _overflowing(llm, lines, label: str) -> tuple[list, object]:
    """A clean run's answers, the same requests decoding, and every element of every slot
    of their context flipped (the slots past it are left: attention reads them masked, and
    no canary checks them): the next step reads more violations than the ring holds."""
    rng = random.Random(31)
    prefix = random_tokens(rng, _PREFIX)
    prompts = [prefix + random_tokens(rng, 10 + i) for i in range(_READERS)]
    clean = clean_answers(llm, prompts, 24)
    driver = decoding(llm, lines, label, prompts, [_greedy(24)] * _READERS)
    state = plugin.active()
    assert sum(driver.context(r) for r in driver.ids) > state.canary.ring_capacity
    slots = sorted({(driver.blocks(r)[p // BLOCK_SIZE], p % BLOCK_SIZE) for r in driver.ids for p in range(driver.context(r))})
    blocks, offsets = (torch.tensor(column) for column in zip(*slots))
    state.kv_caches[1].view(torch.int32)[blocks, :, offsets] ^= 1 << 30  # every element of each slot, once
    return clean, driver


def test_a_ring_overflow_under_repair_recomputes_every_request_of_the_step(repair_engine, monkeypatch):
    llm, lines, _ = repair_engine
    reported = Reported(monkeypatch, _worker_connector())
    clean, driver = _overflowing(llm, lines, "overflow-repair")
    state = plugin.active()
    overflow = state.stats()["ring_overflow"]
    held = {r: driver.blocks(r)[: (driver.context(r) - 1) // BLOCK_SIZE + 1] for r in driver.ids}
    driver.step()  # raises nothing
    assert state.stats()["ring_overflow"] > overflow
    assert reported.take() >= {b for blocks in held.values() for b in blocks}  # every block of every reader's context
    outputs = _run_to_end(driver)
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    said = lines.take()
    assert state.on and parse_violations([line for line in said if "full ring" not in line])
    assert any(
        "lost to a full ring (KVCANARY_VLLM=repair): every request of the step is reported to vLLM, which recomputes each" in line
        for line in said
    )
    (after,) = llm.generate([{"prompt_token_ids": _prompts(33)[0]}], _greedy(8), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 8
    llm.reset_prefix_cache()


def test_a_ring_overflow_under_quarantine_fails_the_requests_of_the_step(quarantine_engine, monkeypatch):
    llm, lines, _ = quarantine_engine
    failed = _metric("vllm:kv_canary_requests_failed_total")
    _, driver = _overflowing(llm, lines, "overflow-quarantine")
    outputs = _run_to_end(driver)
    assert all(outputs[r].outputs[0].finish_reason == "error" for r in driver.ids)
    assert _metric("vllm:kv_canary_requests_failed_total") - failed == _READERS
    said = lines.take()
    assert plugin.active().on and parse_violations([line for line in said if "full ring" not in line])
    assert any(
        "lost to a full ring (KVCANARY_VLLM=quarantine): every request of the step is reported to vLLM, which fails each" in line
        for line in said
    )
    (after,) = llm.generate([{"prompt_token_ids": _prompts(34)[0]}], _greedy(8), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 8
    llm.reset_prefix_cache()


def test_a_fault_that_comes_back_after_every_repair_is_repaired_a_bounded_number_of_times(repair_engine, monkeypatch):
    llm, lines, _ = repair_engine
    state = plugin.active()
    monkeypatch.setattr(state, "max_repairs", 2, raising=False)
    repaired, given_up = _metric("vllm:kv_canary_blocks_repaired_total"), _metric("vllm:kv_canary_repairs_given_up_total")
    reported = Reported(monkeypatch, _worker_connector())
    clean, driver = _clean_then_decoding(llm, lines, "persistent", _prompts(35), 40)
    victim = driver.ids[1]
    internal, block = driver.internal_id(victim), driver.blocks(victim)[1]  # the victim's own block
    element = state.kv_caches[1].view(torch.int32)[block, 1, 5]
    wrong = int(element[77]) ^ (1 << 30)
    done: dict = {}
    for _ in range(150):  # the block's bytes go bad again after every step, recomputed or not
        element[77] = wrong
        done.update({o.request_id: o for o in driver.step() if o.finished})
        if len(done) == len(driver.ids):
            break
    assert len(done) == len(driver.ids), "a request rolled back for ever"
    assert [done[r].outputs[0].token_ids for r in driver.ids if r != victim] == [clean[0], clean[2]]
    assert [s for s in reported.steps if block in s] and len([s for s in reported.steps if block in s]) == 2
    assert _metric("vllm:kv_canary_blocks_repaired_total") - repaired >= 2
    assert _metric("vllm:kv_canary_repairs_given_up_total") - given_up == 1
    logged = [line for line in lines.take() if "repaired 2 times" in line]
    assert len(logged) == 1 and internal in logged[0] and f"block {block}" in logged[0]
    assert state.on
    (after,) = llm.generate([{"prompt_token_ids": _prompts(36)[0]}], _greedy(8), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 8
    llm.reset_prefix_cache()


def test_the_row_reset_reads_the_blocks_the_scheduler_holds(repair_engine, monkeypatch):
    # The blocks a row is set back to (`misread_blocks`, `overflow_blocks`) are Model Runner
    # V1's request state: at every step, for every running request, the blocks vLLM's
    # scheduler holds for it (docs/vllm_connector.md). Pins vLLM's side of that rule.
    llm, lines, _ = repair_engine
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    driver = decoding(llm, lines, "views", _prompts(37), [_greedy(30)] * 3)
    states = plugin.active().model_runner.requests
    compared = 0
    while scheduler.running:
        for request in scheduler.running:
            held = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            assert [list(ids) for ids in states[request.request_id].block_ids] == [list(ids) for ids in held]
            compared += 1
        driver.step()
    assert compared > 3 and lines.take() == []
    llm.reset_prefix_cache()


def test_a_drill_flipping_the_same_block_again_is_always_repaired(repair_engine, monkeypatch):
    # A fault drill's flip is a fault of its own (the operator asked for it), not one that
    # came back: the same block drilled after every recompute is reported each time, past
    # the limit, and no request is given up.
    from torch_kvcanary.integrations.vllm.connector.drill import Drill

    llm, lines, _ = repair_engine
    state, worker_connector = plugin.active(), _worker_connector()
    monkeypatch.setattr(state, "max_repairs", 1, raising=False)
    monkeypatch.setattr(worker_connector, "drill", Drill(0.0))  # flips nothing itself: the test's flips are its drills
    given_up = _metric("vllm:kv_canary_repairs_given_up_total")
    reported = Reported(monkeypatch, worker_connector)
    clean, driver = _clean_then_decoding(llm, lines, "drilled", _prompts(38), 40)
    block = driver.blocks(driver.ids[1])[1]
    element = state.kv_caches[1].view(torch.int32)[block, 1, 5]
    right = int(element[77])
    for _ in range(8):
        element[77] = right ^ (1 << 30)
        worker_connector.drill.pending.update(dict.fromkeys(range(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE), 0))
        driver.step()
    assert len([s for s in reported.steps if block in s]) >= 3
    assert _metric("vllm:kv_canary_repairs_given_up_total") == given_up
    outputs = _run_to_end(driver)
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    lines.take()
    llm.reset_prefix_cache()
