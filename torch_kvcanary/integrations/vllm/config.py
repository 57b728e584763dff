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
MAX_REPAIRS_ENV = "KVCANARY_VLLM_MAX_REPAIRS"
# The policies that report violations to vLLM's scheduler through the KV connector, and
# the kv_load_failure_policy each needs there.
CONNECTOR_POLICIES = {"repair": "recompute", "quarantine": "fail"}
POLICIES = ("log", "raise", *CONNECTOR_POLICIES)
CONNECTOR = "KvCanaryConnector"
"""The KV connector's name in vLLM's ``kv_transfer_config``, and its class in `connector`."""
MODES = {"partial": HashMode.PARTIAL, "all": HashMode.ALL}
SUMMARY_SECONDS = 60.0
MAX_REPAIRS = 3


@dataclass(frozen=True)
class Settings:
    policy: str
    mode: HashMode
    summary_seconds: float = SUMMARY_SECONDS
    drill: float = 0.0  # the probability per step of a fault drill
    every: int = 1  # each context slot is verified at least once every `every` steps
    max_repairs: int = MAX_REPAIRS  # under repair, the recomputes of one block a request is given


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
    return Settings(policy, MODES[mode], _summary_seconds(), _drill(), _every(), _max_repairs())


def _number(name: str, default, parse, valid, must: str):
    """The value of variable ``name`` read by ``parse`` (``default`` where it is unset or
    empty); a value ``parse`` refuses, or one that is not ``valid``, is refused with what it
    ``must`` be."""
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        number = parse(value)
    except ValueError:
        number = None
    if number is None or not valid(number):
        raise ValueError(f"kv-canary: {name} must be {must}, got {value!r}")
    return number


def _every() -> int:
    return _number(
        EVERY_ENV, 1, lambda v: int(v) if v.isdigit() else None, lambda n: n >= 1, "an int >= 1 (1: every context slot at every step)"
    )


def _max_repairs() -> int:
    return _number(
        MAX_REPAIRS_ENV,
        MAX_REPAIRS,
        lambda v: int(v) if v.isdigit() else None,
        lambda n: n >= 1,
        "an int >= 1 (the recomputes of one block a request is given under repair)",
    )


def _summary_seconds() -> float:
    return _number(
        SUMMARY_ENV, SUMMARY_SECONDS, float, lambda s: math.isfinite(s) and s >= 0, "a number of seconds >= 0 (0: after every step)"
    )


def _drill() -> float:
    return _number(DRILL_ENV, 0.0, float, lambda p: 0 <= p <= 1, "a probability per step in [0, 1] (0 or unset: no drills)")


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
    them by the connector's kv_load_failure_policy; a drill is repaired the same way, and so
    is drilled only under them."""
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
    if drill and not reports:
        needs.append(
            f"{POLICY_ENV}={' or '.join(CONNECTOR_POLICIES)} for fault drills (under log a drilled bit stays in the KV and "
            f"feeds the answers, under raise it stops the engine), or {DRILL_ENV} unset"
        )
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
