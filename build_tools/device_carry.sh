#!/usr/bin/env bash
# Fills .whl/ (git-ignored), which a call of the GPU machine carries: the wheels
# build_tools/device_check.sh installs there (that machine has no package registry;
# pytest-xdist runs its tests in worker processes), and the package's wheel when `make
# wheel` has built one in dist/ (the check then tests it instead of building there).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl expecttest "setuptools>=77" pytest-xdist execnet
rm -f .whl/torch_kvcanary-*.whl
if ls dist/torch_kvcanary-*.whl >/dev/null 2>&1; then cp dist/torch_kvcanary-*.whl .whl/; fi
