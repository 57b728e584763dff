"""What the vLLM plugin's tests share: the tiny random Llama most of them serve
(tools/random_models.py), made once per session."""

import pytest
from random_models import make_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("tiny-llama"))
