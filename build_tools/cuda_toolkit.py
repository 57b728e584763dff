"""Where the CUDA toolkit is: used by the build (build_tools/build_ext.py) and by the
upstream-style baseline, which compiles its kernel with nvcc at run time.

Imports nothing but the standard library, so that the build can load it before torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _is_cuda_home(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> Path | None:
    """The toolkit folder: $CUDA_HOME, $CUDA_PATH, the parent of the nvcc on PATH, or
    /usr/local/cuda, the first that holds nvcc and the runtime headers. An nvcc on PATH may
    be a wrapper outside the toolkit, which is why each guess must hold the headers."""
    guesses = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        guesses.append(str(Path(nvcc).resolve().parent.parent))
    guesses.append("/usr/local/cuda")
    for guess in filter(None, guesses):
        if _is_cuda_home(Path(guess)):
            return Path(guess)
    return None


def find_nvcc() -> Path | None:
    """nvcc of `find_cuda_home`'s toolkit."""
    home = find_cuda_home()
    return None if home is None else home / "bin" / "nvcc"
