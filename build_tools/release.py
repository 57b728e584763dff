"""The release's checks and its package index, run by the Makefile's `release` targets:

    python build_tools/release.py audit AUDITWHEEL WHEEL   what the wheel's tag promises, and why
    python build_tools/release.py sdist SDIST              the sdist holds what a build and its tests need
    python build_tools/release.py index DIST INDEX         a PEP 503 index of DIST's files in INDEX

The wheel's libraries need libtorch_cpu.so, which comes from the user's torch (loaded before
them) and so is left out of the wheel, like every library of torch's; the CUDA library links
the CUDA runtime statically, so the wheel needs no libcudart. Everything else they need is in
the manylinux policy the wheel is tagged with, which the build host's glibc and libstdc++ set:
auditwheel gives the oldest policy whose symbol versions the libraries stay within.

Imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import tomllib

PROJECT = "torch-kvcanary"  # the name a package index files it under (PEP 503 normalized)
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Libraries the wheel's libraries need that come with the user's torch, never bundled.
TORCH_LIBRARY = re.compile(r"^lib(torch|torch_cpu|c10)\.so$")
LIBRARIES = ("torch_kvcanary/_C.abi3.so", "torch_kvcanary/_C_cuda.abi3.so")
# What the sdist must hold for `pip install` to build it and for its tests to run there.
SDIST_MEMBERS = (
    "pyproject.toml",
    "setup.py",
    "LICENSE",
    "README.md",
    "CHANGELOG.md",
    "build_tools/build_ext.py",
    "build_tools/cuda_toolkit.py",
    "csrc/ops.cpp",
    "torch_kvcanary/__init__.py",
    "tests/conftest.py",
    "tests/data/fold_vectors.json",
)


def fail(message: str) -> None:
    sys.exit(f"kv-canary: {message}")


def audit(auditwheel: Path, wheel: Path) -> None:
    """Prints the policy the wheel meets and what sets it; fails unless the wheel is tagged with
    that manylinux policy, needs nothing outside it but torch's libraries, and holds both libraries."""
    report = json.loads(subprocess.run([str(auditwheel), "show", "--json", str(wheel)], capture_output=True, text=True, check=True).stdout)
    policy = report["sym_tag"]
    external = sorted(report["external_libs"])
    newest = {library: max(versions, key=_version_key) for library, versions in report["versioned_symbols"].items()}
    print(f"{wheel.name}: meets {policy}, set by the newest symbol versions it uses: {newest}")
    print(f"left to the user's torch: {external}; the CUDA runtime is linked into _C_cuda statically")
    if not policy.startswith("manylinux_"):
        fail(f"the libraries meet no manylinux policy ({policy}): build on an older glibc")
    if not wheel.name.endswith(f"-{policy}.whl"):
        fail(f"{wheel.name} is not tagged {policy}: run `make wheel`, which repairs it with auditwheel")
    strays = [library for library in external if not TORCH_LIBRARY.match(library)]
    if strays:
        fail(f"the libraries need {strays}, which neither the policy nor torch provides")
    held = sorted(name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".so"))
    if held != sorted(LIBRARIES):
        fail(f"the wheel holds {held}, where {list(LIBRARIES)}: build it against a CUDA build of torch with a toolkit")


def _version_key(symbol_version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", symbol_version))


def sdist(archive: Path) -> None:
    """Fails unless the sdist holds SDIST_MEMBERS under its one top folder."""
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    top = names[0].split("/", 1)[0]
    missing = [member for member in SDIST_MEMBERS if f"{top}/{member}" not in names]
    if missing:
        fail(f"{archive.name} lacks {missing}: list them in MANIFEST.in")
    print(f"{archive.name}: {len(names)} entries, {archive.stat().st_size / 2**10:.0f} KiB, with the sources, the build and the tests")


def index(dist: Path, root: Path) -> None:
    """Writes a PEP 503 simple index of dist's wheels and sdists in root: root/index.html and
    root/torch-kvcanary/index.html, each file linked with its sha256 and Requires-Python, the
    files copied beside it. `pip install --extra-index-url file://ROOT torch_kvcanary` then
    installs by name, as from a package index or a mirror."""
    files = sorted([*dist.glob("*.whl"), *dist.glob("*.tar.gz")])
    if not files:
        fail(f"nothing to index in {dist}: run `make release`")
    project = root / PROJECT
    project.mkdir(parents=True, exist_ok=True)
    requires_python = html.escape(tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"])
    links = []
    for file in files:
        data = file.read_bytes()
        (project / file.name).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        links.append(
            f'<a href="{html.escape(file.name)}#sha256={digest}" data-requires-python="{requires_python}">{html.escape(file.name)}</a><br>'
        )
    (project / "index.html").write_text(_page(PROJECT, links))
    (root / "index.html").write_text(_page("Simple index", [f'<a href="{PROJECT}/">{PROJECT}</a><br>']))
    print(f"{root}: {', '.join(file.name for file in files)}")


def _page(title: str, links: list[str]) -> str:
    body = "\n".join(links)
    return f"<!DOCTYPE html>\n<html><head><title>{title}</title></head><body>\n{body}\n</body></html>\n"


def main(argv: list[str]) -> None:
    commands = {"audit": (audit, 2), "sdist": (sdist, 1), "index": (index, 2)}
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]][1]:
        fail(f"usage: release.py {{audit AUDITWHEEL WHEEL | sdist SDIST | index DIST INDEX}}, not {argv}")
    command, _ = commands[argv[0]]
    command(*map(Path, argv[1:]))


if __name__ == "__main__":
    main(sys.argv[1:])
