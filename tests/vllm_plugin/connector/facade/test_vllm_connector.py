"""The canary's KV connector (`KvCanaryConnector`) on the real engine (vLLM's CPU build),
in-process and driven step by step: repair (vLLM recomputes the blocks the canary flagged)
and quarantine (vLLM fails the requests that read them), the rule for violations of the
mapping, the counters in vLLM's Prometheus metrics, fault drills, the preconditions of the
connector policies and the inner connectors it refuses; and through `vllm serve`
(`testing.serve.Server`), repaired drills and quarantine. The transports' own tests are in
../disk/ and ../nixl/, the delegate's forwarding of vLLM's connector base in ../delegate/.

The engines serve a tiny random Llama in float32 (vLLM's recompute of a request then
reproduces the tokens of a clean run), with prefix caching and chunked prefill, under
synchronous scheduling.
"""

import concurrent.futures
import json
import random
import re

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from connector_driver import Reported, _greedy, _metric, _worker_connector, clean_answers, connector_engine, refused_start  # noqa: E402
from engine_driver import BLOCK_SIZE, Driver, decoding, mixed_workload, parse_violations, random_tokens  # noqa: E402

from torch_kvcanary.integrations.vllm import config, connector, plugin  # noqa: E402
from torch_kvcanary.testing.serve import Server  # noqa: E402


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = random_tokens(rng, BLOCK_SIZE + 7)  # one block shared by every request
    return [prefix + random_tokens(rng, 40 + 17 * i) for i in range(3)]


def _run_to_end(driver: Driver, max_steps: int = 400, done: dict | None = None) -> dict[str, object]:
    """Steps until every request of ``driver`` has finished (``done``: those that have, by our
    id): their final outputs by our id."""
    done = dict(done or {})
    for _ in range(max_steps):
        for output in driver.step():
            if output.finished:
                done[output.request_id] = output
        if len(done) == len(driver.ids):
            return done
    raise AssertionError(f"requests {sorted(set(driver.ids) - set(done))} did not finish")


def _clean_then_decoding(llm, lines, label: str, prompts: list[list[int]], max_tokens: int) -> tuple[list, Driver]:
    """A clean run's greedy answers to ``prompts``, then the same requests decoding in a
    driver with no report on the way: where a test injects its fault."""
    clean = clean_answers(llm, prompts, max_tokens)
    return clean, decoding(llm, lines, label, prompts, [_greedy(max_tokens)] * len(prompts))


def _flip(driver: Driver, request_id: str, block_index: int) -> int:
    """Flips one bit of the request's block ``block_index`` (layer 1, head 1): that block."""
    block = driver.blocks(request_id)[block_index]
    plugin.active().kv_caches[1].view(torch.int32)[block, 1, 5, 77] ^= 1 << 30  # the top exponent bit: the value is way off
    return block


# Without a transfer -------------------------------------------------------------------


def test_the_connector_is_registered_under_its_class_name(repair_engine):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert connector.KvCanaryConnector.__name__ == config.CONNECTOR
    assert KVConnectorFactory.get_connector_class_by_name(config.CONNECTOR) is connector.KvCanaryConnector
    plugin.register()  # again: nothing happens
    assert KVConnectorFactory.get_connector_class_by_name(config.CONNECTOR) is connector.KvCanaryConnector


def test_without_an_inner_connector_scheduling_is_unchanged(repair_engine):
    llm, _, _ = repair_engine
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ours = scheduler.connector
    assert isinstance(ours, connector.KvCanaryConnector) and ours.inner is None
    assert ours.requires_kv_delivery is False and scheduler.defer_block_free is False
    assert ours.has_pending_block_frees() is False and ours.has_pending_push_work() is False
    seen = []
    matched, finished = ours.get_num_new_matched_tokens, ours.request_finished

    def matching(request, num_computed_tokens):
        seen.append(("matched", matched(request, num_computed_tokens)))
        return seen[-1][1]

    def finishing(request, block_ids):
        seen.append(("finished", finished(request, block_ids)))
        return seen[-1][1]

    ours.get_num_new_matched_tokens, ours.request_finished = matching, finishing
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(11)], _greedy(8), use_tqdm=False)
    finally:
        del ours.get_num_new_matched_tokens, ours.request_finished
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]
    assert {answer for kind, answer in seen if kind == "matched"} == {(0, False)}
    assert [answer for kind, answer in seen if kind == "finished"] == [(False, None)] * 3
    llm.reset_prefix_cache()


# Repair ---------------------------------------------------------------------------------


@pytest.mark.every_release
def test_a_mixed_workload_under_repair_reports_nothing(repair_engine, monkeypatch):
    # Shared prefixes, chunked prefill and preemption: no violation, so no block for vLLM.
    reported = Reported(monkeypatch, _worker_connector())
    mixed_workload(*repair_engine)
    assert reported.steps and reported.take() == set()
    repair_engine[0].reset_prefix_cache()


@pytest.mark.every_release
def test_repair_recomputes_a_flipped_block_and_the_answers_are_a_clean_runs(repair_engine, monkeypatch):
    _assert_a_flipped_block_is_repaired(repair_engine, monkeypatch, "repair")


# What vLLM's Python API passes on as a cache salt (`vllm serve` refuses all but strs): each
# is rooted in its own text (`adapter.identity.salt_text`), nothing of it raises.
CLIENT_SALTS = ["\ud800", "\udfff\ud800", "", "a\x00b", "x" * (1 << 20), 123, 0, 1.5, b"bytes", ("a", 1), None]


def test_any_cache_salt_is_answered_and_the_canary_stays_on_and_repairing(repair_engine, monkeypatch):
    llm, lines, _ = repair_engine
    clean = clean_answers(llm, _prompts(21), 8)
    for salt in CLIENT_SALTS:
        salted = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in _prompts(21)], _greedy(8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in salted] == clean, repr(salt)[:20]
        assert lines.take() == [] and plugin.active().on, repr(salt)[:20]
    assert _metric("vllm:kv_canary_canary_faults_total") == 0
    _assert_a_flipped_block_is_repaired(repair_engine, monkeypatch, "after-salts")


def _assert_a_flipped_block_is_repaired(repair_engine, monkeypatch, label: str) -> None:
    """A byte of a decoding request's block flipped: named, the block reported to vLLM's
    scheduler, recomputed, and every answer a clean run's."""
    llm, lines, preemptions = repair_engine
    reported = Reported(monkeypatch, _worker_connector())
    repaired_before = _metric("vllm:kv_canary_blocks_repaired_total")
    clean, driver = _clean_then_decoding(llm, lines, label, _prompts(12), 80)
    assert reported.take() == set()
    victim = driver.ids[1]
    scheduled = llm.llm_engine.engine_core.engine_core.scheduler.requests[driver.internal_id(victim)]
    assert scheduled.num_computed_tokens > 2 * BLOCK_SIZE
    block = _flip(driver, victim, 1)  # the victim's own second block
    driver.step()
    assert reported.take() == {block}  # one block of 32 slots, reported to vLLM's scheduler
    found = parse_violations(lines.take())
    assert found and all(reasons == ["verify_real_kv_hash"] and slot // BLOCK_SIZE == block for reasons, slot, _ in found)
    # vLLM rolled the victim back to the start of the block and recomputes it from there.
    assert scheduled.num_computed_tokens == BLOCK_SIZE
    outputs = _run_to_end(driver)
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    assert lines.take() == [] and reported.take() == set()  # recomputed: the block verifies again
    assert plugin.active().on
    assert _metric("vllm:kv_canary_blocks_repaired_total") - repaired_before == 1
    assert _metric("vllm:kv_canary_violations_total", reason="verify_real_kv_hash") >= len(found)
    assert _metric("vllm:kv_canary_slots_verified_total") > 0 and _metric("vllm:kv_canary_slots_recorded_total") > 0
    llm.reset_prefix_cache()


def test_faults_of_the_canarys_own_code_in_the_connector_calls_leave_the_engine_serving_and_repairing(repair_engine, monkeypatch):
    # The mapping rule, the repair rule and the counters each raise at every call: the
    # flipped block is still reported and recomputed (as a byte fault), each part's first
    # fault is logged with its traceback and every one counted, and the canary stays on.
    from torch_kvcanary.integrations.vllm.worker_port import WorkerPort

    def fault(*args, **kwargs):
        raise ZeroDivisionError("a fault injected into the canary's code")

    llm, lines, _ = repair_engine
    before = {part: _metric("vllm:kv_canary_canary_faults_total", part=part) for part in ("mapping", "repair", "counters")}
    reported = Reported(monkeypatch, _worker_connector())
    clean, driver = _clean_then_decoding(llm, lines, "own-faults", _prompts(14), 60)
    for name in ("misread_blocks", "break_from_flagged_blocks", "counters"):
        monkeypatch.setattr(WorkerPort, name, fault)
    block = _flip(driver, driver.ids[1], 1)
    driver.step()
    assert reported.take() == {block}
    outputs = _run_to_end(driver)
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    assert plugin.active().on
    logged = [line for line in lines.take() if "failed in a KV connector call" in line]
    assert sorted(re.search(r"call \((\w+)\)", line)[1] for line in logged) == ["counters", "mapping", "repair"]
    counted = {part: _metric("vllm:kv_canary_canary_faults_total", part=part) - n for part, n in before.items()}
    assert counted["repair"] == 1 and counted["mapping"] >= 1 and counted["counters"] >= 2, counted
    monkeypatch.undo()
    llm.reset_prefix_cache()


def test_without_the_repair_the_flipped_bit_changes_the_answer(repair_engine, monkeypatch):
    # What makes the comparison with a clean run above mean something: the same flip, with
    # the connector reporting nothing, changes the victim's greedy answer.
    llm, lines, _ = repair_engine
    monkeypatch.setattr(connector.KvCanaryConnector, "_reports_blocks", lambda self: False)
    clean, driver = _clean_then_decoding(llm, lines, "unrepaired", _prompts(12), 80)
    _flip(driver, driver.ids[1], 1)
    outputs = _run_to_end(driver)
    answers = [outputs[r].outputs[0].token_ids for r in driver.ids]
    assert answers[1] != clean[1] and parse_violations(lines.take())
    llm.reset_prefix_cache()  # the flipped block's bytes stay wrong


def test_repair_recomputes_a_shared_prefix_block_for_every_reader(repair_engine, monkeypatch):
    llm, lines, _ = repair_engine
    reported = Reported(monkeypatch, _worker_connector())
    clean, driver = _clean_then_decoding(llm, lines, "shared", _prompts(13), 60)
    shared = driver.blocks(driver.ids[0])[0]
    assert all(driver.blocks(r)[0] == shared for r in driver.ids)  # the prefix cache's block
    state = plugin.active()
    readers = {b for r in driver.ids for b in driver.blocks(r)}
    _flip(driver, driver.ids[0], 0)
    driver.step()
    assert reported.take() == {shared}
    # The shared block's records stay broken until the reader vLLM rolled back writes it
    # again (a reader reading it before then is reported too); every reader's other blocks,
    # computed from intact KV before the fault was read, are never reported.
    outputs = _run_to_end(driver)
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    later = set().union(*reported.steps)
    assert later <= {shared} and not any(reported.steps[-10:]), (later, readers)
    assert state.on
    lines.take()
    llm.reset_prefix_cache()


def _a_wrong_block_entry(llm, lines, reported: Reported, label: str):
    """Three decoding requests, the first's block-table entry 1 pointed at the second's block 1
    for one step (bytes intact, vLLM's scheduler unaware): the step goes on; the connector
    reports a block of the first request's own, never the block it read; the answers by
    request, against a clean run's, and the violations counted in /metrics by that step."""
    rng = random.Random(14)
    prompts = [random_tokens(rng, 75 + 9 * i) for i in range(3)]
    clean = clean_answers(llm, prompts, 60)
    driver = decoding(llm, lines, label, prompts, [_greedy(60) for _ in prompts])
    reader, owner, _ = driver.ids
    state = plugin.active()
    row = driver.rows()[driver.internal_id(reader)]
    own, read = driver.blocks(reader), driver.blocks(owner)[1]
    context = driver.context(reader)
    counted = _metric("vllm:kv_canary_violations_total", reason="verify_token")
    reported.take()
    state.block_table.block_table.np[row, 1] = read
    ended = {o.request_id: o for o in driver.step() if o.finished}  # raises nothing; under quarantine the reader ends here
    assert reported.take() == {own[(context - 1) // BLOCK_SIZE]}  # the reader's last block of context, not the owner's
    assert _metric("vllm:kv_canary_violations_total", reason="verify_token") > counted  # sent by the step that found it
    assert {r for _, _, requests in parse_violations(lines.take()) for r in requests} == {driver.internal_id(reader)}
    outputs = {**ended, **_run_to_end(driver, done=ended)}
    # The engine serves the next request.
    (after,) = llm.generate([{"prompt_token_ids": prompts[2]}], _greedy(8), use_tqdm=False)
    assert list(after.outputs[0].token_ids) == list(clean[2][:8])
    assert state.on
    return driver, outputs, clean


def _a_wrong_entry_after_a_prefix_hit(llm, lines, reported: Reported, monkeypatch):
    """A reader whose context before its first step is a prefix-cache hit of two blocks that
    a running request (the sharer) holds too, its entry 0 pointed at a third request's block
    in that step: the context ends at a block boundary, in a block the sharer holds. The
    answers by request, a clean run's, and every block reported."""
    rng = random.Random(19)
    prefix = random_tokens(rng, 2 * BLOCK_SIZE)
    prompts = [prefix + random_tokens(rng, 30), random_tokens(rng, 70), prefix + random_tokens(rng, 20)]
    clean = clean_answers(llm, prompts, 40)
    driver = decoding(llm, lines, "hit", prompts[:2], [_greedy(40)] * 2)
    sharer, owner = driver.ids
    reader = driver.add(prompts[2], _greedy(40))
    state, pointed = plugin.active(), []
    update_states = state.model_runner._update_states

    def pointing(scheduler_output):
        result = update_states(scheduler_output)
        rows = driver.rows()
        row = next((rows[r] for r in rows if r.rsplit("-", 1)[0] == reader), None)
        if row is not None and not pointed:
            assert driver.context(reader) == 2 * BLOCK_SIZE  # the hit, about to be read
            pointed.extend([driver.blocks(owner)[0], driver.blocks(sharer)[:2]])
            state.block_table.block_table.np[row, 0] = pointed[0]
        return result

    reported.take()
    with monkeypatch.context() as patched:
        patched.setattr(state.model_runner, "_update_states", pointing)
        ended = {o.request_id: o for o in driver.step() if o.finished}
    assert pointed and {r for _, _, requests in parse_violations(lines.take()) for r in requests} == {driver.internal_id(reader)}
    outputs = {**ended, **_run_to_end(driver, done=ended)}
    lines.take()
    llm.reset_prefix_cache()
    return [outputs[r] for r in (sharer, owner, reader)], clean, reported.take(), pointed[1]


def test_a_wrong_block_entry_under_repair_recomputes_the_reader_alone(repair_engine, monkeypatch):
    llm, lines, _ = repair_engine
    driver, outputs, clean = _a_wrong_block_entry(llm, lines, Reported(monkeypatch, _worker_connector()), "mapping")
    # The worker's row was set back to the scheduler's blocks; every answer is a clean run's.
    assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
    assert lines.take() == []
    llm.reset_prefix_cache()
    # After a prefix hit the block reported is the shared one: its other holder computes its step again.
    outputs, clean, reported, shared = _a_wrong_entry_after_a_prefix_hit(
        llm, lines, Reported(monkeypatch, _worker_connector()), monkeypatch
    )
    assert [o.outputs[0].token_ids for o in outputs] == clean
    assert reported == {shared[1]}


def _polls(llm, monkeypatch) -> int:
    """How many times the worker read the canary's verdicts while three clean requests ran."""
    state, polls = plugin.active(), []
    poll = state.canary.poll
    monkeypatch.setattr(state.canary, "poll", lambda: polls.append(1) or poll())
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(18)], _greedy(8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]
    llm.reset_prefix_cache()
    return len(polls)


def test_under_repair_each_step_waits_for_its_verdict(repair_engine, monkeypatch):
    # The connector reports the step's blocks right after its forward: at least one read a step.
    assert plugin.active().waits_for_verdicts
    assert _polls(repair_engine[0], monkeypatch) >= 8


def test_under_log_a_clean_step_reads_no_verdict_with_the_connector_configured(tiny_llama, monkeypatch):
    # Nothing acts on a step's verdict at once: a violation-free step reads the mailbox's word alone.
    with connector_engine(tiny_llama, "log") as (llm, _, _):
        assert isinstance(plugin.active().connector, connector.KvCanaryConnector)
        assert not plugin.active().waits_for_verdicts
        assert _polls(llm, monkeypatch) == 0


# Drills ---------------------------------------------------------------------------------


def test_a_drill_is_caught_and_repaired(tiny_llama):
    environ = {config.DRILL_ENV: "0.5"}
    with connector_engine(tiny_llama, "repair", environ=environ) as (llm, lines, _):
        assert "policy repair through KvCanaryConnector, drills with probability 0.5 per step;" in llm.startup_log
        ours = _worker_connector()
        drill = ours.drill
        assert drill is not None and drill.probability == 0.5
        drill.probability = 0.0
        injected, caught = _metric("vllm:kv_canary_drills_injected_total"), _metric("vllm:kv_canary_drills_caught_total")
        clean, driver = _clean_then_decoding(llm, lines, "drill", _prompts(15), 60)
        drill.probability = 1.0  # one drill in the next step, then none
        driver.step()
        drill.probability = 0.0
        outputs = _run_to_end(driver)
        assert [outputs[r].outputs[0].token_ids for r in driver.ids] == clean
        assert drill.pending == {}
        assert _metric("vllm:kv_canary_drills_injected_total") - injected == 1
        assert _metric("vllm:kv_canary_drills_caught_total") - caught == 1
        assert _metric("vllm:kv_canary_drill_steps_to_catch_total") == 0  # caught in the step that flipped it
        assert len(parse_violations(lines.take())) >= 1


# Quarantine -----------------------------------------------------------------------------


def test_quarantine_fails_only_the_affected_request(quarantine_engine, monkeypatch):
    llm, lines, _ = quarantine_engine
    assert "policy quarantine through KvCanaryConnector;" in llm.startup_log
    reported = Reported(monkeypatch, _worker_connector())
    failed_before = _metric("vllm:kv_canary_requests_failed_total")
    driver = decoding(llm, lines, "quarantine", _prompts(16), [_greedy(80)] * 3)
    victim = driver.ids[2]
    block = _flip(driver, victim, 1)  # the victim's own block, after the shared one
    outputs = _run_to_end(driver)
    assert block in reported.take()
    assert outputs[victim].outputs[0].finish_reason == "error"
    for other in driver.ids[:2]:
        assert outputs[other].outputs[0].finish_reason == "length" and len(outputs[other].outputs[0].token_ids) == 80
    assert _metric("vllm:kv_canary_requests_failed_total") - failed_before == 1
    assert parse_violations(lines.take())
    # The engine keeps serving.
    (after,) = llm.generate([{"prompt_token_ids": _prompts(17)[0]}], _greedy(8), use_tqdm=False)
    assert len(after.outputs[0].token_ids) == 8
    llm.reset_prefix_cache()  # the flipped block's bytes stay wrong


def test_a_wrong_block_entry_under_quarantine_fails_the_reader_alone(quarantine_engine, monkeypatch):
    llm, lines, _ = quarantine_engine
    failed = _metric("vllm:kv_canary_requests_failed_total")
    driver, outputs, clean = _a_wrong_block_entry(llm, lines, Reported(monkeypatch, _worker_connector()), "mapping")
    reader, *others = driver.ids
    assert outputs[reader].outputs[0].finish_reason == "error"
    assert [outputs[r].outputs[0].token_ids for r in others] == clean[1:]
    assert _metric("vllm:kv_canary_requests_failed_total") - failed == 1
    # After a prefix hit the shared block is not reported: the reader fails at its next read, alone.
    reported = Reported(monkeypatch, _worker_connector())
    (sharer, owner, reader), clean, blocks, shared = _a_wrong_entry_after_a_prefix_hit(llm, lines, reported, monkeypatch)
    assert reader.outputs[0].finish_reason == "error"
    assert [sharer.outputs[0].token_ids, owner.outputs[0].token_ids] == clean[:2]
    assert len(blocks) == 1 and not blocks & set(shared)
    assert _metric("vllm:kv_canary_requests_failed_total") - failed == 2


# Preconditions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, options, needs",
    [
        (
            "repair",
            dict(kv_transfer_config=None),
            r'KVCANARY_VLLM=repair needs vLLM\'s KV connector to be KvCanaryConnector \(--kv-transfer-config \'\{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"\}\'\)',
        ),
        (
            "quarantine",
            dict(failure_policy="recompute"),
            r'KVCANARY_VLLM=quarantine needs "kv_load_failure_policy": "fail" in the kv_transfer_config, not "recompute"',
        ),
    ],
)
def test_a_policy_the_engine_cannot_serve_is_refused_at_start(tiny_llama, policy, options, needs):
    error = refused_start(tiny_llama, policy, **options)
    assert re.match(f"kv-canary: {needs}: change that, or unset KVCANARY_VLLM to serve without the canary$", str(error)), str(error)


def _stats(**counts) -> connector.CanaryStats:
    stats = connector.CanaryStats()
    for name, count in counts.items():
        if name in connector.REASONS:
            stats.data["violations"][name] += count
        else:
            stats.data[name] += count
    return stats


def test_the_counters_are_summed_over_workers_and_logged_by_vllm(monkeypatch):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    monkeypatch.setenv(config.POLICY_ENV, "log")
    plugin.register()  # the connector's name, as in every process vLLM starts with the plugin on

    assert connector.CanaryStats().is_empty()
    # Two tensor-parallel ranks' stats, as vLLM's output aggregator sums them.
    first = _stats(verify_real_kv_hash=3, slots_verified=100, slots_recorded=7, blocks_repaired=1)
    second = _stats(verify_real_kv_hash=2, verify_token=1, slots_verified=50, drills_injected=1, drills_caught=1)
    total = first.aggregate(second)
    assert total.data["violations"]["verify_real_kv_hash"] == 5 and total.data["violations"]["verify_token"] == 1
    assert (total.data["slots_verified"], total.data["slots_recorded"], total.data["blocks_repaired"]) == (150, 7, 1)
    # vLLM's periodic stats log: the payload rebuilt by the connector class, over two steps.
    logging = KVConnectorLogging(KVTransferConfig(kv_connector=config.CONNECTOR, kv_role="kv_both"))
    logging.observe(total.to_dict())
    logging.observe(_stats(verify_real_kv_hash=1, requests_failed=2).to_dict())
    said = []
    logging.log(lambda text, line: said.append(text % line))
    (line,) = said
    assert line == (
        "KV Transfer metrics: kv_canary_violations_verify_real_kv_hash=6, kv_canary_violations_verify_token=1, "
        "kv_canary_slots_verified=150, kv_canary_slots_recorded=7, kv_canary_blocks_repaired=1, kv_canary_repairs_given_up=0, "
        "kv_canary_requests_failed=2, kv_canary_drills_injected=1, kv_canary_drills_caught=1, kv_canary_drill_steps_to_catch=0, kv_canary_drills_expired=0, "
        "kv_canary_transfer_slots_verified=0, kv_canary_transfer_slots_failed=0, kv_canary_transfer_slots_handed_over=0, "
        "kv_canary_canary_faults=0, kv_canary_transfers_loaded=0, kv_canary_transfers_unclaimed=0, "
        "kv_canary_transfer_params_unknown_keys=0"
    )


# Through `vllm serve` ---------------------------------------------------------------------


def _server(model, policy: str, failure_policy: str, drill: float, tokens_per_step: int = 64):
    """`vllm serve` (`testing.serve.Server`: the API server, the engine core and its worker,
    each a process of its own, on 127.0.0.1) on the float32 model with the plugin under
    ``policy`` and `KvCanaryConnector`, fault drills of probability ``drill``, and at most
    ``tokens_per_step`` tokens a step."""
    transfer = json.dumps({"kv_connector": config.CONNECTOR, "kv_role": "kv_both", "kv_load_failure_policy": failure_policy})
    options = (
        "--dtype", "float32", "--max-model-len", "512", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(8 << 20),
        "--enforce-eager", "--enable-prefix-caching", "--no-async-scheduling", "--max-num-batched-tokens", str(tokens_per_step),
        "--kv-transfer-config", transfer,
    )  # fmt: skip
    return Server(model, {config.POLICY_ENV: policy, config.DRILL_ENV: str(drill)}, options)


def _tokens_of(answer: dict) -> list[int] | None:
    """The completion's token ids, or None for an HTTP error."""
    return None if "error" in answer else answer["choices"][0]["token_ids"]


def _concurrently(server, prompts: list[list[int]], max_tokens: list[int]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda args: server.complete(*args, return_token_ids=True), zip(prompts, max_tokens)))


def _counters(server) -> dict[str, float]:
    """The ``vllm:kv_canary_*`` counters of ``/metrics`` (violations by reason as ``..._total[reason]``)."""
    counters = {}
    for line in server.metrics().splitlines():
        match = re.match(r"^(vllm:kv_canary_\w+_total)\{([^}]*)\} (\S+)$", line)
        if match:
            reason = re.search(r'reason="(\w+)"', match[2])
            counters[match[1] + (f"[{reason[1]}]" if reason else "")] = float(match[3])
    return counters


# Cache salts a client may send `vllm serve` (which refuses some itself, with HTTP 400).
SERVED_SALTS = ["\ud800", "", "a\x00b", "x" * (1 << 20), 123, None, ["a"]]


@pytest.mark.every_release
def test_vllm_serve_repairs_drilled_faults(tiny_llama):
    prompts = _prompts(18)
    with _server(tiny_llama, "repair", "recompute", drill=0.0) as server:
        clean = [_tokens_of(server.complete(prompt, 40, return_token_ids=True)) for prompt in prompts]
    assert all(len(tokens) == 40 for tokens in clean)
    with _server(tiny_llama, "repair", "recompute", drill=0.25) as server:
        # What a client may send as a cache salt: answered or refused (HTTP 400), the canary on.
        salted = [server.complete(prompts[0][:20], 4, return_token_ids=True, cache_salt=salt) for salt in SERVED_SALTS]
        assert [answer.get("error", 200) in (200, 400) for answer in salted] == [True] * len(SERVED_SALTS), salted
        answers = [_tokens_of(answer) for answer in _concurrently(server, prompts, [40] * len(prompts))]
        assert answers == clean  # every drilled block recomputed: the clean run's greedy tokens
        counters = _counters(server)
        assert server.alive() and _tokens_of(server.complete(prompts[0][:20], 4, return_token_ids=True)) is not None
        assert server.metric("vllm:kv_canary_enabled") == 1
        said, errors = server.log(), [line for line in server.lines() if line[2] == "ERROR"]
    assert "Traceback" not in said and not errors, errors
    assert "policy repair through KvCanaryConnector, drills with probability 0.25 per step;" in said
    assert counters["vllm:kv_canary_drills_injected_total"] >= 1
    assert counters["vllm:kv_canary_drills_caught_total"] == counters["vllm:kv_canary_drills_injected_total"]
    assert counters["vllm:kv_canary_blocks_repaired_total"] >= counters["vllm:kv_canary_drills_injected_total"]
    assert counters["vllm:kv_canary_violations_total[verify_real_kv_hash]"] >= counters["vllm:kv_canary_drills_injected_total"]
    assert counters["vllm:kv_canary_violations_total[verify_token]"] == 0 and counters["vllm:kv_canary_slots_verified_total"] > 0
    assert "Recovered from KV load failure" in said


def test_vllm_serve_quarantine_fails_only_the_affected_requests(tiny_llama):
    # A drill at every step that runs a forward, in a slot of a request with context: a
    # request of several steps is drilled and fails; one answered by its first forward
    # (its whole prompt in one step, one token) has no context to drill, and completes.
    rng = random.Random(19)
    long = [random_tokens(rng, 50) for _ in range(2)]
    short = [random_tokens(rng, 20) for _ in range(3)]
    with _server(tiny_llama, "quarantine", "fail", drill=1.0, tokens_per_step=512) as server:
        answers = _concurrently(server, long + short, [20] * len(long) + [1] * len(short))
        assert [answer.get("error", 200) for answer in answers] == [500] * len(long) + [200] * len(short)
        assert all(len(_tokens_of(answer)) == 1 for answer in answers[len(long) :])
        counters = _counters(server)
        assert server.alive() and _tokens_of(server.complete(short[0][:10], 1, return_token_ids=True)) is not None  # still serving
        said = server.log()
    assert counters["vllm:kv_canary_requests_failed_total"] == len(long)
    assert counters["vllm:kv_canary_drills_caught_total"] == counters["vllm:kv_canary_drills_injected_total"] >= len(long)
    assert "Failing 1 request(s) due to KV load failure" in said


@pytest.mark.parametrize("size, dtype", [(1, torch.uint8), (2, torch.int16), (4, torch.int32), (8, torch.int64)])
@pytest.mark.parametrize("bit", range(8))
def test_a_drill_flips_a_bit_of_the_top_byte(size, dtype, bit):
    value = torch.zeros((), dtype=dtype)
    value.bitwise_xor_(connector.drill._top_byte_bit(size, bit))
    assert value.item() % (1 << 8 * size) == 1 << (8 * (size - 1) + bit)


# A connector whose loads the canary cannot verify (LMCacheConnectorV1), refused where it
# would load KV: as the inner connector, and in the canary's place; ROLE is its kv_role.
UNVERIFIED_LOADS = {
    "check_inner": (
        r"^kv-canary: KvCanaryConnector verifies the KV an inner connector loads for ExampleConnector, NixlConnector only; "
        r'LMCacheConnectorV1 with "kv_role": "ROLE" would load KV the canary has no records of: give it "kv_role": "kv_producer", '
        r"or unset KVCANARY_VLLM to serve it without the canary$"
    ),
    "check_unwrapped": (
        r'^kv-canary: vLLM\'s KV connector LMCacheConnectorV1 with "kv_role": "ROLE" loads KV into the cache outside the model\'s '
        r'forward, into slots the canary holds no records of, which it would report as corrupt: give it "kv_role": "kv_producer" '
        r"\(KvCanaryConnector verifies the loads of ExampleConnector, NixlConnector only\), or unset KVCANARY_VLLM to serve it without the canary$"
    ),
}


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_the_inner_connectors_whose_loads_are_verified_are_accepted(role):
    from vllm.config import KVTransferConfig

    connector.check_inner(KVTransferConfig(kv_connector="ExampleConnector", kv_role=role))
    connector.check_inner(KVTransferConfig(kv_connector="NixlConnector", kv_role=role))  # (connector/nixl/test_vllm_pd_pair.py)


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
@pytest.mark.parametrize("check", list(UNVERIFIED_LOADS))
def test_a_connector_that_would_load_unverified_kv_is_refused(check, role):
    from vllm.config import KVTransferConfig

    refuse = getattr(connector, check)
    refuse(KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_producer"))  # saves only
    with pytest.raises(ValueError, match=UNVERIFIED_LOADS[check].replace("ROLE", role)):
        refuse(KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role=role))
