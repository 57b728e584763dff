"""A chaos soak of `vllm serve` with the canary under `repair` or `quarantine` (`chaos`; run by
tools/vllm_chaos.py).

For each policy: one `vllm serve` on 127.0.0.1 (`serve.Server`: float32, a small KV
cache, prefix caching, chunked prefill, `KvCanaryConnector` with the policy's
`kv_load_failure_policy`), with a fault injector of this package's own (`faults`,
a vLLM general plugin reached through /collective_rpc). A clean pass of the workload first
(canary on, no faults: the reference answers, greedy), then the same requests again while
K faults are armed at even intervals of completed requests (kinds `--kinds`, in turn), each
injected at the first engine step that has a target of its kind. Then it checks (`check`, a function a check):

- every answer that completed equals the clean pass's, token for token;
- under quarantine the failed requests are exactly the live holders of the corrupted blocks
  (vLLM's rule: the running requests whose computed context holds the block), each with an
  error; under repair none fails;
- the server kept serving (/health polled through the chaos pass);
- every injected fault is named in a violation line (its slot, and every request of the
  step that read it), and every violation line belongs to an injected fault;
- the `vllm:kv_canary_*` counters in /metrics equal the counts in the log;
- the worker's anonymous resident memory grew by less than 48 MiB over the chaos pass (the
  clean pass before it warms the allocators up);
- the clean pass reported nothing;
- the workload hit the prefix cache, prefilled in chunks and preempted (from /metrics).

With ``table_fault`` (`table_fault`) it then points one block-table entry of a request at another request's block,
while 32 requests of the workload run again, and checks: the server kept serving (/health,
and a request after the pass); under quarantine exactly the request whose entry was changed
failed, under repair none; every other answer equals the clean pass's (under repair all of
them); a violation line names that request; /metrics counts a violation that is not byte-only.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from torch_kvcanary.testing.serve import Server, anonymous_resident_bytes, collective_rpc, path_with, server_options
from torch_kvcanary.testing.soak import table_fault as table
from torch_kvcanary.testing.soak.harness import (
    BLOCK_SIZE,
    FAILING,
    MEMORY_BOUND,
    MIB,
    SUMMARY,
    VIOLATION,
    Pass,
    SoakResult,
    check_answers,
    run_pass,
    tokens,
    total,
    user_id,
    workload,
)

FLIP_KINDS = ("single", "shared", "preempted")
POLICIES = {"repair": "recompute", "quarantine": "fail"}


def serve_options(policy: str) -> tuple:
    """`serve.SERVE_OPTIONS` in float32 (repaired answers compare token for token), with
    a KV cache of 2 MiB (about 30 blocks of 32 tokens for the tiny Llama in float32, so blocks
    are evicted and reused and requests preempted), the connector and synchronous scheduling."""
    connector = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": POLICIES[policy]}
    return (*server_options(dtype="float32"), "--no-async-scheduling", "--kv-transfer-config", json.dumps(connector), "--enforce-eager")


@dataclass
class ChaosResult(SoakResult):
    """One policy's chaos pass of a single server."""

    HEADER: ClassVar[list[str]] = [
        "policy", "requests", "faults injected", "named", "repaired (blocks)", "failed (quarantine)",
        "answers differing", "server restarts", "wall time (s)", "memory growth (MiB)",
    ]  # fmt: skip
    FAULT_KEYS: ClassVar[tuple[str, ...]] = ("kind", "step", "slot", "block", "position", "token", "user_readers", "user_holders", "named")

    faults_armed: int
    expected_failed: set = field(default_factory=set)
    clean_seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    violation_lines: int = 0
    core_growth: int = 0
    start_seconds: float = 0.0
    extra_lines: int = 0

    def row(self) -> list[str]:
        return [
            self.policy, str(self.requests), str(len(self.injected)), str(self.named),
            f"{self.repaired_blocks:.0f}", str(len(self.failed)) if self.policy == "quarantine" else "-",
            str(len(self.differing)), str(self.restarts), f"{self.seconds:.1f}", f"{self.growth / MIB:+.1f}",
        ]  # fmt: skip


def chaos(
    model: Path, vocab_size: int, policy: str, requests: int, faults: int, kinds: tuple, table_fault: bool, site: Path
) -> ChaosResult:
    """One policy's chaos pass on a server of its own, the injector installed in ``site``:
    ``faults`` faults of ``kinds`` in turn over ``requests`` requests, then the table fault
    where ``table_fault``; the result, its failed checks in ``problems``."""
    prompts = workload(requests, vocab_size)
    env = dict(
        KVCANARY_VLLM=policy,
        KVCANARY_VLLM_SUMMARY_S="0",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_USE_V2_MODEL_RUNNER="0",
        PYTHONPATH=path_with(site),
    )
    result = ChaosResult(policy, requests, faults)
    # `setsid` execs the server in a session (and process group) of its own, whose leader is
    # the server's own pid: killed as a group once it stopped, with whatever vLLM left behind.
    server = Server(model, env, options=serve_options(policy), prefix=("setsid",))
    try:
        _chaos_on(server, result, prompts, faults, kinds, table_fault)
    finally:
        server.kill_group()
    return result


def _chaos_on(server: Server, result: ChaosResult, prompts, faults: int, kinds: tuple, table_fault: bool) -> None:
    began = time.monotonic()
    with server:
        result.start_seconds = time.monotonic() - began
        print(f"[{result.policy}] serving on {server.url} after {result.start_seconds:.0f} s, log {server.log_path}", flush=True)
        pids = server.engine_pids()  # [engine core, worker]
        clean_tokens, clean_metrics = clean_pass(server, result, prompts)
        lines_before = len(server.log().splitlines())
        resident_before = [anonymous_resident_bytes([pid]) for pid in pids]
        chaotic = chaos_pass(server, result, prompts, faults, kinds)
        time.sleep(2.0)  # the last steps' log lines and stats reach the log and /metrics
        resident_after = [anonymous_resident_bytes([pid]) for pid in pids]
        # The worker's (the canary's process) growth is checked; the engine core's is reported.
        result.core_growth = resident_after[0] - resident_before[0]
        result.growth = resident_after[1] - resident_before[1]
        report = json.loads(collective_rpc(server, "chaos_report")[0])
        result.injected, result.not_injected = report["injected"], report["armed"]
        alive = server.alive()
        if chaotic.health_failures or not alive:
            result.problems.append(f"the server stopped serving: /health failed {chaotic.health_failures} times, alive at the end: {alive}")
        log_lines = server.log().splitlines()[lines_before:]
        check(result, prompts, clean_tokens, chaotic, log_lines, server.metrics(), clean_metrics)
        if table_fault and alive:
            table.run(result, server, prompts, clean_tokens)


def clean_pass(server: Server, result: ChaosResult, prompts) -> tuple[list, str]:
    """The clean pass: the reference answers, and the warm-up of the memory measurement; its
    checks (no failed request, no kv-canary line, no violation counted) into ``result``.
    (The answers' tokens, /metrics after it.)"""
    policy = result.policy
    clean = run_pass(server, prompts, f"clean-{policy}")
    result.clean_seconds = clean.seconds
    clean_tokens = [tokens(a) for a in clean.answers]
    clean_lines = server.canary_lines()
    clean_metrics = server.metrics()
    if any(t is None for t in clean_tokens):
        bad = [a for a in clean.answers if tokens(a) is None][:3]
        result.problems.append(f"the clean pass had {sum(t is None for t in clean_tokens)} failed requests: {bad}")
    noisy = [m for _, _, level, m in clean_lines if level in ("WARNING", "ERROR") or m.startswith("kv_canary")]
    if noisy:
        result.problems.append(f"the clean pass reported {len(noisy)} kv-canary lines: {noisy[:3]}")
    if total(clean_metrics, "vllm:kv_canary_violations_total"):
        result.problems.append("the clean pass counted violations in /metrics")
    print(f"[{policy}] clean pass: {len(prompts)} requests in {clean.seconds:.1f} s, {len(noisy)} kv-canary reports", flush=True)
    return clean_tokens, clean_metrics


def chaos_pass(server: Server, result: ChaosResult, prompts, faults: int, kinds: tuple) -> Pass:
    """The chaos pass: fault i (of ``kinds`` in turn) armed once 0.7 (i + 1) / (faults + 1) of
    the requests completed (the last 30 % of the pass leave the last ones time to find a target)."""
    marks = [int(0.7 * (i + 1) * len(prompts) / (faults + 1)) for i in range(faults)]
    arming = threading.Lock()
    armed = [0]

    def on_done(count):
        with arming:
            while armed[0] < len(marks) and count >= marks[armed[0]]:
                collective_rpc(server, "chaos_arm", kinds[armed[0] % len(kinds)])
                armed[0] += 1

    chaotic = run_pass(server, prompts, f"chaos-{result.policy}", on_done)
    result.seconds = chaotic.seconds
    result.restarts = 0
    return chaotic


@dataclass
class LogEvidence:
    """What the chaos pass's log lines say: each violation line's (reasons, slot, requests
    named), the summary lines' repeated detections, the requests vLLM's 'Failing' lines name,
    and the blocks of each step's violation lines (a poll's lines are consecutive; None
    between steps)."""

    violations: list = field(default_factory=list)
    repeated: int = 0
    vllm_failed: set = field(default_factory=set)
    reports: list = field(default_factory=list)


def read_log(log_lines: list[str]) -> LogEvidence:
    """The chaos pass's evidence in ``log_lines`` (`LogEvidence`)."""
    log = LogEvidence()
    for line in log_lines:
        match = VIOLATION.search(line)
        if match:
            log.violations.append((match[1].split("+"), int(match[2]), [user_id(r) for r in match[3].split(",")]))
            if not log.reports or log.reports[-1] is None:
                log.reports.append(set())
            log.reports[-1].add(int(match[2]) // BLOCK_SIZE)
        elif ("Recovered from KV load failure" in line or "due to KV load failure" in line) and log.reports and log.reports[-1] is not None:
            log.reports.append(None)  # the scheduler's line of the step the blocks were reported in
        match = SUMMARY.search(line)
        if match:
            log.repeated += int(match[1])
        match = FAILING.search(line)
        if match:
            log.vllm_failed |= {user_id(r.strip().strip("'\"")) for r in match[2].split(",")}
    return log


def check(result: ChaosResult, prompts, clean_tokens: list, chaotic: Pass, log_lines: list[str], metrics: str, clean_metrics: str) -> None:
    """Every check of a chaos pass (``chaotic``, the log's ``log_lines`` since it began, /metrics
    before and after it) into ``result``: the answers, the naming of each fault, no stray
    violation line, the failed requests, the counters, the memory and the workload."""
    check_answers(result, chaotic.answers, clean_tokens)
    log = read_log(log_lines)
    check_naming(result, log)
    check_strays(result, log)
    check_failures(result, log)
    counted = check_counters(result, log, metrics, clean_metrics)
    check_memory(result)
    check_workload(result, prompts, metrics)
    result.notes.append(f"faults by kind: {result.faults_by_kind()}; counters over the chaos pass: {counted}")


def check_naming(result: ChaosResult, log: LogEvidence) -> None:
    """Every injected fault is named in a violation line at its slot naming every request of
    the step that read it (``named`` on each fault, their count in ``result.named``)."""
    for fault in result.injected:
        fault["user_holders"] = sorted(user_id(r) for r in fault["holders"])
        fault["user_readers"] = sorted(user_id(r) for r in fault["readers"])
    named = 0
    for fault in result.injected:
        lines = [v for v in log.violations if v[1] == fault["slot"]]
        requests_named = {r for v in lines for r in v[2]}
        if lines and set(fault["user_readers"]) <= requests_named:
            named += 1
            fault["named"] = True
        else:
            fault["named"] = False
            result.problems.append(f"fault not named as injected: {fault} (lines for its slot: {lines})")
    result.named = named


def check_strays(result: ChaosResult, log: LogEvidence) -> None:
    """Every violation line belongs to an injected fault: it names only holders of corrupted
    blocks (the fault's own line, or one the connector's invalidation of a holder's later
    blocks brought: see docs/chaos.md). Lines at slots no fault touched are noted."""
    violations = log.violations
    all_holders = {r for f in result.injected for r in f["user_holders"]}
    strays = [v for v in violations if not set(v[2]) <= all_holders]
    if strays:
        result.problems.append(f"{len(strays)} violation lines belong to no injected fault: {strays[:5]}")
    own = {(f["slot"], r) for f in result.injected for r in f["user_readers"]}
    extra = [v for v in violations if not any((v[1], r) in own for r in v[2])]
    result.violation_lines, result.extra_lines = len(violations), len(extra)
    if extra:
        by_request = {}
        for _, slot, named in extra:
            for r in named:
                by_request.setdefault(r, set()).add(slot // BLOCK_SIZE)
        result.notes.append(
            f"{len(violations)} violation lines, {len(extra)} of them at slots no fault touched, naming only holders of "
            f"corrupted blocks (blocks by request: { {r: sorted(b) for r, b in by_request.items()} })"
        )


def check_failures(result: ChaosResult, log: LogEvidence) -> None:
    """Under quarantine the failed requests are exactly the live holders of the corrupted
    blocks (vLLM's 'Failing' lines naming the same); under repair none fails."""
    failed, vllm_failed = result.failed, log.vllm_failed
    if result.policy != "quarantine":
        if failed:
            result.problems.append(f"{len(failed)} requests failed under {result.policy}: {sorted(failed)[:10]}")
        return
    expected = {r for f in result.injected if f["kind"] != "table" for r in f["user_holders"]}
    result.expected_failed = expected
    if failed != expected:
        result.problems.append(
            f"quarantine failed {sorted(failed)}, the holders of the corrupted blocks are {sorted(expected)} "
            f"(failed not holders: {sorted(failed - expected)}; holders not failed: {sorted(expected - failed)}); "
            f"vLLM's 'Failing' lines named {sorted(vllm_failed)}"
        )
    if vllm_failed != failed:
        result.problems.append(f"vLLM's 'Failing' lines named {sorted(vllm_failed)}, the failed answers are {sorted(failed)}")


def check_counters(result: ChaosResult, log: LogEvidence, metrics: str, clean_metrics: str) -> dict:
    """The ``vllm:kv_canary_*`` counters over the chaos pass (/metrics after it less before it)
    equal the counts in the log; the counts (also in ``result.metrics``)."""
    counted = {
        name: total(metrics, f"vllm:kv_canary_{name}_total") - total(clean_metrics, f"vllm:kv_canary_{name}_total")
        for name in ("violations", "blocks_repaired", "requests_failed", "slots_verified")
    }
    result.metrics = counted
    result.repaired_blocks = counted["blocks_repaired"]
    # The counter counts a detection per request that read the slot (the canary's ring rows),
    # where the log has one line per slot naming each of those requests: so the log's count is
    # reasons x requests named, summed over lines, plus the summary lines' repeated detections.
    violations, repeated = log.violations, log.repeated
    logged_violations = sum(len(reasons) * len(named) for reasons, _, named in violations) + repeated
    if counted["violations"] != logged_violations:
        result.problems.append(
            f"vllm:kv_canary_violations_total counted {counted['violations']:.0f}, the log {logged_violations} "
            f"({len(violations)} violation lines, {repeated} repeated detections in summary lines)"
        )
    by_slot = sum(len(reasons) for reasons, _, _ in violations) + repeated
    if counted["violations"] != by_slot:
        result.notes.append(
            f"package: vllm:kv_canary_violations_total ({counted['violations']:.0f}) counts a slot once per request that read it "
            f"in the step, its help text and docs/vllm_connector.md say 'slots flagged': the log's violation lines count {by_slot}"
        )
    if result.policy == "quarantine":
        _check_quarantine_counters(result, counted)
    else:
        _check_repair_counters(result, counted, log)
    return counted


def _check_quarantine_counters(result: ChaosResult, counted: dict) -> None:
    if counted["requests_failed"] != len(result.failed):
        result.problems.append(
            f"vllm:kv_canary_requests_failed_total counted {counted['requests_failed']:.0f}, {len(result.failed)} requests failed"
        )
    if counted["blocks_repaired"]:
        result.problems.append(f"vllm:kv_canary_blocks_repaired_total counted {counted['blocks_repaired']:.0f} under quarantine")


def _check_repair_counters(result: ChaosResult, counted: dict, log: LogEvidence) -> None:
    # Each step reports the blocks of its flagged slots once (a block reused and flagged
    # again later is reported again).
    logged_blocks = sum(len(blocks) for blocks in log.reports if blocks)
    if counted["blocks_repaired"] != logged_blocks:
        result.problems.append(
            f"vllm:kv_canary_blocks_repaired_total counted {counted['blocks_repaired']:.0f}, "
            f"the log's violation lines name {logged_blocks} blocks (step by step)"
        )
    if counted["requests_failed"]:
        result.problems.append(f"vllm:kv_canary_requests_failed_total counted {counted['requests_failed']:.0f} under repair")


def check_memory(result: ChaosResult) -> None:
    """The worker's anonymous resident memory grew by less than `MEMORY_BOUND` over the chaos
    pass (the clean pass before it warmed the allocators up)."""
    result.notes.append(
        f"anonymous resident memory over the chaos pass: worker {result.growth / MIB:+.1f} MiB, engine core {result.core_growth / MIB:+.1f} MiB"
    )
    if result.growth >= MEMORY_BOUND:
        result.problems.append(
            f"the worker's anonymous resident memory grew {result.growth / MIB:.1f} MiB over the chaos pass (bound 48 MiB)"
        )


def check_workload(result: ChaosResult, prompts, metrics: str) -> None:
    """The workload did what it is meant to: it hit the prefix cache, preempted, and had
    prompts prefilled in chunks."""
    hits = total(metrics, "vllm:prefix_cache_hits_total")
    preemptions = total(metrics, "vllm:num_preemptions_total")
    chunked = sum(1 for prompt, _ in prompts if len(prompt) > 128)
    result.notes.append(
        f"prefix cache hits {hits:.0f} tokens, preemptions {preemptions:.0f}, prompts prefilled in chunks (> 128 tokens) {chunked}"
    )
    if not (hits > 0 and preemptions > 0 and chunked > 0):
        result.problems.append(
            f"the workload did not hit the prefix cache, preempt and chunk: hits {hits}, preemptions {preemptions}, chunked {chunked}"
        )
