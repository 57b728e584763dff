"""The canary as a vLLM KV connector (`KvCanaryConnector`), laid out by role as vLLM lays
out its NIXL connector: a facade over per-transport verifiers. The folder's guide, README.md,
names each module, a reading path and where to change what.

vLLM imports this package when a ``kv_transfer_config`` names the connector (the plugin
registers ``KvCanaryConnector`` with vLLM's connector factory as this package's class, so
``torch_kvcanary.integrations.vllm.connector.KvCanaryConnector`` is its class path), never
the plugin's entry point: its modules import vLLM.
"""

from .checks import VERIFIED, check_inner, check_unwrapped
from .delegate import INNER, InnerDelegate
from .disk import DiskVerifier
from .facade import KvCanaryConnector, KvCanaryMetadata
from .port import CanaryPort, RecordPort
from .stats import COUNTERS, REASONS, CanaryPromMetrics, CanaryStats
from .transports import TRANSPORTS, Transport
from .verifier import SchedulerVerifier, WorkerVerifier

__all__ = [
    "COUNTERS", "INNER", "REASONS", "TRANSPORTS", "VERIFIED", "CanaryPort", "CanaryPromMetrics", "CanaryStats", "DiskVerifier", "InnerDelegate",
    "KvCanaryConnector", "KvCanaryMetadata", "RecordPort", "SchedulerVerifier", "Transport", "WorkerVerifier", "check_inner", "check_unwrapped",
]  # fmt: skip
