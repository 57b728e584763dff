"""How the worker reads the connector policies' preconditions from its runner
(`WorkerCanary._connector`), on the tests' fake runner: `config.connector_needs` judges the
facts (a table in test_vllm_plugin.py); here each fact it needs is read from the runner view
and refused with the change to make, the connector is recognised by its class, and it is
optional without a connector policy. The refusals through a real engine are in
connector/facade/test_vllm_connector.py."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import connector, worker  # noqa: E402
from torch_kvcanary.testing import fake_runner  # noqa: E402


def _ours():
    """An instance of the connector's class, unbuilt: what the plugin recognises the connector by is its class."""
    return object.__new__(connector.KvCanaryConnector)


def _runner(kv_connector=None, failure_policy="recompute", async_scheduling=False, kinds=("FullAttentionSpec",)):
    """The fake runner showing the facts the preconditions read: its KV connector, the
    kv_transfer_config's failure policy (read by `adapter.RunnerView`), the scheduling and
    the kinds of its KV cache groups."""
    runner = fake_runner.FakeRunner(fake_runner.StepBuffers("v1", layers=1, requests=1, context=16, decode_steps=1))
    transfer = None if kv_connector is None else SimpleNamespace(kv_connector="KvCanaryConnector", kv_load_failure_policy=failure_policy)
    runner.buffers.vllm_config = SimpleNamespace(kv_transfer_config=transfer)
    runner.kv_connector = lambda: kv_connector
    runner.async_scheduling = async_scheduling
    runner.kv_cache_group_kinds = lambda: list(kinds)
    return runner


def _worker(policy: str, drill: float, runner) -> worker.WorkerCanary:
    state = object.__new__(worker.WorkerCanary)
    state.policy, state.drill, state.runner_view = policy, drill, runner
    return state


# Each fact read from the runner that no refusal through an engine shows (the connector and
# its failure policy are: test_a_policy_the_engine_cannot_serve_is_refused_at_start).
@pytest.mark.parametrize(
    "policy, connected, facts, needs",
    [
        ("repair", True, dict(async_scheduling=True), r"synchronous scheduling \(--no-async-scheduling, or async_scheduling=False\)"),
        (
            "repair",
            True,
            dict(kinds=("SlidingWindowSpec", "FullAttentionSpec")),
            r"a model with one KV cache group, this one has 2 \(SlidingWindowSpec, FullAttentionSpec\)",
        ),
        ("log", False, {}, "vLLM's KV connector to be KvCanaryConnector"),  # with a drill
    ],
    ids=["async scheduling", "two KV cache groups", "a drill without the connector"],
)
def test_each_precondition_of_the_connector_policies(policy, connected, facts, needs):
    runner = _runner(_ours() if connected else None, **facts)
    with pytest.raises(ValueError, match=f"^kv-canary: KVCANARY_VLLM={policy}.* needs {needs}"):
        _worker(policy, 0.01 if policy == "log" else 0.0, runner)._connector()


def test_without_a_connector_policy_the_connector_is_optional():
    state = _worker("log", 0.0, _runner(None, async_scheduling=True, kinds=("SlidingWindowSpec", "FullAttentionSpec")))
    assert state._connector() is None
    ours = _ours()
    state.runner_view = _runner(ours, failure_policy="fail", async_scheduling=True)
    assert state._connector() is ours  # its counters, whatever the policy
