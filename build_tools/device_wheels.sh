#!/usr/bin/env bash
# Fetches the wheels build_tools/device_check.sh installs on the GPU machine (which has
# no registry) into .whl/ (git-ignored); carry .whl with the call.
set -euo pipefail
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl expecttest "setuptools>=70"
