"""Compiles torch_kvcanary._C against the installed torch.

The CPU sources are listed in pyproject.toml. The CUDA kernel is added when
torch is a CUDA build and a CUDA toolkit (nvcc and its headers) is found;
otherwise the library is CPU-only, which `python -m torch_kvcanary info`
reports. Targets sm_80 and sm_90 code plus compute_90 PTX unless
TORCH_CUDA_ARCH_LIST says otherwise.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CUDA_SOURCES = ("csrc/fold_cuda.cpp", "csrc/fold_cuda_kernel.cu", "csrc/canary_cuda.cpp", "csrc/canary_cuda_kernel.cu")
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


def _is_cuda_home(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> Path | None:
    """The toolkit folder. An `nvcc` on PATH may be a wrapper outside the toolkit
    (torch would then guess its parent), so each guess must hold the headers."""
    guesses = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        guesses.append(str(Path(nvcc).resolve().parent.parent))
    guesses.append("/usr/local/cuda")
    for guess in filter(None, guesses):
        if _is_cuda_home(Path(guess)):
            return Path(guess)
    return None


def _configure_cuda_home() -> Path | None:
    # Must run before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
    home = find_cuda_home()
    if home is not None:
        os.environ["CUDA_HOME"] = str(home)
    return home


_CUDA_HOME = _configure_cuda_home()

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def with_cuda() -> bool:
    if os.environ.get("KVCANARY_CPU_ONLY") == "1" or sanitize():
        return False
    return torch.version.cuda is not None and _CUDA_HOME is not None


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, filling in torch's include paths and libraries."""

    def build_extensions(self) -> None:
        cuda = with_cuda()
        if cuda:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        for ext in self.extensions:
            _configure(ext, cuda)
        print(f"torch_kvcanary: building {'with CUDA' if cuda else 'CPU-only'}{' with sanitizers' if sanitize() else ''}")
        super().build_extensions()


def _configure(ext, cuda: bool) -> None:
    device = "cuda" if cuda else "cpu"
    ext.include_dirs += cpp_extension.include_paths(device)
    ext.library_dirs += cpp_extension.library_paths(device)
    ext.libraries += ["c10", "torch", "torch_cpu"]
    ext.language = "c++"
    ext.extra_compile_args = {"cxx": list(CXX_FLAGS), "nvcc": list(NVCC_FLAGS)}
    if sanitize():
        ext.extra_compile_args["cxx"] += SANITIZE_FLAGS
        ext.extra_link_args += SANITIZE_FLAGS[:1]
    if cuda:
        ext.sources += list(CUDA_SOURCES)
        ext.libraries += ["c10_cuda", "torch_cuda", "cudart"]
