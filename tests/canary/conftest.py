"""What the canary's tests share: SGLang's own kv-canary write and verify
(tests/sglang_reference.py), the oracle its records and violations are compared with."""

import pytest
import sglang_reference


@pytest.fixture
def sglang():
    """SGLang's kv_canary modules; skips saying why where they are missing (fails in CI)."""
    return sglang_reference.load()
