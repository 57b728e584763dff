"""The chaos soak (tools/vllm_chaos.py, `torch_kvcanary.testing.soak.chaos`) in its short form:
100 requests under `repair`, then under `quarantine`, each on a `vllm serve` of its own with
the soak's fault injector (torch_kvcanary/testing/soak/faults.py), six faults a policy
(flipped bits in a block one request reads, in a shared prefix block, in a preempted
request's block at its resume), then a block-table entry pointed at another request's block
while 32 requests run (`--table-fault`: the server keeps serving, only that request fails
under quarantine, none under repair). The test fails on any of the soak's checks (`ChaosResult.problems`); the checks themselves are shown to bite on
made-up evidence first, without a server. `make chaos-vllm` runs 1,000 requests.
"""

import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.testing.random_models import VOCAB_SIZE  # noqa: E402
from torch_kvcanary.testing.soak import chaos_pd, table_fault  # noqa: E402
from torch_kvcanary.testing.soak.chaos import FLIP_KINDS, ChaosResult, chaos, check  # noqa: E402
from torch_kvcanary.testing.soak.harness import Pass, install_chaos_plugin, report, user_id  # noqa: E402
from torch_kvcanary.testing.soak.table_fault import TableEvidence  # noqa: E402
from torch_kvcanary.testing.soak.unverified import UNCLAIMED, UnverifiedResult, check_unverified  # noqa: E402

REQUESTS, FAULTS = 100, 6


def test_engine_ids_map_to_the_tools_request_ids():
    assert user_id("cmpl-chaos-repair-00024-0-82edb461") == "chaos-repair-00024"
    assert user_id("cmpl-chaos-quarantine-00007-0") == "chaos-quarantine-00007"


def _violation(slot, *requests, reason="verify_real_kv_hash"):
    return (
        f"(Worker pid=1) WARNING 12-05 11:09:35 [policy.py:49] kv_canary violation: launch_tag=vllm fail_reason={reason} "
        f"slot_idx={slot} position=16 stored_token=199 expected_token=199 stored_chain_hash=fp:00000001 expected_aux=fp:00000001 "
        f"request_id={','.join(f'cmpl-{r}-0-abcdef12' for r in requests)}"
    )


RECOVERED = "(EngineCore pid=2) WARNING 12-05 11:09:35 [scheduler.py:3426] Recovered from KV load failure: 1 request(s) rescheduled (81 tokens affected)."


def _metrics(violations=0, repaired=0, failed=0, hits=100, preemptions=3):
    return (
        f'vllm:kv_canary_violations_total{{engine="0",reason="verify_real_kv_hash"}} {violations}\n'
        f'vllm:kv_canary_blocks_repaired_total{{engine="0"}} {repaired}\n'
        f'vllm:kv_canary_requests_failed_total{{engine="0"}} {failed}\n'
        f"vllm:prefix_cache_hits_total {hits}\nvllm:num_preemptions_total {preemptions}\n"
    )


def _evidence(policy="repair"):
    """What a passing chaos pass of two requests looks like to `check`: one fault in block 4
    (slot 130) read by request 0, named in one violation line, repaired."""
    prompts = [([5] * 200, 4), ([6] * 10, 4)]
    clean = [[1, 2, 3, 4], [5, 6, 7, 8]]
    answers = [{"choices": [{"token_ids": tokens, "finish_reason": "length"}]} for tokens in clean]
    fault = dict(kind="single", slot=130, block=4, holders=[f"cmpl-chaos-{policy}-00000-0-abcdef12"])
    fault["readers"] = fault["holders"]
    log = [_violation(130, f"chaos-{policy}-00000"), RECOVERED]
    return prompts, clean, answers, fault, log


def _problems(policy, prompts, clean, answers, faults, log, metrics):
    result = ChaosResult(policy, len(prompts), len(faults), injected=faults)
    check(result, prompts, clean, Pass(answers, 1.0), log, metrics, _metrics(0))
    return result.problems


def test_the_checks_pass_clean_evidence_and_fail_each_broken_one():
    prompts, clean, answers, fault, log = _evidence()
    good = _metrics(violations=1, repaired=1)
    assert _problems("repair", prompts, clean, answers, [fault], log, good) == []
    # An answer that differs from the clean pass's.
    wrong = [answers[0], {"choices": [{"token_ids": [5, 6, 7, 9], "finish_reason": "length"}]}]
    assert any("differ" in p for p in _problems("repair", prompts, clean, wrong, [fault], log, good))
    # A fault no violation line names; a violation line no fault explains.
    assert any("not named" in p for p in _problems("repair", prompts, clean, answers, [fault], [RECOVERED], _metrics()))
    stray = [*log, _violation(900, "chaos-repair-00001")]
    assert any("no injected fault" in p for p in _problems("repair", prompts, clean, answers, [fault], stray, _metrics(2, 2)))
    # Counters that disagree with the log.
    assert any("violations_total" in p for p in _problems("repair", prompts, clean, answers, [fault], log, _metrics(3, 1)))
    assert any("blocks_repaired" in p for p in _problems("repair", prompts, clean, answers, [fault], log, _metrics(1, 2)))
    # A request failing under repair; no preemption.
    failed = [{"error": 500, "body": "x"}, answers[1]]
    assert any("failed under repair" in p for p in _problems("repair", prompts, clean, failed, [fault], log, good))
    assert any("preempt" in p for p in _problems("repair", prompts, clean, answers, [fault], log, _metrics(1, 1, preemptions=0)))


def test_the_quarantine_check_wants_exactly_the_holders_failed():
    prompts, clean, answers, fault, log = _evidence("quarantine")
    log = [log[0], "(EngineCore pid=2) ERROR 12-05 11:09:35 [scheduler.py:3417] Failing 1 request(s) due to KV load failure "
           "(failure_policy=fail, 81 tokens affected). Request IDs: {'cmpl-chaos-quarantine-00000-0-abcdef12'}"]  # fmt: skip
    failed_first = [{"choices": [{"token_ids": [1], "finish_reason": "error"}]}, answers[1]]
    assert _problems("quarantine", prompts, clean, failed_first, [fault], log, _metrics(1, failed=1)) == []
    # The holder served instead of failing; a request that held no corrupted block failed.
    assert any("holders" in p for p in _problems("quarantine", prompts, clean, answers, [fault], log, _metrics(1, failed=1)))
    failed_both = [failed_first[0], {"error": 500, "body": "x"}]
    assert any("holders" in p for p in _problems("quarantine", prompts, clean, failed_both, [fault], log, _metrics(1, failed=2)))


def _table_evidence(policy, **broken):
    """What a passing table fault of three requests looks like: request 1's entry pointed at
    another block, named in a violation line; under quarantine request 1 failed alone."""
    tag, clean = f"table-{policy}", [[1, 2], [3, 4], [5, 6]]
    answers = [{"choices": [{"token_ids": t, "finish_reason": "length"}]} for t in clean]
    if policy == "quarantine":
        answers[1] = {"choices": [{"token_ids": [3], "finish_reason": "error"}]}
    injected = f'(Worker pid=1) INFO kvcanary-chaos: injected {{"request": "cmpl-{tag}-00001-0-abcdef12", "points_at": 7}}'
    fields = dict(
        tag=tag, chaotic=Pass(answers, 1.0), clean=clean, log_lines=[injected, _violation(224, f"{tag}-00001", reason="verify_token")],
        counted=32.0, alive=True, after_answered=True,
    )  # fmt: skip
    return TableEvidence(**{**fields, **broken})


@pytest.mark.parametrize("policy", ["repair", "quarantine"])
def test_the_table_fault_checks_pass_clean_evidence_and_fail_each_broken_one(policy):
    assert table_fault.problems(policy, _table_evidence(policy)) == []
    other = {"choices": [{"token_ids": [5, 9], "finish_reason": "length"}]}
    answers = _table_evidence(policy).chaotic.answers
    broken = {
        "found no target": dict(log_lines=[]),
        "stopped serving": dict(alive=False),
        "did not answer": dict(after_answered=False),
        "differing": dict(chaotic=Pass([*answers[:2], other], 1.0)),
        "names the request": dict(log_lines=_table_evidence(policy).log_lines[:1]),
        "counted no violation": dict(counted=0.0),
    }
    for expected, fields in broken.items():
        problems = table_fault.problems(policy, _table_evidence(policy, **fields))
        assert any(expected in p for p in problems), (expected, problems)
    # Quarantine fails the reader alone, repair no request.
    failed = {"choices": [{"token_ids": [1], "finish_reason": "error"}]}
    problems = table_fault.problems(policy, _table_evidence(policy, chaotic=Pass([failed, *answers[1:]], 1.0)))
    assert any("the failed requests are not exactly" in p for p in problems), problems


@pytest.fixture(scope="module")
def chaos_site(tmp_path_factory):
    return install_chaos_plugin(tmp_path_factory.mktemp("chaos-site"))


@pytest.mark.parametrize("policy", ["repair", "quarantine"])
def test_a_chaos_soak_is_repaired_or_quarantined_and_named(policy, tiny_llama, chaos_site):
    result = chaos(tiny_llama, VOCAB_SIZE, policy, REQUESTS, FAULTS, FLIP_KINDS, True, chaos_site)
    report([result])
    assert result.problems == []
    # What the checks above rest on: every fault armed was injected, each kind at least once.
    assert len(result.injected) == FAULTS and {f["kind"] for f in result.injected} == set(FLIP_KINDS)
    assert result.named == FAULTS and not result.differing
    if policy == "quarantine":
        assert result.failed and result.failed == result.expected_failed
    else:
        assert result.repaired_blocks >= FAULTS and not result.failed
    assert all(re.fullmatch(rf"chaos-{policy}-\d{{5}}", r) for r in result.failed)


# The P/D soak's checks (`torch_kvcanary.testing.soak.chaos_pd`), on made-up evidence: one handover fault
# on the prefill server (request 0's position 70, slot 198 there), named by the decode
# server's transfer line, and nothing else.
TRANSFER_LINE = (
    "(Worker pid=3) WARNING 12-05 11:09:35 [worker.py:225] kv-canary: request cmpl-chaos-{policy}-00000-0-abcdef12: 1 of the "
    "71 slots NIXL loaded differ from the prefill side's records at their first read (first at position 70); their blocks are load errors"
)


def _pd_problems(policy, answers, log, *, transfer_slots_failed=1, timings=None, window=()):
    clean = [[1, 2, 3, 4], [5, 6, 7, 8]]
    fault = dict(kind="handover", request=f"cmpl-chaos-{policy}-00000-0-abcdef12", slot=198, position=70, block=6)
    fault["readers"] = fault["holders"] = [fault["request"]]
    result = chaos_pd.PdChaosResult(policy, 2, injected=[fault], transfer_slots_failed=transfer_slots_failed)
    chaos_pd.check(result, None, clean, Pass(answers, 1.0), timings or {}, list(window), log, [])
    return result.problems


def test_the_pd_checks_pass_clean_evidence_and_fail_each_broken_one():
    answers = [{"choices": [{"token_ids": tokens, "finish_reason": "length"}]} for tokens in ([1, 2, 3, 4], [5, 6, 7, 8])]
    log = [TRANSFER_LINE.format(policy="repair")]
    assert _pd_problems("repair", answers, log) == []
    assert any("not named" in p for p in _pd_problems("repair", answers, [], transfer_slots_failed=0))
    assert any("transfer_slots_failed" in p for p in _pd_problems("repair", answers, log, transfer_slots_failed=3))
    wrong = [answers[0], {"choices": [{"token_ids": [5, 6, 7, 9], "finish_reason": "length"}]}]
    assert any("differ" in p for p in _pd_problems("repair", wrong, log))
    failed = [answers[0], {"error": 502, "body": "x"}]
    assert any("failed under repair" in p for p in _pd_problems("repair", failed, log))
    # ... unless it was in flight while the prefill server restarted.
    assert _pd_problems("repair", failed, log, timings={0: (0.0, 1.0), 1: (5.0, 9.0)}, window=(8.0, 20.0)) == []
    # Under quarantine the handover's request fails, and no other.
    quarantine_log = [TRANSFER_LINE.format(policy="quarantine")]
    first_failed = [{"choices": [{"token_ids": [1], "finish_reason": "error"}]}, answers[1]]
    assert _pd_problems("quarantine", first_failed, quarantine_log) == []
    assert any("readers of corrupted blocks" in p for p in _pd_problems("quarantine", answers, quarantine_log))


def test_the_pd_quarantine_check_allows_only_holders_of_the_corrupted_block_in_flight():
    """A decode-side fault in block 0 of request 0, read by it alone when found: a request
    whose prompt shares that block and was in flight then may fail with it (vLLM fails every
    holder of a reported block); one that shares no block, or ran after, may not."""
    prompts = [([5] * 40, 4), ([5] * 40, 4), ([6] * 40, 4), ([5] * 40, 4)]
    clean = [[1, 2, 3, 4]] * 4
    ok = {"choices": [{"token_ids": [1, 2, 3, 4], "finish_reason": "length"}]}
    error = {"choices": [{"token_ids": [1], "finish_reason": "error"}]}
    line = _violation(7, "chaos-quarantine-00000")
    when = chaos_pd.line_time(line)
    timings = {0: (when - 1, when), 1: (when - 1, when), 2: (when - 1, when), 3: (when + 30, when + 31)}
    fault = dict(kind="single", request="cmpl-chaos-quarantine-00000-0-abcdef12", slot=7, index=0, position=7, block=0)
    fault["readers"] = fault["holders"] = [fault["request"]]

    def problems(answers):
        result = chaos_pd.PdChaosResult("quarantine", 4, injected=[dict(fault)])
        chaos_pd.check(result, prompts, clean, Pass(answers, 1.0), timings, [], [line], [])
        return result.problems

    assert problems([error, ok, ok, ok]) == []
    assert problems([error, error, ok, ok]) == []  # shared block 0, in flight
    assert problems([ok, ok, ok, ok])  # the reader served
    assert problems([error, ok, error, ok])  # shares no block
    assert problems([error, ok, ok, error])  # came after


def _unverified_problems(answers, taken_as="mode_mismatch", **evidence):
    """The P/D soak's misconfiguration checks on made-up evidence: two requests, two NIXL
    transfers, each counted unverified under mode_mismatch, none compared, said once at
    WARNING, unless ``evidence`` says otherwise."""
    counts = dict(unverified={"mode_mismatch": 2}, transfers=2, said=[("WARNING", "mode_mismatch")]) | evidence
    result = UnverifiedResult("quarantine", 2, name="mixed-modes", **counts)
    check_unverified(result, answers, [[1, 2, 3, 4], [5, 6, 7, 8]], taken_as)
    return result.problems


def _unclaimed_problems(answers, **evidence):
    """The same for the drop-claim pass: two transfers counted unclaimed, their 64 slots
    compared and none failed, said once at WARNING."""
    counts = dict(unclaimed=2, transfers=2, compared_slots=64, said=[("WARNING", UNCLAIMED)]) | evidence
    result = UnverifiedResult("quarantine", 2, name="drop-claim", **counts)
    check_unverified(result, answers, [[1, 2, 3, 4], [5, 6, 7, 8]], UNCLAIMED)
    return result.problems


def test_the_pd_unverified_checks_pass_clean_evidence_and_fail_each_broken_one():
    answers = [{"choices": [{"token_ids": tokens, "finish_reason": "length"}]} for tokens in ([1, 2, 3, 4], [5, 6, 7, 8])]
    assert _unverified_problems(answers) == [] and _unclaimed_problems(answers) == []
    assert any("requests failed" in p for p in _unverified_problems([answers[0], {"error": 502, "body": "x"}]))
    wrong = [answers[0], {"choices": [{"token_ids": [5, 6, 7, 9], "finish_reason": "length"}]}]
    assert any("differ" in p for p in _unverified_problems(wrong))
    broken = [
        dict(unverified={"mode_mismatch": 1}),  # a transfer not counted
        dict(unverified={"mode_mismatch": 2, "format_version": 1}),  # one counted twice
        dict(unclaimed=1),  # one counted as compared too
        dict(unverified={}, transfers=0),  # no transfer made
        dict(prefill_unverified=1),
        dict(compared_slots=64),
        dict(said=[]),
        dict(said=[("WARNING", "mode_mismatch")] * 2),
        dict(said=[("INFO", "mode_mismatch")]),
    ]
    for evidence in broken:
        assert _unverified_problems(answers, **evidence), evidence
    assert _unverified_problems(answers, taken_as="format_version")  # counted under another reason
    unclaimed_broken = [
        dict(unclaimed=1),  # a transfer not counted
        dict(unverified={"mode_mismatch": 1}),  # one taken unverified too
        dict(compared_slots=0),  # nothing compared
        dict(failed_slots=32),  # an intact pair's slots failed
        dict(said=[("WARNING", "mode_mismatch")]),
    ]
    for evidence in unclaimed_broken:
        assert _unclaimed_problems(answers, **evidence), evidence
