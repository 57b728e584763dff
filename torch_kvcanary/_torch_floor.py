"""The oldest torch the package runs on. Its libraries use the LibTorch stable ABI as torch
2.10 defines it (build_tools/build_ext.py builds them for that floor; pyproject.toml requires
it), so one build loads in every torch from 2.10 on, and in no older one: there the libraries
would fail to load on a missing symbol, so the package refuses first, saying why."""

from __future__ import annotations

from torch.torch_version import TorchVersion

TORCH_FLOOR = (2, 10)


def check_torch_version(version: str) -> None:
    """Raises ImportError when torch ``version`` is older than `TORCH_FLOOR`."""
    if TorchVersion(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"kv-canary: torch_kvcanary needs torch {floor} or later, this is torch {version}; install torch>={floor}")
