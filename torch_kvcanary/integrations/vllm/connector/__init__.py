"""The canary as a vLLM KV connector: `KvCanaryConnector` (`facade`), its counters
(`stats`), its verified disk transfers (`disk`), its verified NIXL transfers (`nixl`,
with the side channel of their records, `records_channel`) and its fault drills (`drill`).

vLLM imports this package when a ``kv_transfer_config`` names the connector (the plugin
registers ``KvCanaryConnector`` with vLLM's connector factory as this package's class, so
``torch_kvcanary.integrations.vllm.connector.KvCanaryConnector`` is its class path), never
the plugin's entry point: its modules import vLLM.
"""

from .facade import INNER, KvCanaryConnector, KvCanaryMetadata, check_inner, check_unwrapped
from .stats import COUNTS, REASONS, CanaryPromMetrics, CanaryStats
from .disk import DiskTransfer

__all__ = [
    "COUNTS", "INNER", "REASONS", "CanaryPromMetrics", "CanaryStats", "DiskTransfer", "KvCanaryConnector", "KvCanaryMetadata",
    "check_inner", "check_unwrapped",
]  # fmt: skip
