"""The build of torch_kvcanary._C, all of it: the sources, the flags, the CUDA toolkit and
torch's BuildExtension. setup.py calls `extensions()` and `cmdclass()`; importing this
module changes nothing.

The CPU sources are always built. The CUDA sources are added when torch is a CUDA build and
a CUDA toolkit (nvcc and its headers) is found, unless KVCANARY_CPU_ONLY=1; otherwise the
library is CPU-only, which `python -m torch_kvcanary info` reports. CUDA code targets sm_80
and sm_90 plus compute_90 PTX unless TORCH_CUDA_ARCH_LIST says otherwise. The library uses
only Python's limited API (3.10 on), so one wheel serves every later Python (abi3).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import Extension

from .cuda_toolkit import find_cuda_home

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "csrc"
# The build takes every source of these folders (docs/design.md maps them): the operator
# schema, the argument checks, the CPU wrappers and one unit per instruction set; the CUDA
# launchers and kernels when CUDA is built.
CPU_SOURCE_GLOBS = ("ops.cpp", "plan/*.cpp", "cpu/*.cpp", "cpu/isa/*.cpp")
CUDA_SOURCE_GLOBS = ("cuda/*.cpp", "cuda/*.cu")


def _sources(globs: tuple[str, ...]) -> list[str]:
    return [str(path.relative_to(REPO)) for pattern in globs for path in sorted(CSRC.glob(pattern))]


LIMITED_API = "cp310"  # the wheel's abi3 tag; Py_LIMITED_API below says the same
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it. The
# OpenMP runtime is not linked here: torch's own one, loaded with libtorch_cpu,
# serves the calls, so a process never holds two.
CXX_FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"]
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
# KVCANARY_SANITIZE=1: a CPU-only build under AddressSanitizer and UndefinedBehaviorSanitizer
# (build_tools/sanitizer_check.sh), where any report aborts.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]


def sanitize() -> bool:
    return os.environ.get("KVCANARY_SANITIZE") == "1"


def extensions() -> list[Extension]:
    return [
        Extension(
            "torch_kvcanary._C",
            sources=_sources(CPU_SOURCE_GLOBS),
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
        )
    ]


def cmdclass() -> dict:
    """{"build_ext": BuildExtension}. torch.utils.cpp_extension reads CUDA_HOME once, when it
    is imported, so the toolkit found here is set in the environment first (the build's
    process only), unless CUDA_HOME names one already."""
    home = find_cuda_home()
    if home is not None and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = str(home)
    import torch
    from torch.utils import cpp_extension

    def with_cuda() -> bool:
        if os.environ.get("KVCANARY_CPU_ONLY") == "1" or sanitize():
            return False
        return torch.version.cuda is not None and home is not None

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension, filling in torch's include paths and libraries."""

        def build_extensions(self) -> None:
            cuda = with_cuda()
            if cuda:
                os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
            for ext in self.extensions:
                _configure(ext, cuda, cpp_extension)
            print(f"torch_kvcanary: building {'with CUDA' if cuda else 'CPU-only'}{' with sanitizers' if sanitize() else ''}")
            super().build_extensions()

    return {"build_ext": BuildExtension}


def _configure(ext: Extension, cuda: bool, cpp_extension) -> None:
    device = "cuda" if cuda else "cpu"
    ext.include_dirs += [str(CSRC)] + cpp_extension.include_paths(device)
    ext.library_dirs += cpp_extension.library_paths(device)
    ext.libraries += ["c10", "torch", "torch_cpu"]
    ext.language = "c++"
    ext.extra_compile_args = {"cxx": list(CXX_FLAGS), "nvcc": list(NVCC_FLAGS)}
    if sanitize():
        ext.extra_compile_args["cxx"] += SANITIZE_FLAGS
        ext.extra_link_args += SANITIZE_FLAGS[:1]
    if cuda:
        ext.sources += _sources(CUDA_SOURCE_GLOBS)
        ext.libraries += ["c10_cuda", "torch_cuda", "cudart"]
