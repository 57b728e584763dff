"""The build of torch_kvcanary's two libraries, all of it: the sources, the flags, the CUDA
toolkit and torch's BuildExtension. setup.py calls `extensions()` and `cmdclass()`; importing
this module changes nothing.

Both libraries use only the LibTorch stable ABI (torch/csrc/stable, torch/headeronly, the C
shim), built for the floor TORCH_FLOOR: one build serves every torch from that version on,
whatever torch it was compiled against. They also use only Python's limited API (3.10 on),
so one wheel serves every later Python (abi3).

- torch_kvcanary._C: the operator schema, the argument checks and the CPU kernels. Always
  built.
- torch_kvcanary._C_cuda: the CUDA kernels, added when torch is a CUDA build and a CUDA
  toolkit (nvcc and its headers) is found, unless KVCANARY_CPU_ONLY=1; otherwise the wheel is
  CPU-only, which `python -m torch_kvcanary info` reports. The package loads it only under a
  CUDA build of torch. It links the CUDA runtime statically, so it needs no particular
  libcudart of torch's, and looks the current-stream function up at run time, so it links
  nothing of libtorch_cuda. CUDA code targets sm_80 and sm_90 plus compute_90 PTX unless
  TORCH_CUDA_ARCH_LIST says otherwise.
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
# launchers and kernels, with the argument checks, in the CUDA library.
CPU_SOURCE_GLOBS = ("ops.cpp", "plan/*.cpp", "cpu/*.cpp", "cpu/isa/*.cpp")
CUDA_SOURCE_GLOBS = ("plan/*.cpp", "cuda/*.cpp", "cuda/*.cu")


def _sources(globs: tuple[str, ...]) -> list[str]:
    return [str(path.relative_to(REPO)) for pattern in globs for path in sorted(CSRC.glob(pattern))]


LIMITED_API = "cp310"  # the wheel's abi3 tag; Py_LIMITED_API below says the same
# The oldest torch the libraries load in (pyproject.toml's torch requirement and the
# package's import check say the same): TORCH_TARGET_VERSION hides every stable API that
# torch lacks, [major 1 byte][minor 1 byte][patch 1 byte][ABI tag 5 bytes].
TORCH_FLOOR = (2, 10)
TORCH_TARGET_VERSION = f"0x{TORCH_FLOOR[0]:02x}{TORCH_FLOOR[1]:02x}000000000000"
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# C++20 named here: torch's BuildExtension adds its own standard only where none is given,
# and that is C++17 up to torch 2.11. -fvisibility=hidden: each library keeps its own copy
# of the shared checks (plan/), and exports its module's init function alone.
CXX_STANDARD = "-std=c++20"
CXX_FLAGS = [
    CXX_STANDARD,
    "-O3",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-fvisibility=hidden",
    f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
]
NVCC_FLAGS = [CXX_STANDARD, "-O3", "--use_fast_math", "-lineinfo", "-Xcompiler=-fvisibility=hidden"]
# The libtorch library that exports the stable ABI's C shim (every torch has it).
TORCH_LIBRARIES = ["torch_cpu"]
# KVCANARY_SANITIZE=1: a CPU-only build under AddressSanitizer and UndefinedBehaviorSanitizer
# (build_tools/sanitizer_check.sh), where any report aborts.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1"]


def sanitize() -> bool:
    return os.environ.get("KVCANARY_SANITIZE") == "1"


def _extension(name: str, globs: tuple[str, ...]) -> Extension:
    return Extension(name, sources=_sources(globs), define_macros=[("Py_LIMITED_API", "0x030A0000")], py_limited_api=True)


def with_cuda() -> bool:
    """Whether the CUDA library is built: torch is a CUDA build and a toolkit is found, and
    neither KVCANARY_CPU_ONLY=1 nor a sanitizer build says otherwise."""
    if os.environ.get("KVCANARY_CPU_ONLY") == "1" or sanitize():
        return False
    import torch

    return torch.version.cuda is not None and find_cuda_home() is not None


def extensions() -> list[Extension]:
    """The CPU library, and the CUDA one when `with_cuda`."""
    libraries = [_extension("torch_kvcanary._C", CPU_SOURCE_GLOBS)]
    if with_cuda():
        libraries.append(_extension("torch_kvcanary._C_cuda", CUDA_SOURCE_GLOBS))
    return libraries


def cmdclass() -> dict:
    """{"build_ext": BuildExtension}. torch.utils.cpp_extension reads CUDA_HOME once, when it
    is imported, so the toolkit found here is set in the environment first (the build's
    process only), unless CUDA_HOME names one already."""
    home = find_cuda_home()
    if home is not None and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = str(home)
    from torch.utils import cpp_extension

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension, filling in torch's include paths and libraries."""

        def build_extensions(self) -> None:
            cuda = any(_is_cuda(ext) for ext in self.extensions)
            if cuda:
                os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
            for ext in self.extensions:
                _configure(ext, cpp_extension)
            print(f"torch_kvcanary: building {'with CUDA' if cuda else 'CPU-only'}{' with sanitizers' if sanitize() else ''}")
            super().build_extensions()

    return {"build_ext": BuildExtension}


def _is_cuda(ext: Extension) -> bool:
    return ext.name.endswith("._C_cuda")


def _configure(ext: Extension, cpp_extension) -> None:
    cuda = _is_cuda(ext)
    ext.include_dirs += [str(CSRC)] + cpp_extension.include_paths("cuda" if cuda else "cpu")
    ext.library_dirs += cpp_extension.library_paths("cpu")
    ext.libraries += TORCH_LIBRARIES
    ext.language = "c++"
    ext.extra_compile_args = {"cxx": list(CXX_FLAGS), "nvcc": list(NVCC_FLAGS)}
    if sanitize():
        ext.extra_compile_args["cxx"] += SANITIZE_FLAGS
        ext.extra_link_args += SANITIZE_FLAGS[:1]
    if cuda:
        # The CUDA runtime linked in (with what it needs of the system), so the library
        # serves torch builds of any CUDA version the driver runs.
        home = Path(os.environ["CUDA_HOME"])
        ext.library_dirs += [str(home / "lib64")]
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
