"""The vLLM plugin's names and switches: the environment variables that turn it on and
tune it (`settings`), its policies and the KV connector's name, what each policy needs of the
engine (`connector_needs`), and the error that stops a worker the plugin cannot serve
(`refusal`). It imports nothing of the integration, and the
rest of it imports this."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ...sources import HashMode

POLICY_ENV = "KVCANARY_VLLM"
MODE_ENV = "KVCANARY_VLLM_MODE"
SUMMARY_ENV = "KVCANARY_VLLM_SUMMARY_S"
DRILL_ENV = "KVCANARY_VLLM_DRILL"
EVERY_ENV = "KVCANARY_VLLM_EVERY"
# The policies that report violations to vLLM's scheduler through the KV connector, and
# the kv_load_failure_policy each needs there.
CONNECTOR_POLICIES = {"repair": "recompute", "quarantine": "fail"}
POLICIES = ("log", "raise", *CONNECTOR_POLICIES)
CONNECTOR = "KvCanaryConnector"
"""The KV connector's name in vLLM's ``kv_transfer_config``, and its class in `connector`."""
MODES = {"partial": HashMode.PARTIAL, "all": HashMode.ALL}
SUMMARY_SECONDS = 60.0


@dataclass(frozen=True)
class Settings:
    policy: str
    mode: HashMode
    summary_seconds: float = SUMMARY_SECONDS
    drill: float = 0.0  # the probability per step of a fault drill
    every: int = 1  # each context slot is verified at least once every `every` steps


def settings() -> Settings | None:
    """The plugin's settings from the environment; None when ``KVCANARY_VLLM`` is unset or empty."""
    policy = os.environ.get(POLICY_ENV, "")
    if not policy:
        return None
    if policy not in POLICIES:
        raise ValueError(f"kv-canary: {POLICY_ENV} must be one of {', '.join(POLICIES)} (or unset to turn the plugin off), got {policy!r}")
    mode = os.environ.get(MODE_ENV, "all") or "all"
    if mode not in MODES:
        raise ValueError(f"kv-canary: {MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return Settings(policy, MODES[mode], _summary_seconds(), _drill(), _every())


def _every() -> int:
    value = os.environ.get(EVERY_ENV, "")
    if not value:
        return 1
    if not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"kv-canary: {EVERY_ENV} must be an int >= 1 (1: every context slot at every step), got {value!r}")
    return int(value)


def _summary_seconds() -> float:
    value = os.environ.get(SUMMARY_ENV, "")
    if not value:
        return SUMMARY_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"kv-canary: {SUMMARY_ENV} must be a number of seconds >= 0 (0: after every step), got {value!r}")
    return seconds


def _drill() -> float:
    value = os.environ.get(DRILL_ENV, "")
    if not value:
        return 0.0
    try:
        probability = float(value)
    except ValueError:
        probability = math.nan
    if not 0 <= probability <= 1:
        raise ValueError(f"kv-canary: {DRILL_ENV} must be a probability per step in [0, 1] (0 or unset: no drills), got {value!r}")
    return probability


@dataclass(frozen=True)
class EngineFacts:
    """What the policies need to know of the engine a worker serves (its adapter reads them)."""

    canary_connector: bool  # vLLM's KV connector is `CONNECTOR`
    model_runner_v2: bool
    kv_load_failure_policy: str | None  # the KV connector's, None without one
    async_scheduling: bool
    kv_cache_group_kinds: tuple[str, ...]


def connector_needs(policy: str, drill: float, engine: EngineFacts) -> list[str]:
    """What ``policy``, with fault drills of probability ``drill``, needs that ``engine``
    lacks, each as the change to make; none where the engine can serve them. repair and
    quarantine report blocks to vLLM's scheduler through the KV connector, which maps them
    back to requests only with synchronous scheduling and one KV cache group, and acts on
    them by the connector's kv_load_failure_policy; a drill is repaired the same way."""
    reports = policy in CONNECTOR_POLICIES
    needs = []
    if (reports or drill) and not engine.canary_connector:
        failure_policy = CONNECTOR_POLICIES.get(policy, "recompute")
        needs.append(
            f"vLLM's KV connector to be {CONNECTOR} (--kv-transfer-config "
            f'\'{{"kv_connector": "{CONNECTOR}", "kv_role": "kv_both", "kv_load_failure_policy": "{failure_policy}"}}\')'
        )
    if engine.model_runner_v2 and (engine.canary_connector or reports or drill):
        needs.append("Model Runner V1 for the KV connector (VLLM_USE_V2_MODEL_RUNNER=0)")
    if reports:
        failure_policy = CONNECTOR_POLICIES[policy]
        if engine.canary_connector and engine.kv_load_failure_policy != failure_policy:
            needs.append(f'"kv_load_failure_policy": "{failure_policy}" in the kv_transfer_config, not "{engine.kv_load_failure_policy}"')
        if engine.async_scheduling:
            needs.append("synchronous scheduling (--no-async-scheduling, or async_scheduling=False)")
        kinds = engine.kv_cache_group_kinds
        if len(kinds) != 1:
            needs.append(f"a model with one KV cache group, this one has {len(kinds)} ({', '.join(kinds)})")
    return needs


def connector_refusal(policy: str, drill: float, needs: list[str]) -> ValueError:
    """The error that refuses ``policy`` (with ``drill``) on an engine lacking ``needs`` (`connector_needs`)."""
    wanted = f"{POLICY_ENV}={policy}" + (f" with {DRILL_ENV}={drill}" if drill else "")
    return ValueError(f"kv-canary: {wanted} needs {'; '.join(needs)}: change that, or unset {POLICY_ENV} to serve without the canary")


def refusal(reason: str) -> RuntimeError:
    return RuntimeError(f"kv-canary: {reason}, or unset {POLICY_ENV} to serve without the canary")
