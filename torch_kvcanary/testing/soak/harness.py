"""What the chaos soaks share (`chaos` a server, `chaos_pd` a pair): the workload, a pass of
requests with /health polled (`run_pass`), the result of a policy's pass and its report, the
patterns of the log's lines, and the fault injector's installation (`install_chaos_plugin`).
"""

from __future__ import annotations

import abc
import argparse
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import ClassVar

from torch_kvcanary.testing.serve import Server, complete, install_vllm_plugin, mixed_prompts, preemption_burst

MIB = 1 << 20
BLOCK_SIZE = 32  # --block-size of both soaks' servers
MEMORY_BOUND = 48 * MIB
CONCURRENCY = 16


def workload(requests: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``requests`` (prompt, max_tokens) pairs: mixed lengths over eight shared prefixes
    (`serve.mixed_prompts`), with a preemption burst of long distinct prompts
    (`serve.preemption_burst`) of 8 requests every 50, so that preempted requests
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
    """The request id the soak gave (`request_id` in the body) of vLLM's engine request id
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
class SoakResult(abc.ABC):
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

    @abc.abstractmethod
    def row(self) -> list[str]:
        """The result's cells of `table`, one per column of its class's ``HEADER``."""

    def faults_by_kind(self) -> dict[str, int]:
        """How many faults of each kind were injected."""
        kinds: dict[str, int] = {}
        for fault in self.injected:
            kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
        return kinds


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


def install_chaos_plugin(directory: Path) -> Path:
    """The injector (`faults`, this folder's faults.py) installed in ``directory`` as a vLLM
    general plugin, for a server's PYTHONPATH (`serve.path_with`)."""
    return install_vllm_plugin(directory, "kvcanary_chaos_faults", (Path(__file__).parent / "faults.py").read_text())


def metric_family(text: str, name: str) -> dict[str, float]:
    """Each series of metric ``name`` in /metrics text: labels -> value."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", line)
        if match:
            found[match[1] or ""] = float(match[2])
    return found


def total(text: str, name: str) -> float:
    return sum(metric_family(text, name).values())


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


def soak_parser(description: str) -> argparse.ArgumentParser:
    """The options every soak's command line takes (the `soak_policies` arguments and the
    workload's size); each soak adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--policy", choices=("repair", "quarantine", "both"), default="both")
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--model", type=Path, help="default: a tiny random Llama made on the spot")
    return parser


def soak_policies(name: str, policy: str, run, model: Path | None) -> int:
    """Runs ``run(model, policy, site)`` under ``policy`` (``both``: repair, then quarantine)
    in a scratch folder, with the injector installed there and, unless ``model`` is given,
    a tiny random Llama made there; reports the results and returns the exit status."""
    from torch_kvcanary.testing.random_models import make_llama

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
