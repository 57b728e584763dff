"""`InnerDelegate` (connector/delegate.py) against the installed vLLM's `KVConnectorBase_V1`:
every public member of the base is forwarded to the inner connector, but the connector's own,
which the facade defines; a forwarded call reaches the inner connector."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import connector  # noqa: E402

# The members of vLLM's connector base that belong to the connector itself, not to the inner
# connector: its role, whether the step's metadata is bound (the facade binds its own, holding
# the inner connector's), its counters' classes and its answer to sleep mode (vLLM 0.33 on).
OWN_MEMBERS = {"role", "has_connector_metadata", "build_kv_connector_stats", "build_prom_metrics", "supports_sleep_mode"}
SINCE_0_33 = {"supports_sleep_mode"}


def test_the_delegate_forwards_every_method_of_vllms_connector_base():
    """A method the installed vLLM's `KVConnectorBase_V1` has and `InnerDelegate` does not
    define would reach the base's default (most do nothing) instead of the inner connector:
    each public member is defined by the delegate, but the connector's own, which the facade
    defines."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    public = {name for name in dir(KVConnectorBase_V1) if not name.startswith("_")}
    assert OWN_MEMBERS - SINCE_0_33 <= public, "a member the connector keeps as its own is gone from vLLM's base"
    inherited = {name for name in public - OWN_MEMBERS if name not in vars(connector.InnerDelegate)}
    assert not inherited, f"InnerDelegate does not forward {sorted(inherited)} to the inner connector"
    assert issubclass(connector.KvCanaryConnector, connector.InnerDelegate)
    assert OWN_MEMBERS - {"role", "has_connector_metadata"} <= set(vars(connector.KvCanaryConnector))


def test_the_connector_forwards_the_gpu_block_pool_to_the_inner_connector():
    bound = []

    class Inner:
        def bind_gpu_block_pool(self, pool):
            bound.append(pool)

    wrapper = object.__new__(connector.KvCanaryConnector)
    wrapper.inner = Inner()
    pool = object()
    wrapper.bind_gpu_block_pool(pool)
    assert bound == [pool]
