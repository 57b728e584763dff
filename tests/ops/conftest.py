"""What the op tests share: the CPU kernels' instruction-set path this process takes."""

import pytest
import torch

import torch_kvcanary  # noqa: F401  (registers the ops)


@pytest.fixture
def cpu_path() -> str:
    """The CPU kernels' path this process takes: the best its CPU has, or the lesser one
    KVCANARY_CPU_ISA names (tests/ops/test_cpu_paths.py)."""
    return torch.ops.kvcanary.cpu_isa()
