#!/usr/bin/env bash
# Fills what a call of the GPU machine carries (both folders are git-ignored):
#   .whl/     the wheels build_tools/device_check.sh installs there (no registry there);
#   .shared/  a copy of ../shared (the golden vectors), which does not travel by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl expecttest "setuptools>=70"
rm -rf .shared && cp -r "${KVCANARY_SHARED:-../shared}" .shared
