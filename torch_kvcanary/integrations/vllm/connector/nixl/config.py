"""KvCanaryConnector's settings for the NIXL transport (its ``kv_connector_extra_config``
keys), the key its records ride under in ``kv_transfer_params``, and its refusals."""

from __future__ import annotations

from ... import adapter
from ...config import CONNECTOR

CONNECTORS = ("NixlConnector",)
RECORDS_KEY = "kv_canary_records"
"""The key of ``kv_transfer_params`` holding P's records servers, ``{"address": "host:port", "tp_size": n}``:
rank ``r`` of P's ``n`` tensor-parallel ranks serves on ``port + r``."""
RECORDS_PORT = "records_port"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` naming the port of this
server's records server (of its tensor-parallel rank 0; rank ``r`` serves on ``port + r``)."""
PROGRESS_DELAY = "nixl_progress_delay_us"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` setting the delay of NIXL's progress thread."""


def prepare_worker(vllm_config) -> None:
    """Before NixlConnector's worker is built (and with it NIXL's agent): slows NIXL's
    progress thread where KvCanaryConnector's config asks to (`PROGRESS_DELAY`)."""
    delay = vllm_config.kv_transfer_config.kv_connector_extra_config.get(PROGRESS_DELAY)
    if delay is not None:
        adapter.nixl.delay_progress_thread(int(delay))


def check_nixl(vllm_config) -> None:
    """Refuses what the NIXL verification cannot watch: several pipeline-parallel stages
    (a stage holds some layers, and the snapshots are the whole model's per rank) or
    decode-context-parallel ranks (a rank holds some of a request's positions), and no
    records port."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    parallel = vllm_config.parallel_config
    stages, dcp = parallel.pipeline_parallel_size, getattr(parallel, "decode_context_parallel_size", 1)
    if stages != 1 or dcp != 1:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies NixlConnector's transfers with one pipeline stage and one decode-context-parallel "
            f"rank per side (this server has pipeline_parallel_size={stages}, decode_context_parallel_size={dcp}): serve "
            f"each side without them (tensor parallelism is verified), or NixlConnector without {CONNECTOR}"
        )
    if not isinstance(extra.get(RECORDS_PORT), int):
        raise ValueError(
            f"kv-canary: {CONNECTOR} wrapping NixlConnector serves the canary's records of the KV it hands over on ports "
            f'of its own: set "{RECORDS_PORT}": PORT in its kv_connector_extra_config (tensor-parallel rank r serves on '
            "PORT + r: ports free for each rank, a range per server)"
        )
