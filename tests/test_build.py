"""What was built: a CUDA kernel whenever torch is a CUDA build and a toolkit is
present, with sm_80 and sm_90 machine code and compute_90 PTX; CPU paths that prefetch and
share no code; and the include rules of csrc/ (instruction-set units and CUDA kernels see
none of torch's headers)."""

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO

import torch_kvcanary
from build_tools.cuda_toolkit import find_cuda_home
from torch_kvcanary.cli import fold_backends

CUDA_BUILD = torch.version.cuda is not None and find_cuda_home() is not None


def _library() -> Path:
    return Path(importlib.util.find_spec("torch_kvcanary._C").origin)


def _cuobjdump() -> str | None:
    triton = importlib.util.find_spec("triton")
    if triton is not None:
        candidate = Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("cuobjdump")


def test_backends_match_the_build():
    backends = fold_backends()
    assert "CPU" in backends and "Meta" in backends
    assert ("CUDA" in backends) == CUDA_BUILD


def test_info_says_what_was_built():
    out = subprocess.run([sys.executable, "-m", "torch_kvcanary", "info"], capture_output=True, text=True, check=True).stdout
    assert f"torch_kvcanary {torch_kvcanary.__version__}" in out
    assert "matches the reference" in out
    assert ("CPU-only build" in out) != CUDA_BUILD


@pytest.mark.skipif(not CUDA_BUILD, reason="CPU-only torch or no CUDA toolkit: no CUDA code was built")
def test_cuda_library_holds_sm80_sm90_and_ptx():
    tool = _cuobjdump()
    if tool is None:
        pytest.fail("a CUDA build needs cuobjdump to be checked (it ships with triton)")
    elf = subprocess.run([tool, "--list-elf", str(_library())], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(_library())], capture_output=True, text=True, check=True).stdout
    assert "sm_80.cubin" in elf and "sm_90.cubin" in elf
    assert "sm_90.ptx" in ptx


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None, reason="needs objdump on x86-64")
@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_cpu_path_prefetches_the_next_group(path):
    # These paths have no in-row prefetch, so a prefetch in their code is the next-group
    # one, which a compiler drops when it sees a function that only prefetches.
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(_library())], capture_output=True, text=True, check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", asm)
    mine = [f for f in functions if f"fold_task_{path}(" in f.split("\n", 1)[0] or f"{path.capitalize()}Lanes" in f.split("\n", 1)[0]]
    assert mine, f"no code of the {path} path found"
    assert any("prefetch" in f for f in mine)


def _defined_symbols(compiler: str, source: Path, obj: Path) -> list[tuple[str, str]]:
    subprocess.run(
        [compiler, "-O0", "-std=c++17", f"-I{REPO / 'csrc'}", "-c", str(source), "-o", str(obj)], check=True, capture_output=True
    )
    listing = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    return [(line.split(" ", 2)[1], line.split(" ", 2)[2]) for line in listing.splitlines() if line.count(" ") >= 2]


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("nm") is None,
    reason="needs a C++ compiler and nm on x86-64",
)
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_cpu_path_shares_no_code_with_other_units(path, tmp_path):
    # An instruction-set unit compiles every function it defines for its instruction set; a
    # weak (inline, template) or other external definition there could be the copy the linker
    # keeps for every unit, and run AVX-512 code on a CPU without it. At -O0 nothing is inlined
    # away, so every such definition shows: the unit must export its entry points (the fold's and
    # the digest's) and nothing else.
    symbols = _defined_symbols(os.environ.get("CXX", "c++"), REPO / "csrc" / "cpu" / "isa" / f"{path}.cpp", tmp_path / f"{path}.o")
    external = [name for kind, name in symbols if kind.isupper() or kind in "uvw"]
    assert sorted(external) == [
        f"kvcanary::digest_range_{path}(kvcanary::CpuDigestRange const&)",
        f"kvcanary::fold_task_{path}(kvcanary::CpuFoldWork const&, kvcanary::SlotSpan, kvcanary::SlotSpan)",
    ], external


CSRC = REPO / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
# The headers of torch and of what it brings in with it.
TORCH_HEADERS = ("torch/", "ATen/", "c10/", "caffe2/", "pybind11/", "Python.h")
ISA_UNITS = sorted((CSRC / "cpu" / "isa").glob("*.cpp"))
CUDA_KERNELS = sorted([*CSRC.rglob("*.cu"), *CSRC.rglob("*.cuh")])


def _included(source: Path) -> tuple[set[Path], set[str]]:
    """The project headers `source` includes, transitively (quoted includes, written from
    csrc/), and the other headers that any of them includes (angle includes)."""
    project: set[Path] = set()
    system: set[str] = set()
    todo = [source]
    while todo:
        current = todo.pop()
        for kind, name in INCLUDE.findall(current.read_text()):
            if kind == "<":
                system.add(name)
                continue
            header = CSRC / name
            assert header.is_file(), f"{current.relative_to(REPO)} includes {name}, which is not under csrc/"
            if header not in project:
                project.add(header)
                todo.append(header)
    return project, system


def test_the_include_rules_cover_the_sources():
    assert [unit.name for unit in ISA_UNITS] == ["avx2.cpp", "avx512.cpp", "scalar.cpp"]
    assert {kernel.suffix for kernel in CUDA_KERNELS} == {".cu", ".cuh"}


@pytest.mark.parametrize("unit", ISA_UNITS, ids=lambda path: path.name)
def test_instruction_set_unit_includes_only_torch_free_kernel_headers(unit):
    # An instruction-set unit compiles what it includes for its instruction set (see
    # test_cpu_path_shares_no_code_with_other_units): only the torch-free math and kernel
    # headers, and system headers, none of torch's.
    project, system = _included(unit)
    allowed = {CSRC / "core", CSRC / "cpu" / "kernels"}
    assert sorted(str(header.relative_to(CSRC)) for header in project if header.parent not in allowed) == []
    assert sorted(name for name in system if name.startswith(TORCH_HEADERS)) == []


@pytest.mark.parametrize("kernel", CUDA_KERNELS, ids=lambda path: path.name)
def test_cuda_kernel_includes_no_torch_header(kernel):
    # nvcc compiles the kernels without torch's headers, which keeps their builds short and
    # their code free of host-only types; the launchers (cuda/*.cpp) hold the torch side.
    _, system = _included(kernel)
    assert sorted(name for name in system if name.startswith(TORCH_HEADERS)) == []
