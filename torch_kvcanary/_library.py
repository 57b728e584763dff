"""Loads the kvcanary ops' libraries: importing this module registers the ops."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ._torch_floor import check_torch_version


def has_cuda_library() -> bool:
    """Whether the package was built with its CUDA kernels (the `_C_cuda` library)."""
    return importlib.util.find_spec(f"{__package__}._C_cuda") is not None


def _load_libraries() -> None:
    """Loads the ops' library (`_C`: the schema and the CPU kernels), after refusing a torch
    older than the floor, and the CUDA kernels' (`_C_cuda`) when torch is a CUDA build and the
    package was built with them. Under a CPU-only torch the CUDA library is left alone: it
    needs torch's CUDA side."""
    check_torch_version(torch.__version__)
    importlib.import_module(f"{__package__}._C")
    if torch.version.cuda is None or not has_cuda_library():
        return
    importlib.import_module(f"{__package__}._C_cuda")


_load_libraries()
