"""The canary's KV connector and vLLM's NixlConnector without NIXL: NixlConnector in the
canary's place is refused, and told how to serve it as KvCanaryConnector's inner connector
(the P/D pair itself: test_vllm_pd_pair.py)."""

import json

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import config, connector  # noqa: E402


def test_nixl_in_the_canarys_place_is_told_to_be_wrapped():
    from vllm.config import KVTransferConfig

    with pytest.raises(ValueError) as raised:
        connector.check_unwrapped(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"))
    wrapped = {
        "kv_connector": config.CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {connector.INNER: {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
    }
    assert str(raised.value) == (
        'kv-canary: vLLM\'s KV connector NixlConnector with "kv_role": "kv_both" loads KV into the cache outside the '
        "model's forward, into slots the canary holds no records of, which it would report as corrupt: serve it as "
        f"KvCanaryConnector's inner connector, which verifies what it loads (--kv-transfer-config '{json.dumps(wrapped)}'), "
        "or unset KVCANARY_VLLM to serve it without the canary"
    )
