"""The memory soak the plugin's server tests and `make soak-vllm` (tools/vllm_serve.py) run
through `serve.Server`: `soak` sends requests of mixed lengths that share prefixes in passes
(warm-up passes, then measured ones), and reports what the canary said and what a measured
pass added to the engine's memory; `soaks_in_turns` does so with the canary off, then on, so
that what vLLM itself touches on a given host cancels out of the comparison.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from torch_kvcanary.testing.serve import Server, anonymous_resident_bytes, mixed_prompts, preemption_burst


def soak_workload(requests: int, vocab_size: int, concurrency: int = 8) -> list[tuple[list[int], int]]:
    """The soak's requests: a preemption burst of ``concurrency`` requests first (the soak
    sends ``concurrency`` at a time, so they go together), then mixed requests sharing
    prefixes (`mixed_prompts`)."""
    return preemption_burst(concurrency, vocab_size) + mixed_prompts(requests - concurrency, vocab_size)


# What the canary may add to the engine's anonymous memory over a pass of the soak, beyond
# what the same pass adds with the canary off. Its tables (records, ring, the step's buffers)
# are allocated at start and first touched by the first warm-up pass, which also spreads the
# workload over the whole KV pool and grows the engine by 230 MiB; the allocators settle in
# the next pass (up to 6 MiB more, once). Later, equal passes add 0.3 MiB each, the canary
# off or on (a 2-vCPU AMD EPYC, 1,000 requests a pass). So the soak warms up over two
# passes, measures two more and takes the smaller growth: a leak grows the engine on every
# pass, a late settling on one. A leak of 2.5 KiB a request fails the check; a plugin that
# keeps every request's prompt (`test_vllm_serve`'s) adds 4.5 to 6 MiB a pass.
CANARY_GROWTH_BOUND = 5 << 19  # 2.5 MiB
WARM_UP_PASSES, MEASURED_PASSES = 2, 2


@dataclass
class SoakResult:
    """A soak of ``requests`` requests sent in equal passes: `WARM_UP_PASSES`, then
    `MEASURED_PASSES`; the engine's anonymous memory (its core and worker) at start and after
    each pass, and what the last pass generated."""

    requests: int
    errors: list
    generated_tokens: int
    seconds: float
    resident: list[int]
    violation_lines: list[str]
    canary_warnings: list[str]
    prefix_cache_hits: float
    preemptions: float

    @property
    def growths(self) -> list[int]:
        """What each measured pass added to the engine's anonymous memory."""
        measured = self.resident[WARM_UP_PASSES:]
        return [after - before for before, after in zip(measured, measured[1:])]

    @property
    def growth(self) -> int:
        """The smallest growth of a measured pass: a leak's, on every pass."""
        return min(self.growths)

    def summary(self) -> str:
        mib = 1 << 20
        growths = ", ".join(f"{growth / mib:+.1f}" for growth in self.growths)
        return (
            f"soak: {WARM_UP_PASSES + MEASURED_PASSES} passes of {self.requests} requests, {len(self.errors)} errors, "
            f"{self.generated_tokens} tokens generated in the last pass, in {self.seconds:.1f} s; engine anonymous RSS "
            f"{self.resident[0] / mib:.1f} MiB at start, {self.resident[WARM_UP_PASSES] / mib:.1f} MiB after warming up, "
            f"then {growths} MiB a measured pass; {len(self.violation_lines)} kv-canary violation lines, "
            f"{len(self.canary_warnings)} kv-canary warnings; {self.prefix_cache_hits:.0f} prefix cache hits (tokens), "
            f"{self.preemptions:.0f} preemptions"
        )


def _send(server: Server, prompts: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: server.complete(p[0], p[1]), prompts))


def soak(server: Server, prompts: list[tuple[list[int], int]], concurrency: int = 8) -> SoakResult:
    """Sends ``prompts`` through ``server``, ``concurrency`` at a time, in passes: warm-up
    passes that first touch what the workload touches (the KV pool, vLLM's and the canary's
    tables, the allocators' arenas), then measured ones (`CANARY_GROWTH_BOUND`)."""
    pids = server.engine_pids()
    resident = [anonymous_resident_bytes(pids)]
    answers = []
    for _ in range(WARM_UP_PASSES + MEASURED_PASSES):
        started = time.monotonic()
        answers.append(_send(server, prompts, concurrency))
        seconds = time.monotonic() - started
        resident.append(anonymous_resident_bytes(pids))
    errors = [a for pass_answers in answers for a in pass_answers if "error" in a]
    tokens = sum(a["usage"]["completion_tokens"] for a in answers[-1] if "usage" in a)
    canary = server.canary_lines()
    violations = [m for _, _, _, m in canary if m.startswith("kv_canary violation")]
    warnings = [m for _, _, level, m in canary if level in ("WARNING", "ERROR")]
    hits, preemptions = server.metric("vllm:prefix_cache_hits_total"), server.metric("vllm:num_preemptions_total")
    return SoakResult(len(prompts), errors, tokens, seconds, resident, violations, warnings, hits, preemptions)


def soak_server(model: Path, prompts: list, env: dict, concurrency: int = 8) -> SoakResult:
    """The soak on a server of its own with ``env`` over this environment (the canary's
    switches: none, the canary off), which must still serve at its end."""
    with Server(model, env) as server:
        result = soak(server, prompts, concurrency)
        if not server.alive():
            raise RuntimeError(f"vllm serve stopped serving during the soak:\n{server.log()[-4000:]}")
    return result


def soaks_in_turns(model: Path, prompts: list, env: dict, concurrency: int = 8) -> tuple[SoakResult, SoakResult]:
    """The soak with the canary off, then on with ``env`` (the canary's switches), a server
    each, one after the other: (off, on)."""
    off = soak_server(model, prompts, {}, concurrency)
    on = soak_server(model, prompts, {"KVCANARY_VLLM_SUMMARY_S": "0", **env}, concurrency)
    return off, on
