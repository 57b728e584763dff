"""The canary as a vLLM KV connector, laid out by role as vLLM lays out its NIXL connector:

* `facade`: `KvCanaryConnector`, which builds the transfer verifier's half of its role,
  calls it at the matching connector calls, and applies the canary's policy (flagged
  blocks become load errors), and its drills (`drill`) and counters (`stats`);
* `delegate`: `InnerDelegate`, every connector call forwarded to the inner connector;
* `verifier`: the base classes of a transfer verifier's two halves (`SchedulerVerifier`,
  `WorkerVerifier`), each optional hook a documented no-op;
* `transports`: the registry of transports (`TRANSPORTS`): `disk` (``ExampleConnector``)
  and `nixl` (``NixlConnector``, whose records travel with the blocks, `nixl.region`);
* `port`: what the connector asks of its worker's canary, by caller: `CanaryPort` (the
  facade and drills), `RecordPort` (the verifiers); the plugin's worker implements both;
* `checks`: the connectors refused at start.

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
