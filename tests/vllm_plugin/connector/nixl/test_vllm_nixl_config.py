"""The NIXL transport's settings and refusals without NIXL or a server: what its verification
cannot watch, a progress delay that is not an int of microseconds."""

import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm


def test_what_the_nixl_verification_cannot_watch_is_refused():
    from types import SimpleNamespace

    from torch_kvcanary.integrations.vllm.connector import nixl

    def config(tp=1, pp=1, dcp=1):
        parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp)
        return SimpleNamespace(parallel_config=parallel, kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))

    nixl.check_nixl(config())
    nixl.check_nixl(config(tp=4))  # tensor parallelism is verified
    for parallel, said in ((dict(pp=2), "pipeline_parallel_size=2"), (dict(dcp=2), "decode_context_parallel_size=2")):
        with pytest.raises(
            ValueError, match=rf"^kv-canary: KvCanaryConnector verifies NixlConnector's transfers with one pipeline stage .*{said}"
        ):
            nixl.check_nixl(config(**parallel))


def _with_extra(extra: dict):
    from types import SimpleNamespace

    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


@pytest.mark.parametrize("delay", ["soon", -5, "-5", 1.5, True, [1000]])
def test_a_progress_delay_that_is_not_microseconds_is_refused_at_start(delay):
    # At start on either side (check_nixl), and before NIXL is touched on a worker (prepare_worker).
    from torch_kvcanary.integrations.vllm.connector import nixl

    config = _with_extra({"nixl_progress_delay_us": delay})
    refusal = (
        r"^kv-canary: KvCanaryConnector's kv_connector_extra_config 'nixl_progress_delay_us' must be an int >= 0 "
        r"\(microseconds between polls of NIXL's progress thread; unset: NIXL as it ships\), got " + re.escape(repr(delay))
    )
    for start in (nixl.check_nixl, nixl.prepare_worker):
        with pytest.raises(ValueError, match=refusal):
            start(config)


def test_a_progress_delay_is_an_int_of_microseconds():
    from torch_kvcanary.integrations.vllm.connector import nixl

    assert nixl.config.progress_delay_us(_with_extra({"nixl_progress_delay_us": 1000})) == 1000
    assert nixl.config.progress_delay_us(_with_extra({"nixl_progress_delay_us": "250"})) == 250
    assert nixl.config.progress_delay_us(_with_extra({"nixl_progress_delay_us": 0})) == 0
    assert nixl.config.progress_delay_us(_with_extra({})) is None
    assert nixl.config.progress_delay_us(_with_extra({"nixl_progress_delay_us": None})) is None  # JSON's null: unset
    nixl.check_nixl(_with_extra({"nixl_progress_delay_us": 1000}))
