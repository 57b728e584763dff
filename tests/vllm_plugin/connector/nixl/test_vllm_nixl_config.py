"""The NIXL transport's refusals without NIXL or a server: what its verification cannot watch."""

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
