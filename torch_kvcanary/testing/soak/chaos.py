"""A chaos soak of `vllm serve` with the canary under `repair` or `quarantine` (issue 51,
the single-server half).

    python tools/vllm_chaos.py --requests 1000 --policy repair|quarantine|both --faults K

For each policy: one `vllm serve` on 127.0.0.1 (`vllm_serve.Server`: float32, a small KV
cache, prefix caching, chunked prefill, `KvCanaryConnector` with the policy's
`kv_load_failure_policy`), with a fault injector of this tool's own (`tools/chaos_faults.py`,
a vLLM general plugin reached through /collective_rpc). A clean pass of the workload first
(canary on, no faults: the reference answers, greedy), then the same requests again while
K faults are armed at even intervals of completed requests (kinds `--kinds`, in turn), each
injected at the first engine step that has a target of its kind. Then it checks:

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

`--table-fault` then points one block-table entry of a request at another request's block,
while 32 requests of the workload run again, and checks: the server kept serving (/health,
and a request after the pass); under quarantine exactly the request whose entry was changed
failed, under repair none; every other answer equals the clean pass's (under repair all of
them); a violation line names that request; /metrics counts a violation that is not byte-only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_serve import (  # noqa: E402
    Server,
    anonymous_resident_bytes,
    collective_rpc,
    complete,
    install_vllm_plugin,
    mixed_prompts,
    path_with,
    preemption_burst,
)

MIB = 1 << 20
BLOCK_SIZE = 32  # --block-size in serve_options
MEMORY_BOUND = 48 * MIB
CONCURRENCY = 16
FLIP_KINDS = ("single", "shared", "preempted")
POLICIES = {"repair": "recompute", "quarantine": "fail"}


def serve_options(policy: str) -> tuple:
    """`vllm_serve.SERVE_OPTIONS` in float32 (repaired answers compare token for token), with
    a KV cache of 2 MiB (about 30 blocks of 32 tokens for the tiny Llama in float32, so blocks
    are evicted and reused and requests preempted), the connector and synchronous scheduling."""
    connector = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": POLICIES[policy]}
    return (
        "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory-bytes", str(2 << 20),
        "--max-num-seqs", "8", "--dtype", "float32", "--enable-prefix-caching", "--max-num-batched-tokens", "128",
        "--no-async-scheduling", "--kv-transfer-config", json.dumps(connector), "--enforce-eager",
    )  # fmt: skip


def workload(requests: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``requests`` (prompt, max_tokens) pairs: mixed lengths over eight shared prefixes
    (`vllm_serve.mixed_prompts`), with a preemption burst of long distinct prompts
    (`vllm_serve.preemption_burst`) of 8 requests every 50, so that preempted requests
    resume throughout the pass."""
    mixed = mixed_prompts(requests, vocab_size, seed)
    out = []
    for start in range(0, requests, 50):
        chunk = mixed[start : start + 50]
        burst = preemption_burst(min(8, len(chunk)), vocab_size, seed=seed + 1 + start)
        out += burst + chunk[len(burst) :]
    return out[:requests]


# A violation line (docs/vllm_internals.md, "The log").
VIOLATION = re.compile(r"kv_canary violation: .*?fail_reason=(\S+) slot_idx=(\d+) .*request_id=(\S+)$")
SUMMARY = re.compile(r"kv_canary summary: .*repeated_detections=(\d+)")
FAILING = re.compile(r"Failing (\d+) request\(s\) due to KV load failure .*Request IDs: \{(.*)\}")
ENGINE_ID = re.compile(r"^cmpl-(.+)-\d+-[0-9a-f]{8}$|^cmpl-(.+)-\d+$")


def user_id(engine_id: str) -> str:
    """The request id this tool gave (`request_id` in the body) of vLLM's engine request id
    (``cmpl-<id>-<prompt index>-<random suffix>``)."""
    match = ENGINE_ID.match(engine_id)
    return (match[1] or match[2]) if match else engine_id


@dataclass
class Pass:
    answers: list[dict]
    seconds: float
    health_failures: int = 0


def run_pass(server: Server, prompts, tag: str, on_done=None, timings: dict | None = None) -> Pass:
    """Sends ``prompts`` ``CONCURRENCY`` at a time, request ids ``tag-i``; ``on_done(count)``
    after each completion; /health polled every second meanwhile; each request's (sent,
    answered) times (epoch seconds) in ``timings`` by index, where given."""
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()
    health_failures = [0]

    def poll_health():
        while not stop.wait(1.0):
            if not server.alive():
                health_failures[0] += 1

    def one(item):
        index, (prompt, max_tokens) = item
        sent = time.time()
        try:
            answer = complete(server.url, server.model, prompt, max_tokens, request_id=f"{tag}-{index:05d}", return_token_ids=True)
        except OSError as error:  # the connection reset or refused: a server that stopped
            answer = {"error": type(error).__name__, "body": str(error)}
        with lock:
            done[0] += 1
            count = done[0]
            if timings is not None:
                timings[index] = (sent, time.time())
        if on_done is not None:
            on_done(count)
        return answer

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, enumerate(prompts)))
    seconds = time.monotonic() - started
    stop.set()
    poller.join()
    return Pass(answers, seconds, health_failures[0])


def tokens(answer: dict) -> list[int] | None:
    """The generated token ids of a completed answer, or None for a failed one (an HTTP error,
    or finish reason ``error``)."""
    if "error" in answer or "choices" not in answer:
        return None
    choice = answer["choices"][0]
    if choice.get("finish_reason") == "error":
        return None
    return list(choice.get("token_ids") or []) or [choice["text"]]


@dataclass
class SoakResult:
    """One policy's chaos pass, of a server or a pair: what was injected and named, what
    failed or differed, the restarts and memory growth, and every check that did not hold
    (``problems``). ``HEADER`` names the columns of `row`; ``FAULT_KEYS`` the fields of an
    injected fault that `report` prints."""

    HEADER: ClassVar[list[str]] = []
    FAULT_KEYS: ClassVar[tuple[str, ...]] = ()

    policy: str
    requests: int
    _: KW_ONLY
    injected: list = field(default_factory=list)
    not_injected: list = field(default_factory=list)
    named: int = 0
    repaired_blocks: float = 0
    failed: set = field(default_factory=set)
    differing: list = field(default_factory=list)
    restarts: int = 0
    seconds: float = 0.0
    growth: int = 0
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def row(self) -> list[str]:
        raise NotImplementedError


def table(results: list[SoakResult]) -> str:
    """The results as a Markdown table of their ``HEADER``."""
    header = results[0].HEADER
    rows = [header, ["---"] * len(header)] + [r.row() for r in results]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def report(results: list[SoakResult]) -> None:
    """Prints the results' table, then each policy's notes, injected faults and failed checks."""
    print(table(results))
    for result in results:
        for note in result.notes:
            print(f"[{result.policy}] {note}")
        for fault in result.injected:
            print(f"[{result.policy}] fault " + " ".join(f"{k}={fault.get(k)}" for k in result.FAULT_KEYS))
        for problem in result.problems:
            print(f"[{result.policy}] FAILED: {problem}")


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


def install_chaos_plugin(directory: Path) -> Path:
    """The injector (`tools/chaos_faults.py`) installed in ``directory`` as a vLLM general
    plugin, for a server's PYTHONPATH (`vllm_serve.path_with`)."""
    return install_vllm_plugin(directory, "kvcanary_chaos_faults", (Path(__file__).parent / "chaos_faults.py").read_text())


def _metric_family(text: str, name: str) -> dict[str, float]:
    """Each series of metric ``name`` in /metrics text: labels -> value."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", line)
        if match:
            found[match[1] or ""] = float(match[2])
    return found


def _total(text: str, name: str) -> float:
    return sum(_metric_family(text, name).values())


def chaos(
    model: Path, vocab_size: int, policy: str, requests: int, faults: int, kinds: tuple, table_fault: bool, site: Path
) -> ChaosResult:
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
        _kill_group(server)
    return result


def _kill_group(server: Server) -> None:
    process = getattr(server, "_process", None)
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _chaos_on(server: Server, result: ChaosResult, prompts, faults: int, kinds: tuple, table_fault: bool) -> None:
    policy, requests = result.policy, result.requests
    began = time.monotonic()
    with server:
        result.start_seconds = time.monotonic() - began
        print(f"[{policy}] serving on {server.url} after {result.start_seconds:.0f} s, log {server.log_path}", flush=True)
        pids = server.engine_pids()  # [engine core, worker]
        # The clean pass: the reference answers, and the warm-up of the memory measurement.
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
        if _total(clean_metrics, "vllm:kv_canary_violations_total"):
            result.problems.append("the clean pass counted violations in /metrics")
        print(f"[{policy}] clean pass: {requests} requests in {clean.seconds:.1f} s, {len(noisy)} kv-canary reports", flush=True)
        lines_before = len(server.log().splitlines())
        resident_before = [anonymous_resident_bytes([pid]) for pid in pids]

        # The chaos pass: fault i armed once 0.7 (i + 1) / (faults + 1) of the requests completed
        # (the last 30 % of the pass leave the last ones time to find a target).
        marks = [int(0.7 * (i + 1) * requests / (faults + 1)) for i in range(faults)]
        arming = threading.Lock()
        armed = [0]

        def on_done(count):
            with arming:
                while armed[0] < len(marks) and count >= marks[armed[0]]:
                    collective_rpc(server, "chaos_arm", kinds[armed[0] % len(kinds)])
                    armed[0] += 1

        chaotic = run_pass(server, prompts, f"chaos-{policy}", on_done)
        result.seconds = chaotic.seconds
        result.restarts = 0
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
        metrics = server.metrics()
        _check(result, server, prompts, clean_tokens, chaotic, log_lines, metrics, clean_metrics)
        if table_fault and alive:
            _table_fault(result, server, prompts, clean_tokens)


def check_answers(result: SoakResult, answers: list[dict], clean_tokens: list) -> None:
    """Every armed fault found a target; the chaos pass's failed requests (``result.failed``)
    and its completed answers that differ from the clean pass's (``result.differing``, a problem)."""
    if result.not_injected:
        result.problems.append(f"{len(result.not_injected)} armed faults found no target: {result.not_injected}")
    for index, (answer, reference) in enumerate(zip(answers, clean_tokens)):
        got = tokens(answer)
        rid = f"chaos-{result.policy}-{index:05d}"
        if got is None:
            result.failed.add(rid)
        elif got != reference:
            result.differing.append(rid)
    if result.differing:
        result.problems.append(f"{len(result.differing)} completed answers differ from the clean pass's: {result.differing[:10]}")


def _check(result, server, prompts, clean_tokens, chaotic, log_lines, metrics, clean_metrics):
    policy = result.policy
    check_answers(result, chaotic.answers, clean_tokens)
    failed = result.failed
    # Violation lines of the chaos pass.
    violations = []
    repeated = 0
    vllm_failed = set()
    reports = []  # the blocks of each step's violation lines (a poll's lines are consecutive)
    for line in log_lines:
        match = VIOLATION.search(line)
        if match:
            violations.append((match[1].split("+"), int(match[2]), [user_id(r) for r in match[3].split(",")]))
            if not reports or reports[-1] is None:
                reports.append(set())
            reports[-1].add(int(match[2]) // BLOCK_SIZE)
        elif ("Recovered from KV load failure" in line or "due to KV load failure" in line) and reports and reports[-1] is not None:
            reports.append(None)  # the scheduler's line of the step the blocks were reported in
        match = SUMMARY.search(line)
        if match:
            repeated += int(match[1])
        match = FAILING.search(line)
        if match:
            vllm_failed |= {user_id(r.strip().strip("'\"")) for r in match[2].split(",")}
    injected_slots = {}
    for fault in result.injected:
        fault["user_holders"] = sorted(user_id(r) for r in fault["holders"])
        fault["user_readers"] = sorted(user_id(r) for r in fault["readers"])
        injected_slots[fault["slot"]] = fault
    named = 0
    for fault in result.injected:
        lines = [v for v in violations if v[1] == fault["slot"]]
        requests_named = {r for v in lines for r in v[2]}
        if lines and set(fault["user_readers"]) <= requests_named:
            named += 1
            fault["named"] = True
        else:
            fault["named"] = False
            result.problems.append(f"fault not named as injected: {fault} (lines for its slot: {lines})")
    result.named = named
    # Every violation line belongs to an injected fault: it names only holders of corrupted
    # blocks (the fault's own line, or one the connector's invalidation of a holder's later
    # blocks brought: see docs/chaos.md).
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
    # Failures.
    if policy == "quarantine":
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
    elif failed:
        result.problems.append(f"{len(failed)} requests failed under {policy}: {sorted(failed)[:10]}")
    # Counters against the log.
    counted = {
        name: _total(metrics, f"vllm:kv_canary_{name}_total") - _total(clean_metrics, f"vllm:kv_canary_{name}_total")
        for name in ("violations", "blocks_repaired", "requests_failed", "slots_verified")
    }
    result.metrics = counted
    result.repaired_blocks = counted["blocks_repaired"]
    # The counter counts a detection per request that read the slot (the canary's ring rows),
    # where the log has one line per slot naming each of those requests: so the log's count is
    # reasons x requests named, summed over lines, plus the summary lines' repeated detections.
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
    if policy == "quarantine":
        if counted["requests_failed"] != len(failed):
            result.problems.append(
                f"vllm:kv_canary_requests_failed_total counted {counted['requests_failed']:.0f}, {len(failed)} requests failed"
            )
        if counted["blocks_repaired"]:
            result.problems.append(f"vllm:kv_canary_blocks_repaired_total counted {counted['blocks_repaired']:.0f} under quarantine")
    else:
        # Each step reports the blocks of its flagged slots once (a block reused and flagged
        # again later is reported again).
        logged_blocks = sum(len(blocks) for blocks in reports if blocks)
        if counted["blocks_repaired"] != logged_blocks:
            result.problems.append(
                f"vllm:kv_canary_blocks_repaired_total counted {counted['blocks_repaired']:.0f}, the log's violation lines name {logged_blocks} blocks (step by step)"
            )
        if counted["requests_failed"]:
            result.problems.append(f"vllm:kv_canary_requests_failed_total counted {counted['requests_failed']:.0f} under repair")
    result.notes.append(
        f"anonymous resident memory over the chaos pass: worker {result.growth / MIB:+.1f} MiB, engine core {result.core_growth / MIB:+.1f} MiB"
    )
    if result.growth >= MEMORY_BOUND:
        result.problems.append(
            f"the worker's anonymous resident memory grew {result.growth / MIB:.1f} MiB over the chaos pass (bound 48 MiB)"
        )
    # The workload did what it is meant to.
    hits = _total(metrics, "vllm:prefix_cache_hits_total")
    preemptions = _total(metrics, "vllm:num_preemptions_total")
    chunked = sum(1 for prompt, _ in prompts if len(prompt) > 128)
    result.notes.append(
        f"prefix cache hits {hits:.0f} tokens, preemptions {preemptions:.0f}, prompts prefilled in chunks (> 128 tokens) {chunked}"
    )
    if not (hits > 0 and preemptions > 0 and chunked > 0):
        result.problems.append(
            f"the workload did not hit the prefix cache, preempt and chunk: hits {hits}, preemptions {preemptions}, chunked {chunked}"
        )
    kinds = {}
    for fault in result.injected:
        kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
    result.notes.append(f"faults by kind: {kinds}; counters over the chaos pass: {counted}")


def _table_fault(result: ChaosResult, server: Server, prompts, clean_tokens: list) -> None:
    """One block-table entry pointed at another request's block while 32 requests run again,
    then a request after them; the checks (`table_fault_problems`) into ``result``."""
    tag, count = f"table-{result.policy}", 32
    lines_before = len(server.log().splitlines())
    mapped_before = _mapping_violations(server.metrics())
    collective_rpc(server, "chaos_arm", "table")
    chaotic = run_pass(server, prompts[:count], tag)
    time.sleep(2.0)  # the last steps' log lines and stats reach the log and /metrics
    log_lines = server.log().splitlines()[lines_before:]
    counted = _mapping_violations(server.metrics()) - mapped_before
    after = tokens(complete(server.url, server.model, prompts[0][0], 8, request_id=f"{tag}-after", return_token_ids=True))
    evidence = TableEvidence(tag, chaotic, clean_tokens[:count], log_lines, counted, server.alive(), after == clean_tokens[0][:8])
    result.problems += [f"table fault: {p}" for p in table_fault_problems(result.policy, evidence)]
    result.notes.append(f"table fault: {evidence.summary()}")


@dataclass
class TableEvidence:
    """What the table fault's pass left: its request ids' ``tag``, the pass, the clean pass's
    answers to its prompts, the log's lines since it began, the violations /metrics counted
    under a reason other than the bytes' own, whether the server was alive at the end and
    whether the request after the pass answered as in the clean pass."""

    tag: str
    chaotic: Pass
    clean: list
    log_lines: list[str]
    counted: float
    alive: bool
    after_answered: bool

    @property
    def fault(self) -> dict | None:
        injected = [line.split("injected ", 1)[1] for line in self.log_lines if "kvcanary-chaos: injected" in line]
        return json.loads(injected[0]) if injected else None

    @property
    def violations(self) -> list[tuple[str, int, str]]:
        found = [VIOLATION.search(line) for line in self.log_lines]
        return [(m[1], int(m[2]), m[3]) for m in found if m]

    def failed(self) -> set[str]:
        return {f"{self.tag}-{i:05d}" for i, answer in enumerate(self.chaotic.answers) if tokens(answer) is None}

    def summary(self) -> str:
        fault, violations = self.fault, self.violations
        keys = ("request", "index", "block", "points_at", "owners_of_points_at")
        return (
            f"{fault and {k: fault.get(k) for k in keys}}; {len(violations)} violation lines (first {violations[:1]}); "
            f"failed {sorted(self.failed())} of {len(self.chaotic.answers)}; {self.counted:.0f} violations not byte-only "
            f"in /metrics; /health failures {self.chaotic.health_failures}; the next request answered: {self.after_answered}"
        )


def table_fault_problems(policy: str, evidence: TableEvidence) -> list[str]:
    """The table fault's checks: the server kept serving (/health through the pass, alive at
    the end, the next request answered); under quarantine exactly the request whose entry was
    changed failed, under repair none; every other answer (under repair every answer) equals
    the clean pass's; a violation line names that request; /metrics counted a violation that
    is not byte-only."""
    fault = evidence.fault
    if fault is None:
        return ["the table fault found no target"]
    reader = user_id(fault["request"])
    answers, clean = evidence.chaotic.answers, evidence.clean
    # Under repair the reader is recomputed, so its answer is compared too.
    compared = [i for i in range(len(answers)) if policy == "repair" or f"{evidence.tag}-{i:05d}" != reader]
    differing = [i for i in compared if tokens(answers[i]) != clean[i]]
    expected_failed = {reader} if policy == "quarantine" else set()
    named = any(fault["request"] in requests.split(",") for _, _, requests in evidence.violations)
    checks = (
        ("the server stopped serving", evidence.chaotic.health_failures or not evidence.alive, evidence.chaotic.health_failures),
        ("the request after the pass did not answer as in the clean pass", not evidence.after_answered, None),
        (f"the failed requests are not exactly {sorted(expected_failed)}", evidence.failed() != expected_failed, sorted(evidence.failed())),
        ("answers failed or differing from the clean pass's", differing, differing),
        ("no violation line names the request whose entry was changed", not named, evidence.violations[:1]),
        ("/metrics counted no violation that is not byte-only", evidence.counted <= 0, evidence.counted),
    )
    return [f"{what}: {got}" for what, bad, got in checks if bad]


def _mapping_violations(metrics: str) -> float:
    """The violations /metrics counts under a reason other than the bytes' own."""
    family = _metric_family(metrics, "vllm:kv_canary_violations_total")
    return sum(value for labels, value in family.items() if 'reason="verify_real_kv_hash"' not in labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--policy", choices=("repair", "quarantine", "both"), default="both")
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--kinds", default=",".join(FLIP_KINDS), help="fault kinds armed in turn (single, shared, preempted)")
    parser.add_argument("--table-fault", action="store_true", help="last, point a block-table entry at another request's block (checked)")
    parser.add_argument("--model", type=Path, help="default: a tiny random Llama made on the spot")
    args = parser.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    from random_models import VOCAB_SIZE

    def run(model: Path, policy: str, site: Path) -> ChaosResult:
        return chaos(model, VOCAB_SIZE, policy, args.requests, args.faults, kinds, args.table_fault, site)

    return soak_policies("chaos", args.policy, run, args.model)


def soak_policies(name: str, policy: str, run, model: Path | None) -> int:
    """Runs ``run(model, policy, site)`` under ``policy`` (``both``: repair, then quarantine)
    in a scratch folder, with the injector installed there and, unless ``model`` is given,
    a tiny random Llama made there; reports the results and returns the exit status."""
    from random_models import make_llama

    policies = ("repair", "quarantine") if policy == "both" else (policy,)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"vllm-{name}-") as scratch:
        scratch = Path(scratch)
        model = model or make_llama(scratch / "tiny-llama")
        (scratch / "site").mkdir()
        site = install_chaos_plugin(scratch / "site")
        results = [run(model, policy, site) for policy in policies]
    report(results)
    print(f"{name}: {sum(not r.problems for r in results)} of {len(results)} policies passed in {time.monotonic() - started:.0f} s")
    return 0 if all(not r.problems for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
