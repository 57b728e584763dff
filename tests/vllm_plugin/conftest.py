"""What the vLLM plugin's tests share: the tiny random Llama most of them serve
(`torch_kvcanary.testing.random_models`), made once per session."""

import pytest

from torch_kvcanary.testing.random_models import make_llama


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "every_release: run on every vLLM release the plugin supports (make test-vllm-releases); the rest run on the newest CPU release",
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny-llama"))
