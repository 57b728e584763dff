"""What a check does with its findings: the package's policies.

A policy is ``"log"`` (each line a WARNING on the ``torch_kvcanary`` logger), ``"raise"``
(the check's exception, holding the lines), a callable (given the findings, which the
check returns as well) or None (nothing: the caller reads the findings it gets back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("torch_kvcanary")

NAMED_POLICIES = ("log", "raise")

Policy = str | Callable[[Any], object] | None


def check_policy(policy: Policy, *, name: str, choices: str) -> None:
    """Raise ValueError unless ``policy`` is a policy; ``name`` is the argument that gave it
    and ``choices`` says what it may be, for the message."""
    if policy is None or callable(policy) or policy in NAMED_POLICIES:
        return
    raise ValueError(f"kv-canary: {name} must be {choices}, got {policy!r}")


def apply_policy(
    policy: Policy,
    findings: object,
    *,
    lines: Callable[[], list[str]],
    error: Callable[[list[str]], Exception],
    log: logging.Logger = logger,
) -> None:
    """Apply ``policy`` to ``findings``: call it with them, raise ``error(lines())``, log
    ``lines()`` at WARNING on ``log`` (the ``torch_kvcanary`` logger unless an integration
    names its engine's), or do nothing. The lines are built only when logged or raised."""
    if policy is None:
        return
    if callable(policy):
        policy(findings)
        return
    text = lines()
    if policy == "raise":
        raise error(text)
    for line in text:
        log.warning(line)
