"""What KvCanaryConnector refuses at start about the connectors it is configured with: an
inner connector whose loads no transfer verifier checks (`check_inner`), and a connector that
loads KV configured in the canary's place (`check_unwrapped`)."""

from __future__ import annotations

import json

from vllm.config import KVTransferConfig

from ..config import CONNECTOR, POLICY_ENV
from .delegate import INNER
from .transports import TRANSPORTS

VERIFIED = tuple(TRANSPORTS)
"""The inner connectors whose loads the canary verifies."""


def check_inner(inner: KVTransferConfig) -> None:
    """Refuses an inner connector that would load KV the canary cannot verify: the slots it
    loads would hold no records of the canary's (or an earlier request's), and be reported
    at their first read. A producer (it saves, never loads) is delegated to whatever it is."""
    if inner.is_kv_consumer and inner.kv_connector not in VERIFIED:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies the KV an inner connector loads for {', '.join(VERIFIED)} only; "
            f'{inner.kv_connector} with "kv_role": "{inner.kv_role}" would load KV the canary has no records of: give it '
            f'"kv_role": "kv_producer", or unset {POLICY_ENV} to serve it without the canary'
        )


def check_unwrapped(config: KVTransferConfig) -> None:
    """Refuses a KV connector configured in the canary's place (not as its inner connector)
    that loads KV: it writes slots outside the model's forward, which then hold no records
    of the canary's (or an earlier request's), and would be reported at their first read. A
    producer (it saves, never loads) serves beside the canary as it is."""
    if not config.is_kv_consumer:
        return
    if config.kv_connector in VERIFIED:
        inner = {"kv_connector": config.kv_connector, "kv_role": config.kv_role}
        if config.kv_connector_extra_config:
            inner["kv_connector_extra_config"] = config.kv_connector_extra_config
        wrapped = {"kv_connector": CONNECTOR, "kv_role": config.kv_role, "kv_connector_extra_config": {INNER: inner}}
        change = f"serve it as {CONNECTOR}'s inner connector, which verifies what it loads (--kv-transfer-config '{json.dumps(wrapped)}')"
    else:
        change = f'give it "kv_role": "kv_producer" ({CONNECTOR} verifies the loads of {", ".join(VERIFIED)} only)'
    raise ValueError(
        f'kv-canary: vLLM\'s KV connector {config.kv_connector} with "kv_role": "{config.kv_role}" loads KV into the cache outside '
        f"the model's forward, into slots the canary holds no records of, which it would report as corrupt: {change}, "
        f"or unset {POLICY_ENV} to serve it without the canary"
    )
