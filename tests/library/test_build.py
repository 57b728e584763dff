"""What was built: libraries that use only libtorch's stable ABI and load in every torch from
the floor on; a CUDA library, loaded under a CUDA build of torch, with sm_80 and sm_90 machine
code and compute_90 PTX; CPU paths that prefetch and share no code; and the include rules of
csrc/ (instruction-set units and CUDA kernels see none of torch's headers)."""

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from helpers import PROJECT_VERSION, REPO

import torch_kvcanary
from build_tools import build_ext
from build_tools.cuda_toolkit import find_cuda_home
from torch_kvcanary import _torch_floor
from torch_kvcanary._library import has_cuda_library
from torch_kvcanary.cli import fold_backends

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

CUDA_LIBRARY = has_cuda_library()
# The CUDA kernels are registered where torch is a CUDA build and the package has them.
CUDA_REGISTERED = CUDA_LIBRARY and torch.version.cuda is not None


def _library(name: str = "_C") -> Path:
    return Path(importlib.util.find_spec(f"torch_kvcanary.{name}").origin)


def _libraries() -> list[Path]:
    return [_library("_C")] + ([_library("_C_cuda")] if CUDA_LIBRARY else [])


def _cuobjdump() -> str | None:
    """cuobjdump of triton (CUDA builds of torch bring it), on PATH, or of the CUDA toolkit."""
    triton = importlib.util.find_spec("triton")
    if triton is not None:
        candidate = Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    home = find_cuda_home()
    toolkit = None if home is None else home / "bin" / "cuobjdump"
    return shutil.which("cuobjdump") or (str(toolkit) if toolkit is not None and toolkit.is_file() else None)


def test_backends_match_the_build():
    backends = fold_backends()
    assert "CPU" in backends and "Meta" in backends
    assert ("CUDA" in backends) == CUDA_REGISTERED


def test_info_says_what_was_built():
    out = subprocess.run([sys.executable, "-m", "torch_kvcanary", "info"], capture_output=True, text=True, check=True).stdout
    assert f"torch_kvcanary {torch_kvcanary.__version__}" in out
    assert "matches the reference" in out
    assert ("CPU-only build" in out) != CUDA_LIBRARY
    assert ("CPU-only torch" in out) == (CUDA_LIBRARY and not CUDA_REGISTERED)


@pytest.mark.skipif(not CUDA_LIBRARY, reason="a CPU-only build: no CUDA code was built")
def test_cuda_library_holds_sm80_sm90_and_ptx():
    tool = _cuobjdump()
    if tool is None and torch.version.cuda is None:
        pytest.skip("no cuobjdump under this CPU-only torch (it ships with triton, which CUDA builds of torch bring)")
    if tool is None:
        pytest.fail("a CUDA build needs cuobjdump to be checked (it ships with triton and the CUDA toolkit)")
    elf = subprocess.run([tool, "--list-elf", str(_library("_C_cuda"))], capture_output=True, text=True, check=True).stdout
    ptx = subprocess.run([tool, "--list-ptx", str(_library("_C_cuda"))], capture_output=True, text=True, check=True).stdout
    assert "sm_80.cubin" in elf and "sm_90.cubin" in elf
    assert "sm_90.ptx" in ptx


# --- one build for every torch from the floor on ------------------------------------------------

LIBTORCH_CPP = re.compile(r"\b(at|c10|torch|caffe2)::")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_no_library_needs_a_cpp_symbol_of_libtorch():
    # libtorch's C++ symbols change with every release; its stable ABI is a C shim
    # (aoti_torch_*, torch_*), which is all the libraries may take from it.
    for library in _libraries():
        undefined = subprocess.run(["nm", "-D", "--undefined-only", "-C", str(library)], capture_output=True, text=True, check=True).stdout
        assert [line.split()[-1] for line in undefined.splitlines() if LIBTORCH_CPP.search(line)] == [], library.name


def _dynamic_symbols(library: Path, which: str) -> set[str]:
    listing = subprocess.run(["nm", "-D", which, str(library)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_this_torch_has_every_shim_function_the_libraries_link():
    # Functions bind when first called, so one this torch lacked would abort the process
    # mid-call rather than fail the import: each must be in this torch's libtorch_cpu.
    torch_cpu = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    defined = _dynamic_symbols(torch_cpu, "--defined-only")
    for library in _libraries():
        shim = {name for name in _dynamic_symbols(library, "--undefined-only") if name.startswith(("aoti_torch_", "torch_"))}
        assert shim and sorted(shim - defined) == [], library.name


def _needed(library: Path) -> list[str]:
    dynamic = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[1] for line in dynamic.splitlines() if line.strip().startswith("NEEDED"))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_libraries_need_only_the_libtorch_every_torch_has():
    # No libtorch_cuda, c10_cuda or libcudart: the CPU library loads under a CPU-only torch, and
    # the CUDA one under a CUDA torch of any CUDA version (its runtime is linked in).
    for library in _libraries():
        needed = _needed(library)
        assert [name for name in needed if "torch" in name or "c10" in name or "cuda" in name] == ["libtorch_cpu.so"], (
            library.name,
            needed,
        )


def test_the_torch_floor_is_said_alike_everywhere():
    floor = ".".join(map(str, _torch_floor.TORCH_FLOOR))
    assert build_ext.TORCH_FLOOR == _torch_floor.TORCH_FLOOR
    assert build_ext.TORCH_TARGET_VERSION == "0x{:02x}{:02x}000000000000".format(*_torch_floor.TORCH_FLOOR)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dependencies = \["torch>=' + re.escape(floor) + r'"[,\]]', pyproject, re.MULTILINE), pyproject


def test_the_version_has_one_source():
    """pyproject.toml's version is the installed package's `__version__`, and the changelog
    has its entry."""
    assert torch_kvcanary.__version__ == PROJECT_VERSION
    assert (REPO / "CHANGELOG.md").read_text().count(f"\n## {PROJECT_VERSION}\n") == 1


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None, reason="needs objdump on x86-64")
def test_the_wheel_holds_every_package_of_the_source_tree():
    """setuptools finds the wheel's packages (pyproject.toml's packages.find: torch_kvcanary
    and below), which are the folders with an ``__init__.py``: every folder of Python has
    one, and the package this test imports (the installed wheel, in make wheel-check) holds
    every package of the source tree."""
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert found == {"include": ["torch_kvcanary", "torch_kvcanary.*"]}
    source = REPO / "torch_kvcanary"
    folders = {path.parent for path in source.rglob("*.py") if "__pycache__" not in path.parts}
    assert [f for f in folders if not (f / "__init__.py").exists()] == []
    assert _packages(Path(torch_kvcanary.__file__).parent) == _packages(source)


def _packages(root: Path) -> set[tuple[str, ...]]:
    """The packages below ``root``, each as its path's parts under it."""
    return {path.parent.relative_to(root).parts for path in root.rglob("__init__.py")}


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
