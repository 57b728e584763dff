"""A chaos soak of a P/D pair (`vllm_pd`: a prefill and a decode `vllm serve` through NIXL,
`KvCanaryConnector` around NixlConnector on both) under `repair` or `quarantine` (issue 51,
the P/D half).

    python tools/vllm_chaos_pd.py --requests 1000 --policy repair|quarantine|both --faults K [--restart-prefill]
    python tools/vllm_chaos_pd.py --requests 1000 --policy quarantine --unverified

For each policy: the pair on 127.0.0.1 with the injector of `tools/vllm_chaos.py` on both
servers (`tools/chaos_faults.py`). A clean pass of the workload through the proxy first (the
reference answers), then the same requests again while K faults are armed at even intervals
of completed requests, in turn: ``handover`` on the prefill server (a bit of a prompt's KV
flipped after the records that travel with its blocks were written: the decode server loads
KV that differs from them), and ``single`` and ``shared`` on the decode server (a bit of a
block it holds, read by one request or by several). With ``--restart-prefill`` the prefill
server is killed (SIGKILL, its whole process group) once half the requests completed, and
started again on the same ports, after the last fault was armed (the proxy tries it again until it
answers). Then it checks:

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

With ``--unverified``, misconfigured pairs instead of faults, for each policy: a clean pass
through a pair folding alike (the reference answers), then the same requests behind a router
that drops the canary's key from every ``kv_transfer_params`` it hands the decode server
(``drop-claim``), then on a pair whose prefill server folds ``KVCANARY_VLLM_MODE=partial``
and decode server ``all`` (``mixed-modes``). Each of these passes checks (`check_unverified`):
no request failed; every answer equals the clean pass's; the decode server, its prefix cache emptied
before the pass, counted each request the router handed it with P's blocks to read in
``vllm:kv_canary_transfers_unverified_total`` under the pass's reason (``no_claim``,
``mode_mismatch``) and compared none; the prefill server counted none; the decode server said
the reason once, at WARNING. The clean pass counted nothing unverified.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_proxy import Proxy  # noqa: E402
from vllm_chaos import (  # noqa: E402
    BLOCK_SIZE,
    MEMORY_BOUND,
    MIB,
    VIOLATION,
    SoakResult,
    check_answers,
    report,
    run_pass,
    soak_policies,
    tokens,
    user_id,
    workload,
)
from vllm_pd import claim_dropper, pd_pair, pd_server  # noqa: E402
from vllm_serve import Server, anonymous_resident_bytes, collective_rpc, path_with  # noqa: E402

# The decode server's line for a load whose slots differ from the records that travelled with them.
TRANSFER = re.compile(r"kv-canary: request (\S+): (\d+) of the (\d+) slots NIXL loaded differ .*\(first at position (\d+)\)")
# How long the proxy tries a prefill server that does not answer again (its restart).
RESTART_S = 300.0
# Fault kinds in turn, and the server each is armed on.
KINDS = (("handover", "prefill"), ("single", "decode"), ("shared", "decode"))


@dataclass
class PairTarget:
    """The pair as `vllm_chaos.run_pass` drives a server: the proxy's URL, alive while the
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
    """The pair's servers, each in a session of its own (so that a kill reaches all of its processes)."""
    servers = [pd_server(model, index, policy=policy, env=env) for index in (0, 1)]
    return tuple(dataclasses.replace(server, prefix=("setsid", *server.prefix)) for server in servers)


def _kill_group(server: Server) -> None:
    try:
        os.killpg(server._process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._process.wait()


def chaos_pd(model: Path, vocab_size: int, policy: str, requests: int, faults: int, restart: bool, site: Path) -> PdChaosResult:
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
            _kill_group(server)
    return result


def _chaos_on(target: PairTarget, prefill: Server, servers: list, result: PdChaosResult, prompts, faults: int, restart: bool):
    policy, decode = result.policy, target.decode
    print(
        f"[{policy}] pair serving: prefill {prefill.url} (log {prefill.log_path}), decode {decode.url} (log {decode.log_path})", flush=True
    )
    clean = run_pass(target, prompts, f"clean-{policy}")
    clean_tokens = [tokens(a) for a in clean.answers]
    if any(t is None for t in clean_tokens):
        result.problems.append(f"the clean pass had {sum(t is None for t in clean_tokens)} failed requests")
    for name, server in (("prefill", prefill), ("decode", decode)):
        noisy = [m for _, _, level, m in server.canary_lines() if level in ("WARNING", "ERROR") or m.startswith("kv_canary")]
        if noisy:
            result.problems.append(f"the clean pass reported {len(noisy)} kv-canary lines on the {name} server: {noisy[:3]}")
    print(f"[{policy}] clean pass: {len(prompts)} requests in {clean.seconds:.1f} s", flush=True)
    # NixlConnector's own growth of the decode worker over a clean pass (the canary off grows it
    # alike: docs/chaos.md), the measure the chaos pass's growth is read against.
    decode_pids = decode.engine_pids()
    resident_before = anonymous_resident_bytes(decode_pids[1:])
    baseline = run_pass(target, prompts, f"baseline-{policy}")
    resident_after_baseline = anonymous_resident_bytes(decode_pids[1:])
    result.baseline_growth = resident_after_baseline - resident_before
    if [tokens(a) for a in baseline.answers] != clean_tokens:
        result.problems.append("a second clean pass answered otherwise than the first")
    resident_before = resident_after_baseline
    lines_before = {id(server): len(server.log().splitlines()) for server in (prefill, decode)}
    failed_before = decode.metric("vllm:kv_canary_transfer_slots_failed_total")
    repaired_before = decode.metric("vllm:kv_canary_blocks_repaired_total")

    marks = [int(0.7 * (i + 1) * len(prompts) / (faults + 1)) for i in range(faults)]
    restart_at = int(0.8 * len(prompts)) if restart else None  # after the last fault is armed
    lock = threading.Lock()
    armed = [0]
    reports = []  # the prefill server's injector reports, one per prefill server that served
    window = []  # [killed, serving again] (epoch seconds)
    current = {"prefill": prefill}

    def restart_prefill():
        old = current["prefill"]
        reports.append(json.loads(collective_rpc(old, "chaos_report")[0]))
        window[0] = time.time()
        _kill_group(old)
        new = dataclasses.replace(old, log_path=None)
        new.start()
        servers.append(new)
        new.wait_healthy()
        window.append(time.time())
        current["prefill"] = new
        result.restarts += 1
        print(f"[{policy}] prefill server restarted in {window[1] - window[0]:.0f} s, log {new.log_path}", flush=True)

    def on_done(count):
        with lock:
            while armed[0] < len(marks) and count >= marks[armed[0]]:
                kind, side = KINDS[armed[0] % len(KINDS)]
                server = current["prefill"] if side == "prefill" else decode
                if server.alive():
                    collective_rpc(server, "chaos_arm", kind)
                armed[0] += 1
            if restart_at is not None and count >= restart_at and not window:
                window.append(None)  # taken: restart_prefill fills it
                threading.Thread(target=restart_prefill, name="restart-prefill", daemon=True).start()

    timings = {}
    chaotic = run_pass(target, prompts, f"chaos-{policy}", on_done, timings)
    result.seconds = chaotic.seconds
    if restart_at is not None:
        restarting = [t for t in threading.enumerate() if t.name == "restart-prefill"]
        for thread in restarting:
            thread.join()
    time.sleep(2.0)
    result.growth = anonymous_resident_bytes(decode_pids[1:]) - resident_before
    reports.append(json.loads(collective_rpc(current["prefill"], "chaos_report")[0]))
    decode_report = json.loads(collective_rpc(decode, "chaos_report")[0])
    result.injected = [f for r in reports for f in r["injected"]] + decode_report["injected"]
    result.not_injected = [k for r in reports for k in r["armed"]] + decode_report["armed"]
    if chaotic.health_failures or not decode.alive():
        result.problems.append(f"the decode server stopped serving: /health failed {chaotic.health_failures} times")
    if not current["prefill"].alive():
        result.problems.append("the prefill server is not serving at the end")
    decode_lines = decode.log().splitlines()[lines_before[id(decode)] :]
    prefill_lines = prefill.log().splitlines()[lines_before[id(prefill)] :] + [
        line for server in servers[2:] for line in server.log().splitlines()
    ]
    result.transfer_slots_failed = decode.metric("vllm:kv_canary_transfer_slots_failed_total") - failed_before
    result.repaired_blocks = decode.metric("vllm:kv_canary_blocks_repaired_total") - repaired_before
    _check(result, prompts, clean_tokens, chaotic, timings, window, decode_lines, prefill_lines)


def _check(result, prompts, clean_tokens, chaotic, timings, window, decode_lines, prefill_lines):
    policy = result.policy
    check_answers(result, chaotic.answers, clean_tokens)
    failed = result.failed
    if window:  # in flight while the prefill server was down or starting
        killed, back = window[0], window[1] if len(window) > 1 else float("inf")
        result.restart_casualties = {
            f"chaos-{policy}-{i:05d}" for i, (start, end) in timings.items() if start <= back and end >= killed
        } & failed
    violations = {}  # (server, slot) -> requests named
    detected = {}  # slot -> when the decode server first named it (epoch seconds, to the second)
    for side, lines in (("decode", decode_lines), ("prefill", prefill_lines)):
        for line in lines:
            match = VIOLATION.search(line)
            if match:
                violations.setdefault((side, int(match[2])), set()).update(user_id(r) for r in match[3].split(","))
                if side == "decode":
                    detected.setdefault(int(match[2]), _line_time(line))
    transfers = {}
    for line in decode_lines:
        match = TRANSFER.search(line)
        if match:
            transfers.setdefault(user_id(match[1]), []).append((int(match[2]), int(match[4])))
    named = 0
    expected_failed = set()  # the requests that must fail under quarantine: each fault's readers
    may_fail = set()  # and those that held a corrupted block when it was found
    for fault in result.injected:
        readers = sorted(user_id(r) for r in fault["readers"])
        if fault["kind"] == "handover":
            request = user_id(fault["request"])
            ok = any(position == fault["position"] for _, position in transfers.get(request, []))
            expected_failed.add(request)
            # The prefill server's own later readers of the flipped block (its prefix cache).
            expected_failed |= violations.get(("prefill", fault["slot"]), set())
        else:
            ok = set(readers) <= violations.get(("decode", fault["slot"]), set())
            expected_failed |= set(readers)
            may_fail |= {user_id(r) for r in fault["holders"]}
            if fault["slot"] in detected:
                may_fail |= _sharers_in_flight(result.policy, prompts, fault, timings, detected[fault["slot"]])
        fault["named"] = ok
        named += ok
        if not ok:
            result.problems.append(f"fault not named as injected: {fault}")
    result.named = named
    logged = sum(count for found in transfers.values() for count, _ in found)
    if result.transfer_slots_failed != logged:
        result.problems.append(
            f"vllm:kv_canary_transfer_slots_failed_total counted {result.transfer_slots_failed:.0f}, the decode log's lines {logged}"
        )
    unexplained = failed - result.restart_casualties
    if policy == "quarantine":
        if not expected_failed <= unexplained <= expected_failed | may_fail:
            result.problems.append(
                f"quarantine failed {sorted(unexplained)} (besides the restart's {len(result.restart_casualties)}), the readers of "
                f"corrupted blocks are {sorted(expected_failed)}, and those that held one when it was found "
                f"{sorted(may_fail - expected_failed)}"
            )
    elif unexplained:
        result.problems.append(f"{len(unexplained)} requests failed under {policy}: {sorted(unexplained)[:10]}")
    if result.growth - result.baseline_growth >= MEMORY_BOUND:
        result.problems.append(
            f"the decode worker's anonymous resident memory grew {result.growth / MIB:.1f} MiB over the chaos pass, "
            f"{result.baseline_growth / MIB:.1f} MiB over a clean one: more than 48 MiB beyond it"
        )
    kinds = {}
    for fault in result.injected:
        kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
    result.notes.append(
        f"faults by kind: {kinds}; decode side: transfer slots failed {result.transfer_slots_failed:.0f}, blocks repaired "
        f"{result.repaired_blocks:.0f}; worker memory {result.growth / MIB:+.1f} MiB (a clean pass: "
        f"{result.baseline_growth / MIB:+.1f} MiB); failed while P restarted "
        f"{len(result.restart_casualties)}"
    )


def _line_time(line: str) -> float:
    """The epoch seconds of a vLLM log line's local ``MM-DD HH:MM:SS``."""
    stamp = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) ", line)[1]
    return datetime.datetime.strptime(f"{datetime.date.today().year}-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp()


def _sharers_in_flight(policy: str, prompts, fault: dict, timings: dict, when: float) -> set[str]:
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


# The misconfiguration passes (--unverified), in order: P's and D's KVCANARY_VLLM_MODE, whether
# the router drops P's claim, and the reason the decode server must count each transfer under.
UNVERIFIED_PASSES = {"drop-claim": (("all", "all"), True, "no_claim"), "mixed-modes": (("partial", "all"), False, "mode_mismatch")}
UNVERIFIED = "vllm:kv_canary_transfers_unverified_total"
# The decode server's line, once per prefill engine and reason, for a load it takes unverified.
TAKEN_UNVERIFIED = re.compile(r"^kv-canary: the KV this decode side reads from prefill engine (\S+) is taken unverified .*?\), (\w+): ")


@dataclass
class UnverifiedResult(SoakResult):
    """One misconfiguration pass over a pair: what it answered, and the decode server's counts
    over the pass."""

    HEADER: ClassVar[list[str]] = [
        "pass", "policy", "requests", "failed", "answers differing", "unverified (decode, by reason)", "unverified (prefill)",
        "handed to D with P's blocks (router)", "slots compared (decode)", "said (WARNING lines)", "wall time (s)",
    ]  # fmt: skip

    name: str = ""
    unverified: dict = field(default_factory=dict)  # reason -> transfers counted unverified over the pass
    prefill_unverified: float = 0
    transfers: float = 0  # the requests the router handed the decode server with P's blocks to read
    compared_slots: float = 0  # verified and failed transfer slots
    said: list = field(default_factory=list)  # (level, reason) of each line saying a load is taken unverified

    def row(self) -> list[str]:
        counted = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(self.unverified.items())) or "0"
        return [
            self.name, self.policy, str(self.requests), str(len(self.failed)), str(len(self.differing)), counted,
            f"{self.prefill_unverified:.0f}", f"{self.transfers:.0f}", f"{self.compared_slots:.0f}",
            ", ".join(f"{reason} {level}" for level, reason in self.said), f"{self.seconds:.1f}",
        ]  # fmt: skip


def check_unverified(result: UnverifiedResult, answers: list[dict], clean_tokens: list, reason: str) -> None:
    """The checks of a misconfiguration pass whose every transfer the decode server must take
    unverified under ``reason`` (`result`'s counts are the pass's)."""
    check_answers(result, answers, clean_tokens)
    if result.failed:
        result.problems.append(f"{len(result.failed)} requests failed: {sorted(result.failed)[:10]}")
    counted = sum(result.unverified.values())
    if result.transfers <= 0 or result.unverified.get(reason, 0) != result.transfers or counted != result.transfers:
        result.problems.append(
            f"the decode server counted {result.unverified} transfers unverified of the {result.transfers:.0f} it was handed: "
            f"each should be counted once, under {reason}"
        )
    if result.prefill_unverified:
        result.problems.append(f"the prefill server counted {result.prefill_unverified:.0f} transfers unverified: it loads none")
    if result.compared_slots:
        result.problems.append(f"the decode server compared {result.compared_slots:.0f} slots it cannot compare with P's records")
    if result.said != [("WARNING", reason)]:
        result.problems.append(f"the decode server said {result.said} where it should say {reason} once, at WARNING")


def _unverified_counts(prefill: Server, decode: Server) -> dict:
    by_reason = {}
    for match in re.finditer(rf'^{re.escape(UNVERIFIED)}{{[^}}]*reason="(\w+)"[^}}]*}} (\S+)$', decode.metrics(), re.M):
        by_reason[match[1]] = by_reason.get(match[1], 0.0) + float(match[2])
    compared = sum(decode.metric(f"vllm:kv_canary_transfer_slots_{verdict}_total") for verdict in ("verified", "failed"))
    return dict(
        unverified=by_reason, prefill_unverified=prefill.metric(UNVERIFIED), compared_slots=compared,
    )  # fmt: skip


def _counted_over(result: UnverifiedResult, before: dict, after: dict) -> None:
    result.unverified = {reason: n - before["unverified"].get(reason, 0.0) for reason, n in after["unverified"].items()}
    result.unverified = {reason: n for reason, n in result.unverified.items() if n}
    for key in ("prefill_unverified", "compared_slots"):
        setattr(result, key, after[key] - before[key])


def reset_prefix_cache(server: Server) -> None:
    """Empties ``server``'s prefix cache (its /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1)."""
    urllib.request.urlopen(urllib.request.Request(server.url + "/reset_prefix_cache", method="POST"), timeout=60).close()


def _counting(route, handed: list):
    """``route``, noting in ``handed`` whether each request's params carry P's blocks to read."""

    def counted(body: dict, params: dict) -> dict:
        handed.append(any((params or {}).get("remote_block_ids") or ()))
        return route(body, params)

    return counted


def unverified_pd(model: Path, vocab_size: int, policy: str, requests: int) -> list[UnverifiedResult]:
    """The misconfiguration passes (`UNVERIFIED_PASSES`) under ``policy``, the clean pass first."""
    prompts = workload(requests, vocab_size)
    clean_tokens, results = None, []
    for name, (modes, drops, reason) in UNVERIFIED_PASSES.items():
        dropping, handed = threading.Event(), []
        side_env = tuple({"KVCANARY_VLLM_MODE": mode} for mode in modes)
        route = _counting(claim_dropper(lambda _body, event=dropping: event.is_set()), handed)
        with pd_pair(model, policy=policy, env={"VLLM_SERVER_DEV_MODE": "1"}, side_env=side_env, route=route) as (prefill, decode, proxy):
            target = PairTarget(proxy.url, model, decode)
            print(
                f"[{policy}] {name}: prefill {prefill.url} (log {prefill.log_path}), decode {decode.url} (log {decode.log_path})",
                flush=True,
            )
            result = UnverifiedResult(policy, requests, name=name)
            if clean_tokens is None:
                clean = run_pass(target, prompts, f"clean-{policy}")
                clean_tokens = [tokens(answer) for answer in clean.answers]
                time.sleep(2.0)  # the last steps' stats reach /metrics
                if any(t is None for t in clean_tokens):
                    result.problems.append(f"the clean pass had {sum(t is None for t in clean_tokens)} failed requests")
                if any(_unverified_counts(prefill, decode)["unverified"].values()):
                    result.problems.append(f"the clean pass counted transfers unverified: {_unverified_counts(prefill, decode)}")
            if drops:
                dropping.set()
            reset_prefix_cache(decode)  # each request's prompt is read over NIXL, but for the prefixes the pass shares
            before, handed[:] = _unverified_counts(prefill, decode), []
            chaotic = run_pass(target, prompts, f"chaos-{policy}")
            time.sleep(2.0)
            _counted_over(result, before, _unverified_counts(prefill, decode))
            result.transfers = sum(handed)
            result.seconds = chaotic.seconds
            # Over the server's life: the clean pass said nothing.
            said = ((level, TAKEN_UNVERIFIED.match(message)) for _, _, level, message in decode.canary_lines())
            result.said = [(level, match[2]) for level, match in said if match]
            check_unverified(result, chaotic.answers, clean_tokens, reason)
        results.append(result)
    return results


def soak_unverified(policy: str, requests: int, model: Path | None) -> int:
    """The misconfiguration passes under ``policy`` (``both``: repair, then quarantine); the exit status."""
    from random_models import VOCAB_SIZE, make_llama

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-chaos-pd-unverified-") as scratch:
        model = model or make_llama(Path(scratch) / "tiny-llama")
        policies = ("repair", "quarantine") if policy == "both" else (policy,)
        results = [result for one in policies for result in unverified_pd(model, VOCAB_SIZE, one, requests)]
    report(results)
    print(
        f"chaos-pd --unverified: {sum(not r.problems for r in results)} of {len(results)} passes passed in {time.monotonic() - started:.0f} s"
    )
    return 0 if all(not r.problems for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--policy", choices=("repair", "quarantine", "both"), default="both")
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--restart-prefill", action="store_true", help="kill the prefill server once mid-run and start it again")
    parser.add_argument("--model", type=Path, help="default: a tiny random Llama made on the spot")
    parser.add_argument(
        "--unverified", action="store_true", help="instead of faults: a router dropping the canary's key, then P and D in two fold modes"
    )
    args = parser.parse_args(argv)
    if args.unverified:
        return soak_unverified(args.policy, args.requests, args.model)
    from random_models import VOCAB_SIZE

    def run(model: Path, policy: str, site: Path) -> PdChaosResult:
        return chaos_pd(model, VOCAB_SIZE, policy, args.requests, args.faults, args.restart_prefill, site)

    return soak_policies("chaos-pd", args.policy, run, args.model)


if __name__ == "__main__":
    sys.exit(main())
