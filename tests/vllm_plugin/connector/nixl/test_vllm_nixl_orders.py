"""The orders of the NIXL transport without NIXL or a server: the slots of a request's blocks."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm


def test_slots_of_a_request_follow_its_blocks():
    from torch_kvcanary.integrations.vllm.connector import nixl

    assert nixl.slots_of([5, 2], 6, 4).tolist() == [20, 21, 22, 23, 8, 9]
