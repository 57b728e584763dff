"""Misconfigured P/D pairs instead of faults (`unverified_pd`; tools/vllm_chaos_pd.py
--unverified), for each policy: a clean pass through a pair folding alike (the reference answers), then the same requests behind a router
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
