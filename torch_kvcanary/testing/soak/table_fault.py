"""The chaos soak's table fault (`chaos`'s ``table_fault``): one block-table entry of a request
pointed at another request's block (every byte intact) while 32 requests of the workload run
again, then a request after them (`run`), and its checks (`problems`): the server kept serving
(/health, and the request after the pass); under quarantine exactly the request whose entry
was changed failed, under repair none; every other answer equals the clean pass's (under
repair all of them); a violation line names that request; /metrics counts a violation that
is not byte-only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from torch_kvcanary.testing.serve import Server, collective_rpc, complete
from torch_kvcanary.testing.soak.harness import VIOLATION, Pass, SoakResult, metric_family, run_pass, tokens, user_id


def run(result: SoakResult, server: Server, prompts, clean_tokens: list) -> None:
    """One block-table entry pointed at another request's block while 32 requests run again,
    then a request after them; the checks (`problems`) into ``result``."""
    tag, count = f"table-{result.policy}", 32
    lines_before = len(server.log().splitlines())
    mapped_before = mapping_violations(server.metrics())
    collective_rpc(server, "chaos_arm", "table")
    chaotic = run_pass(server, prompts[:count], tag)
    time.sleep(2.0)  # the last steps' log lines and stats reach the log and /metrics
    log_lines = server.log().splitlines()[lines_before:]
    counted = mapping_violations(server.metrics()) - mapped_before
    after = tokens(complete(server.url, server.model, prompts[0][0], 8, request_id=f"{tag}-after", return_token_ids=True))
    evidence = TableEvidence(tag, chaotic, clean_tokens[:count], log_lines, counted, server.alive(), after == clean_tokens[0][:8])
    result.problems += [f"table fault: {p}" for p in problems(result.policy, evidence)]
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


def problems(policy: str, evidence: TableEvidence) -> list[str]:
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


def mapping_violations(metrics: str) -> float:
    """The violations /metrics counts under a reason other than the bytes' own."""
    family = metric_family(metrics, "vllm:kv_canary_violations_total")
    return sum(value for labels, value in family.items() if 'reason="verify_real_kv_hash"' not in labels)
