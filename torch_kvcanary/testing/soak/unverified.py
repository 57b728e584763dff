"""Misconfigured P/D pairs instead of faults (`unverified_pd`; tools/vllm_chaos_pd.py
--unverified), for each policy: a clean pass through a pair folding alike (the reference
answers), then the same requests behind a router that drops the canary's key from every
``kv_transfer_params`` it hands the decode server (``drop-claim``), then on a pair whose
prefill server folds ``KVCANARY_VLLM_MODE=partial`` and decode server ``all``
(``mixed-modes``). Each of these passes checks (`check_unverified`): no request failed; every
answer equals the clean pass's; the decode server, its prefix cache emptied before the pass,
took each request the router handed it with P's blocks to read as the pass says
(`Misconfigured.taken_as`): ``drop-claim``'s compared all the same (counted in
``vllm:kv_canary_transfers_unclaimed_total``, its slots verified, none failed),
``mixed-modes``' unverified (counted in ``vllm:kv_canary_transfers_unverified_total`` under
``mode_mismatch``, none compared); the prefill server counted none; the decode server said so
once, at WARNING. The clean pass counted nothing unverified or unclaimed.
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from torch_kvcanary.testing.pd import claim_dropper, pd_pair
from torch_kvcanary.testing.serve import Server
from torch_kvcanary.testing.soak.chaos_pd import PairTarget
from torch_kvcanary.testing.soak.harness import SoakResult, check_answers, report, run_pass, tokens, workload

UNCLAIMED = "unclaimed"
"""How a decode server takes a transfer whose params carry no claim: compared all the same."""


@dataclass(frozen=True)
class Misconfigured:
    """A misconfiguration pass: P's and D's KVCANARY_VLLM_MODE, whether the router drops P's
    claim, and how the decode server must take each transfer: `UNCLAIMED`, or unverified
    under a reason of ``transfers_unverified``."""

    modes: tuple[str, str]
    drops_claim: bool
    taken_as: str


# The misconfiguration passes (--unverified), in order.
UNVERIFIED_PASSES = {
    "drop-claim": Misconfigured(("all", "all"), True, UNCLAIMED),
    "mixed-modes": Misconfigured(("partial", "all"), False, "mode_mismatch"),
}
UNVERIFIED = "vllm:kv_canary_transfers_unverified_total"
UNCLAIMED_TOTAL = "vllm:kv_canary_transfers_unclaimed_total"
# The decode server's lines, once per prefill engine and reason, for a load it takes unverified
# and for one whose params carry no claim.
TAKEN_UNVERIFIED = re.compile(r"^kv-canary: the KV this decode side reads from prefill engine (\S+) is taken unverified .*?\), (\w+): ")
TAKEN_UNCLAIMED = re.compile(
    r"^kv-canary: the KV this decode side reads from prefill engine (\S+) comes with kv_transfer_params that carry no "
)


@dataclass
class UnverifiedResult(SoakResult):
    """One misconfiguration pass over a pair: what it answered, and the decode server's counts
    over the pass."""

    HEADER: ClassVar[list[str]] = [
        "pass", "policy", "requests", "failed", "answers differing", "unverified (decode, by reason)", "unverified (prefill)",
        "unclaimed (decode)", "handed to D with P's blocks (router)", "slots compared (decode)", "slots failed (decode)",
        "said (WARNING lines)", "wall time (s)",
    ]  # fmt: skip

    name: str = ""
    unverified: dict = field(default_factory=dict)  # reason -> transfers counted unverified over the pass
    prefill_unverified: float = 0
    unclaimed: float = 0  # transfers the decode server counted unclaimed (compared all the same) over the pass
    transfers: float = 0  # the requests the router handed the decode server with P's blocks to read
    compared_slots: float = 0  # verified and failed transfer slots
    failed_slots: float = 0
    said: list = field(default_factory=list)  # (level, reason or UNCLAIMED) of each line saying how a load is taken

    def row(self) -> list[str]:
        counted = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(self.unverified.items())) or "0"
        return [
            self.name, self.policy, str(self.requests), str(len(self.failed)), str(len(self.differing)), counted,
            f"{self.prefill_unverified:.0f}", f"{self.unclaimed:.0f}", f"{self.transfers:.0f}", f"{self.compared_slots:.0f}",
            f"{self.failed_slots:.0f}", ", ".join(f"{reason} {level}" for level, reason in self.said), f"{self.seconds:.1f}",
        ]  # fmt: skip


def check_unverified(result: UnverifiedResult, answers: list[dict], clean_tokens: list, taken_as: str) -> None:
    """The checks of a misconfiguration pass whose every transfer the decode server must take
    as ``taken_as`` (`Misconfigured.taken_as`; `result`'s counts are the pass's)."""
    check_answers(result, answers, clean_tokens)
    if result.failed:
        result.problems.append(f"{len(result.failed)} requests failed: {sorted(result.failed)[:10]}")
    counted = {UNCLAIMED: result.unclaimed} if result.unclaimed else {}
    counted |= result.unverified
    if result.transfers <= 0 or counted.get(taken_as, 0) != result.transfers or sum(counted.values()) != result.transfers:
        result.problems.append(
            f"the decode server counted {counted} of the {result.transfers:.0f} transfers it was handed: "
            f"each should be counted once, as {taken_as}"
        )
    if result.prefill_unverified:
        result.problems.append(f"the prefill server counted {result.prefill_unverified:.0f} transfers unverified: it loads none")
    if taken_as == UNCLAIMED and (not result.compared_slots or result.failed_slots):
        result.problems.append(
            f"the decode server compared {result.compared_slots:.0f} slots and failed {result.failed_slots:.0f}: "
            "it compares every unclaimed load, and the pair's are intact"
        )
    if taken_as != UNCLAIMED and result.compared_slots:
        result.problems.append(f"the decode server compared {result.compared_slots:.0f} slots it cannot compare with P's records")
    if result.said != [("WARNING", taken_as)]:
        result.problems.append(f"the decode server said {result.said} where it should say {taken_as} once, at WARNING")


def _unverified_counts(prefill: Server, decode: Server) -> dict:
    by_reason = {}
    for match in re.finditer(rf'^{re.escape(UNVERIFIED)}{{[^}}]*reason="(\w+)"[^}}]*}} (\S+)$', decode.metrics(), re.M):
        by_reason[match[1]] = by_reason.get(match[1], 0.0) + float(match[2])
    failed = decode.metric("vllm:kv_canary_transfer_slots_failed_total")
    compared = decode.metric("vllm:kv_canary_transfer_slots_verified_total") + failed
    return dict(
        unverified=by_reason, prefill_unverified=prefill.metric(UNVERIFIED), unclaimed=decode.metric(UNCLAIMED_TOTAL),
        compared_slots=compared, failed_slots=failed,
    )  # fmt: skip


def _counted_over(result: UnverifiedResult, before: dict, after: dict) -> None:
    result.unverified = {reason: n - before["unverified"].get(reason, 0.0) for reason, n in after["unverified"].items()}
    result.unverified = {reason: n for reason, n in result.unverified.items() if n}
    for key in ("prefill_unverified", "unclaimed", "compared_slots", "failed_slots"):
        setattr(result, key, after[key] - before[key])


def _taken_as(message: str) -> str | None:
    """How a decode server's line says it takes a load (`UNCLAIMED`, or the reason it is
    unverified); None for another line."""
    if TAKEN_UNCLAIMED.match(message):
        return UNCLAIMED
    unverified = TAKEN_UNVERIFIED.match(message)
    return unverified[2] if unverified else None


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
    for name, misconfigured in UNVERIFIED_PASSES.items():
        dropping, handed = threading.Event(), []
        side_env = tuple({"KVCANARY_VLLM_MODE": mode} for mode in misconfigured.modes)
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
                counts = _unverified_counts(prefill, decode)
                if any(counts["unverified"].values()) or counts["unclaimed"]:
                    result.problems.append(f"the clean pass counted transfers unverified or unclaimed: {counts}")
            if misconfigured.drops_claim:
                dropping.set()
            reset_prefix_cache(decode)  # each request's prompt is read over NIXL, but for the prefixes the pass shares
            before, handed[:] = _unverified_counts(prefill, decode), []
            chaotic = run_pass(target, prompts, f"chaos-{policy}")
            time.sleep(2.0)
            _counted_over(result, before, _unverified_counts(prefill, decode))
            result.transfers = sum(handed)
            result.seconds = chaotic.seconds
            # Over the server's life: the clean pass said nothing.
            result.said = [(level, how) for _, _, level, message in decode.canary_lines() if (how := _taken_as(message))]
            check_unverified(result, chaotic.answers, clean_tokens, misconfigured.taken_as)
        results.append(result)
    return results


def soak_unverified(policy: str, requests: int, model: Path | None) -> int:
    """The misconfiguration passes under ``policy`` (``both``: repair, then quarantine); the exit status."""
    from torch_kvcanary.testing.random_models import VOCAB_SIZE, make_llama

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
