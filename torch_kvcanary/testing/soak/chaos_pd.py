"""A chaos soak of a P/D pair (`pd`: a prefill and a decode `vllm serve` through NIXL,
`KvCanaryConnector` around NixlConnector on both) under `repair` or `quarantine` (`chaos_pd`;
run by tools/vllm_chaos_pd.py; the misconfigured pairs are `unverified`'s).

For each policy: the pair on 127.0.0.1 with the soak's injector on both servers (`faults`). A clean pass of the workload through the proxy first (the
reference answers), then the same requests again while K faults are armed at even intervals
of completed requests, in turn: ``handover`` on the prefill server (a bit of a prompt's KV
flipped after the records that travel with its blocks were written: the decode server loads
KV that differs from them), and ``single`` and ``shared`` on the decode server (a bit of a
block it holds, read by one request or by several). With ``restart`` the prefill
server is killed (SIGKILL, its whole process group) once half the requests completed, and
started again on the same ports, after the last fault was armed (the proxy tries it again until it
answers). Then it checks (`check`, a function a check):

- every answer that completed equals the clean pass's, token for token;
- under quarantine the failed requests are exactly the requests that read a corrupted block
  (the decode server's holders of its corrupted blocks, each handover's request, and the
  prefill server's readers of a flipped block it kept in its prefix cache), and, with the
  restart, requests in flight while the prefill server was down; under repair only those;
- the decode server kept serving throughout (/health polled), the prefill server but for
  its restart;
- every injected fault is named: a decode-side fault by a violation line at its slot naming
  its readers, a handover by the decode server's line for its request (``N of the M slots
  NIXL loaded differ from the prefill side's records``) at its position;
- the decode server's ``vllm:kv_canary_transfer_slots_failed_total`` equals the slots its
  lines name;
- the decode server's worker's anonymous resident memory grew by less than 48 MiB over the
  chaos pass beyond what it grew over a second clean pass before it (NixlConnector's own
  growth, the canary off alike: about 21 MiB a 1,000 requests here);
- the clean pass reported nothing on either server.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from torch_kvcanary.testing.pd import pd_server
from torch_kvcanary.testing.pd_proxy import Proxy
from torch_kvcanary.testing.serve import Server, anonymous_resident_bytes, collective_rpc, path_with
from torch_kvcanary.testing.soak.harness import (
    BLOCK_SIZE,
    MEMORY_BOUND,
    MIB,
    VIOLATION,
    Pass,
    SoakResult,
    check_answers,
    run_pass,
    tokens,
    user_id,
    workload,
)

# The decode server's line for a load whose slots differ from the records that travelled with them.
TRANSFER = re.compile(r"kv-canary: request (\S+): (\d+) of the (\d+) slots NIXL loaded differ .*\(first at position (\d+)\)")
# How long the proxy tries a prefill server that does not answer again (its restart).
RESTART_S = 300.0
# Fault kinds in turn, and the server each is armed on.
KINDS = (("handover", "prefill"), ("single", "decode"), ("shared", "decode"))


@dataclass
class PairTarget:
    """The pair as `harness.run_pass` drives a server: the proxy's URL, alive while the
    decode server is."""

    url: str
    model: Path
    decode: Server

    def alive(self) -> bool:
        return self.decode.alive()


@dataclass
class PdChaosResult(SoakResult):
    """One policy's chaos pass over the pair."""

    HEADER: ClassVar[list[str]] = [
        "policy", "requests", "faults injected", "named", "repaired (blocks, decode side)", "failed (quarantine)",
        "failed while P restarted", "answers differing", "prefill restarts", "wall time (s)", "decode memory growth (MiB)",
    ]  # fmt: skip
    FAULT_KEYS: ClassVar[tuple[str, ...]] = ("kind", "step", "slot", "block", "position", "readers", "named")

    transfer_slots_failed: float = 0
    restart_casualties: set = field(default_factory=set)
    baseline_growth: int = 0

    def row(self) -> list[str]:
        failed = str(len(self.failed - self.restart_casualties)) if self.policy == "quarantine" else "-"
        return [
            self.policy, str(self.requests), str(len(self.injected)), str(self.named), f"{self.repaired_blocks:.0f}", failed,
            str(len(self.restart_casualties)), str(len(self.differing)), str(self.restarts), f"{self.seconds:.1f}",
            f"{self.growth / MIB:+.1f}",
        ]  # fmt: skip


def _pair_servers(model: Path, policy: str, env: dict) -> tuple[Server, Server]:
    """The pair's servers, each in a session of its own (so that `Server.kill_group` reaches all of its processes)."""
    servers = [pd_server(model, index, policy=policy, env=env) for index in (0, 1)]
    return tuple(dataclasses.replace(server, prefix=("setsid", *server.prefix)) for server in servers)


def chaos_pd(model: Path, vocab_size: int, policy: str, requests: int, faults: int, restart: bool, site: Path) -> PdChaosResult:
    """One policy's chaos pass over a pair of its own, the injector installed in ``site``:
    ``faults`` faults in turn (`KINDS`) over ``requests`` requests, the prefill server
    restarted mid-pass where ``restart``; the result, its failed checks in ``problems``."""
    env = dict(VLLM_SERVER_DEV_MODE="1", VLLM_USE_V2_MODEL_RUNNER="0", PYTHONPATH=path_with(site))
    prefill, decode = _pair_servers(model, policy, env)
    result = PdChaosResult(policy, requests)
    servers = [prefill, decode]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy()
        with Proxy(prefill.url, decode.url, retry_s=RESTART_S if restart else 0.0) as proxy:
            _chaos_on(PairTarget(proxy.url, model, decode), prefill, servers, result, workload(requests, vocab_size), faults, restart)
    finally:
        for server in servers:
            server.kill_group()
    return result


def _chaos_on(target: PairTarget, prefill: Server, servers: list, result: PdChaosResult, prompts, faults: int, restart: bool):
    decode = target.decode
    print(
        f"[{result.policy}] pair serving: prefill {prefill.url} (log {prefill.log_path}), decode {decode.url} (log {decode.log_path})",
        flush=True,
    )
    decode_worker = decode.engine_pids()[1:]
    clean_tokens = clean_passes(target, prefill, result, prompts)
    resident_before = anonymous_resident_bytes(decode_worker)
    lines_before = {id(server): len(server.log().splitlines()) for server in (prefill, decode)}
    failed_before = decode.metric("vllm:kv_canary_transfer_slots_failed_total")
    repaired_before = decode.metric("vllm:kv_canary_blocks_repaired_total")
    chaos = ChaosPass(result, prefill, decode, servers, prompts, faults, restart)
    chaotic = chaos.run(target)
    time.sleep(2.0)
    result.growth = anonymous_resident_bytes(decode_worker) - resident_before
    chaos.collect_reports()
    if chaotic.health_failures or not decode.alive():
        result.problems.append(f"the decode server stopped serving: /health failed {chaotic.health_failures} times")
    if not chaos.prefill.alive():
        result.problems.append("the prefill server is not serving at the end")
    decode_lines = decode.log().splitlines()[lines_before[id(decode)] :]
    prefill_lines = prefill.log().splitlines()[lines_before[id(prefill)] :] + [
        line for server in servers[2:] for line in server.log().splitlines()
    ]
    result.transfer_slots_failed = decode.metric("vllm:kv_canary_transfer_slots_failed_total") - failed_before
    result.repaired_blocks = decode.metric("vllm:kv_canary_blocks_repaired_total") - repaired_before
    check(result, prompts, clean_tokens, chaotic, chaos.timings, chaos.window, decode_lines, prefill_lines)


def clean_passes(target: PairTarget, prefill: Server, result: PdChaosResult, prompts) -> list:
    """The clean pass (the reference answers; nothing failed, no kv-canary line on either
    server), then a second one: NixlConnector's own growth of the decode worker over a clean
    pass (the canary off grows it alike: docs/chaos.md), the measure the chaos pass's growth is
    read against (``result.baseline_growth``). The clean pass's tokens."""
    policy, decode = result.policy, target.decode
    clean = run_pass(target, prompts, f"clean-{policy}")
    clean_tokens = [tokens(a) for a in clean.answers]
    if any(t is None for t in clean_tokens):
        result.problems.append(f"the clean pass had {sum(t is None for t in clean_tokens)} failed requests")
    for name, server in (("prefill", prefill), ("decode", decode)):
        noisy = [m for _, _, level, m in server.canary_lines() if level in ("WARNING", "ERROR") or m.startswith("kv_canary")]
        if noisy:
            result.problems.append(f"the clean pass reported {len(noisy)} kv-canary lines on the {name} server: {noisy[:3]}")
    print(f"[{policy}] clean pass: {len(prompts)} requests in {clean.seconds:.1f} s", flush=True)
    decode_worker = decode.engine_pids()[1:]
    resident_before = anonymous_resident_bytes(decode_worker)
    baseline = run_pass(target, prompts, f"baseline-{policy}")
    result.baseline_growth = anonymous_resident_bytes(decode_worker) - resident_before
    if [tokens(a) for a in baseline.answers] != clean_tokens:
        result.problems.append("a second clean pass answered otherwise than the first")
    return clean_tokens


class ChaosPass:
    """The chaos pass over the pair: fault i armed (kinds in turn, `KINDS`, on their side) once
    0.7 (i + 1) / (faults + 1) of the requests completed and, with ``restart``, the prefill
    server killed (its process group) and started again once 80 % completed, after the last
    fault was armed. ``timings`` are each request's (sent, answered) times, ``window``
    [killed, serving again] (epoch seconds), ``reports`` the prefill servers' injector reports."""

    def __init__(self, result: PdChaosResult, prefill: Server, decode: Server, servers: list, prompts, faults: int, restart: bool):
        self.result, self.prefill, self.decode, self.servers, self.prompts = result, prefill, decode, servers, prompts
        self.marks = [int(0.7 * (i + 1) * len(prompts) / (faults + 1)) for i in range(faults)]
        self.restart_at = int(0.8 * len(prompts)) if restart else None
        self.lock = threading.Lock()
        self.armed = 0
        self.reports: list = []
        self.window: list = []
        self.timings: dict = {}

    def run(self, target: PairTarget) -> Pass:
        chaotic = run_pass(target, self.prompts, f"chaos-{self.result.policy}", self.on_done, self.timings)
        self.result.seconds = chaotic.seconds
        for thread in [t for t in threading.enumerate() if t.name == "restart-prefill"]:
            thread.join()
        return chaotic

    def on_done(self, count: int) -> None:
        with self.lock:
            while self.armed < len(self.marks) and count >= self.marks[self.armed]:
                kind, side = KINDS[self.armed % len(KINDS)]
                server = self.prefill if side == "prefill" else self.decode
                if server.alive():
                    collective_rpc(server, "chaos_arm", kind)
                self.armed += 1
            if self.restart_at is not None and count >= self.restart_at and not self.window:
                self.window.append(None)  # taken: restart_prefill fills it
                threading.Thread(target=self.restart_prefill, name="restart-prefill", daemon=True).start()

    def restart_prefill(self) -> None:
        old = self.prefill
        self.reports.append(json.loads(collective_rpc(old, "chaos_report")[0]))
        self.window[0] = time.time()
        old.kill_group()
        new = dataclasses.replace(old, log_path=None)
        new.start()
        self.servers.append(new)
        new.wait_healthy()
        self.window.append(time.time())
        self.prefill = new
        self.result.restarts += 1
        print(f"[{self.result.policy}] prefill server restarted in {self.window[1] - self.window[0]:.0f} s, log {new.log_path}", flush=True)

    def collect_reports(self) -> None:
        """What the injectors of both sides injected and left armed, into the result."""
        self.reports.append(json.loads(collective_rpc(self.prefill, "chaos_report")[0]))
        decode_report = json.loads(collective_rpc(self.decode, "chaos_report")[0])
        self.result.injected = [f for r in self.reports for f in r["injected"]] + decode_report["injected"]
        self.result.not_injected = [k for r in self.reports for k in r["armed"]] + decode_report["armed"]


@dataclass
class PairLog:
    """What the pair's log lines since the chaos pass began say: the requests each server's
    violation lines name at a slot, when the decode server first named a slot (epoch seconds,
    to the second), and the decode server's failed transfers by request: (slots differing,
    first position)."""

    violations: dict = field(default_factory=dict)  # (server, slot) -> requests named
    detected: dict = field(default_factory=dict)  # slot -> when the decode server first named it
    transfers: dict = field(default_factory=dict)


def read_logs(decode_lines: list[str], prefill_lines: list[str]) -> PairLog:
    """The pair's evidence in its log lines (`PairLog`)."""
    log = PairLog()
    for side, lines in (("decode", decode_lines), ("prefill", prefill_lines)):
        for line in lines:
            match = VIOLATION.search(line)
            if match:
                log.violations.setdefault((side, int(match[2])), set()).update(user_id(r) for r in match[3].split(","))
                if side == "decode":
                    log.detected.setdefault(int(match[2]), line_time(line))
    for line in decode_lines:
        match = TRANSFER.search(line)
        if match:
            log.transfers.setdefault(user_id(match[1]), []).append((int(match[2]), int(match[4])))
    return log


def check(result: PdChaosResult, prompts, clean_tokens: list, chaotic: Pass, timings: dict, window: list, decode_lines, prefill_lines):
    """Every check of the pair's chaos pass (``chaotic``, each request's ``timings``, the prefill
    server's restart ``window``, each side's log lines since the pass began) into ``result``:
    the answers, the naming of each fault, the transfer counter, the failed requests, the memory."""
    check_answers(result, chaotic.answers, clean_tokens)
    if window:  # in flight while the prefill server was down or starting
        killed, back = window[0], window[1] if len(window) > 1 else float("inf")
        result.restart_casualties = {
            f"chaos-{result.policy}-{i:05d}" for i, (start, end) in timings.items() if start <= back and end >= killed
        } & result.failed
    log = read_logs(decode_lines, prefill_lines)
    expected_failed, may_fail = check_naming(result, log, prompts, timings)
    check_transfer_counter(result, log)
    check_failures(result, expected_failed, may_fail)
    check_memory(result)
    result.notes.append(
        f"faults by kind: {result.faults_by_kind()}; decode side: transfer slots failed {result.transfer_slots_failed:.0f}, blocks repaired "
        f"{result.repaired_blocks:.0f}; worker memory {result.growth / MIB:+.1f} MiB (a clean pass: "
        f"{result.baseline_growth / MIB:+.1f} MiB); failed while P restarted "
        f"{len(result.restart_casualties)}"
    )


def check_naming(result: PdChaosResult, log: PairLog, prompts, timings: dict) -> tuple[set, set]:
    """Every injected fault is named: a decode-side fault by a violation line at its slot naming
    its readers, a handover by the decode server's line for its request at its position
    (``named`` on each fault, their count in ``result.named``). The requests that must fail
    under quarantine (each fault's readers), and those that may (that held a corrupted block
    when it was found)."""
    named = 0
    expected_failed, may_fail = set(), set()
    for fault in result.injected:
        readers = sorted(user_id(r) for r in fault["readers"])
        if fault["kind"] == "handover":
            request = user_id(fault["request"])
            ok = any(position == fault["position"] for _, position in log.transfers.get(request, []))
            expected_failed.add(request)
            # The prefill server's own later readers of the flipped block (its prefix cache).
            expected_failed |= log.violations.get(("prefill", fault["slot"]), set())
        else:
            ok = set(readers) <= log.violations.get(("decode", fault["slot"]), set())
            expected_failed |= set(readers)
            may_fail |= {user_id(r) for r in fault["holders"]}
            if fault["slot"] in log.detected:
                may_fail |= sharers_in_flight(result.policy, prompts, fault, timings, log.detected[fault["slot"]])
        fault["named"] = ok
        named += ok
        if not ok:
            result.problems.append(f"fault not named as injected: {fault}")
    result.named = named
    return expected_failed, may_fail


def check_transfer_counter(result: PdChaosResult, log: PairLog) -> None:
    """The decode server's ``vllm:kv_canary_transfer_slots_failed_total`` over the pass equals
    the slots its lines name."""
    logged = sum(count for found in log.transfers.values() for count, _ in found)
    if result.transfer_slots_failed != logged:
        result.problems.append(
            f"vllm:kv_canary_transfer_slots_failed_total counted {result.transfer_slots_failed:.0f}, the decode log's lines {logged}"
        )


def check_failures(result: PdChaosResult, expected_failed: set, may_fail: set) -> None:
    """Besides the restart's casualties: under quarantine the failed requests are the readers
    of corrupted blocks, and at most those that held one when it was found; under repair none."""
    unexplained = result.failed - result.restart_casualties
    if result.policy == "quarantine":
        if not expected_failed <= unexplained <= expected_failed | may_fail:
            result.problems.append(
                f"quarantine failed {sorted(unexplained)} (besides the restart's {len(result.restart_casualties)}), the readers of "
                f"corrupted blocks are {sorted(expected_failed)}, and those that held one when it was found "
                f"{sorted(may_fail - expected_failed)}"
            )
    elif unexplained:
        result.problems.append(f"{len(unexplained)} requests failed under {result.policy}: {sorted(unexplained)[:10]}")


def check_memory(result: PdChaosResult) -> None:
    """The decode worker's anonymous resident memory grew by less than `MEMORY_BOUND` over the
    chaos pass beyond what it grew over a second clean pass."""
    if result.growth - result.baseline_growth >= MEMORY_BOUND:
        result.problems.append(
            f"the decode worker's anonymous resident memory grew {result.growth / MIB:.1f} MiB over the chaos pass, "
            f"{result.baseline_growth / MIB:.1f} MiB over a clean one: more than 48 MiB beyond it"
        )


def line_time(line: str) -> float:
    """The epoch seconds of a vLLM log line's local ``MM-DD HH:MM:SS``."""
    stamp = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) ", line)[1]
    return datetime.datetime.strptime(f"{datetime.date.today().year}-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp()


def sharers_in_flight(policy: str, prompts, fault: dict, timings: dict, when: float) -> set[str]:
    """The requests whose prompt holds the faulted block's tokens as the faulted request's
    does (the same prefix up to the block's end: the decode server's prefix cache gives them
    that block) and that were in flight when the decode server found the fault (``when``,
    to the second): vLLM fails every request holding a reported block."""
    index = int(user_id(fault["request"]).rsplit("-", 1)[1])
    length = (fault["index"] + 1) * BLOCK_SIZE
    prefix = prompts[index][0][:length]
    return {
        f"chaos-{policy}-{i:05d}"
        for i, (prompt, _) in enumerate(prompts)
        if len(prompt) >= length and prompt[:length] == prefix and i in timings and timings[i][0] <= when + 1 and timings[i][1] >= when - 1
    }
