"""KvCanaryConnector's settings for the NIXL transport (its ``kv_connector_extra_config``
keys), the key of ``kv_transfer_params`` by which P claims that a request's blocks carry the
canary's records, and its refusals."""

from __future__ import annotations

from ... import adapter
from ...config import CONNECTOR

RECORDS_KEY = "kv_canary_records"
"""The key of ``kv_transfer_params`` by which P claims that the request's blocks carry the
canary's records (`region`), with what D must match to compare them (`claim.facts`)."""
PROGRESS_DELAY = "nixl_progress_delay_us"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` setting the delay of NIXL's progress thread."""
STRICT = "kv_canary_strict_transfers"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` that, true, makes D fail a
transfer it cannot verify (no claim of P's, or one it cannot compare with) as a load error;
false (the default): D takes such a transfer's KV unverified and counts it (`claim`)."""


def strict_transfers(vllm_config) -> bool:
    """The `STRICT` setting of KvCanaryConnector's config (false where unset)."""
    value = vllm_config.kv_transfer_config.kv_connector_extra_config.get(STRICT, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv-canary: {CONNECTOR}'s kv_connector_extra_config {STRICT!r} must be true (fail the transfers the decode side "
            f"cannot verify) or false (take them unverified, the default), got {value!r}"
        )
    return value


def progress_delay_us(vllm_config) -> int | None:
    """The `PROGRESS_DELAY` setting of KvCanaryConnector's config: an int >= 0, or its decimal
    digits as a string (None where unset or null)."""
    value = vllm_config.kv_transfer_config.kv_connector_extra_config.get(PROGRESS_DELAY)
    if value is None:
        return None
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"kv-canary: {CONNECTOR}'s kv_connector_extra_config {PROGRESS_DELAY!r} must be an int >= 0 (microseconds between "
            f"polls of NIXL's progress thread; unset: NIXL as it ships), got {value!r}"
        )
    return value


def prepare_worker(vllm_config) -> None:
    """Before NixlConnector's worker is built (and with it NIXL's agent): slows NIXL's
    progress thread where KvCanaryConnector's config asks to (`PROGRESS_DELAY`)."""
    delay = progress_delay_us(vllm_config)
    if delay is not None:
        adapter.nixl.delay_progress_thread(delay)


def check_nixl(vllm_config) -> None:
    """Refuses what the NIXL verification cannot watch: several pipeline-parallel stages
    (a stage holds some layers, and the records are the whole model's per rank) or
    decode-context-parallel ranks (a rank holds some of a request's positions); a `STRICT`
    setting that is not a bool, a `PROGRESS_DELAY` that is not an int >= 0."""
    strict_transfers(vllm_config)
    progress_delay_us(vllm_config)
    parallel = vllm_config.parallel_config
    stages, dcp = parallel.pipeline_parallel_size, getattr(parallel, "decode_context_parallel_size", 1)
    if stages != 1 or dcp != 1:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies NixlConnector's transfers with one pipeline stage and one decode-context-parallel "
            f"rank per side (this server has pipeline_parallel_size={stages}, decode_context_parallel_size={dcp}): serve "
            f"each side without them (tensor parallelism is verified), or NixlConnector without {CONNECTOR}"
        )
