"""What the vLLM plugin's tests share: the tiny random Llama most of them serve
(`torch_kvcanary.testing.random_models`), made once per session, and the pool of in-process
engines (`engine_driver.ENGINES`), emptied when the session ends."""

import sys

import pytest

from torch_kvcanary.testing.random_models import make_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", autouse=True)
def engine_pool():
    yield
    # engine_driver imports vLLM: only where a test module has imported it already.
    driver = sys.modules.get("engine_driver")
    if driver is not None:
        driver.ENGINES.close()
