#!/usr/bin/env bash
# Builds the CPU kernel with AddressSanitizer and UndefinedBehaviorSanitizer in a copy
# of the tree (its own build directory, nothing installed) and runs the property,
# bad-input, CPU-path, op-contract, canary and digest tests against it. Any sanitizer report aborts the run.
# Usage: build_tools/sanitizer_check.sh PYTHON   (a Python with torch, pytest, hypothesis)
set -euo pipefail
python=${1:?usage: $0 PYTHON}
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$tree"
cd "$tree"
KVCANARY_SANITIZE=1 "$python" setup.py -q build_ext --inplace

# Python itself is not instrumented: the runtime must be loaded first, with libstdc++
# beside it so that its C++ exception interceptor finds the real one. torch's own
# allocation pairs and duplicate globals are not this package's to judge.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0:detect_odr_violation=0:abort_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$python" -m pytest -q -p no:cacheprovider \
    ${KVCANARY_SANITIZE_TESTS:-tests/ops/test_properties.py tests/ops/test_bad_input.py tests/canary/test_canary_refusals.py tests/digest/test_digest_refusals.py tests/ops/test_cpu_paths.py tests/ops/test_ops.py tests/ops/test_op_contracts.py tests/canary/test_canary_records.py tests/digest/test_digest.py tests/ops/test_paged_step.py}
