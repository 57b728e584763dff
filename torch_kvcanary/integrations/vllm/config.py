"""The vLLM plugin's names and switches: the environment variables that turn it on and
tune it (`settings`), its policies and the KV connector's name, and the error that stops a
worker the plugin cannot serve (`refusal`). It imports nothing of the integration, and the
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


def refusal(reason: str) -> RuntimeError:
    return RuntimeError(f"kv-canary: {reason}, or unset {POLICY_ENV} to serve without the canary")
