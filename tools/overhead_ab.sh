#!/usr/bin/env bash
# The per-call time of a fold of 256 slots (benchmarks/bench.py --call-overhead) of BASE, a
# git revision (default main), beside this tree's build, on the CPU:
#   1. the op of both builds in one process, taken in turns: BASE's library is built with its
#      namespace renamed (kvcanary_base) and loaded beside this tree's;
#   2. the package's fold of each build in alternating processes (ROUNDS of each, default 5),
#      BASE's package timed by this tree's benchmark; their medians.
# This tree's library must be built in place first (setup.py build_ext --inplace).
# Usage: tools/overhead_ab.sh [BASE] [ROUNDS]   (PYTHON: a Python with torch; default python)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
base=${1:-main}
rounds=${2:-5}
python=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/base"
git -C "$repo" archive "$base" | tar -x -C "$work/base"
cp -r "$repo/benchmarks" "$work/base/"
cp -r "$work/base" "$work/renamed"
# Both builds take Python's own flags, as a plain build does; the renamed one adds the macro.
cflags=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("CFLAGS"))')
(cd "$work/base" && KVCANARY_CPU_ONLY=1 "$python" setup.py -q build_ext --inplace >/dev/null)
(cd "$work/renamed" && KVCANARY_CPU_ONLY=1 CFLAGS="$cflags -Dkvcanary=kvcanary_base" "$python" setup.py -q build_ext --inplace >/dev/null)

echo "== one process: this tree's op beside $base's =="
(cd "$repo" && "$python" -m benchmarks.bench --call-overhead --baseline-library "$work/renamed/torch_kvcanary/_C.abi3.so" 2>/dev/null)

echo "== alternating processes: the package's fold, $base and this tree, $rounds each =="
for round in $(seq "$rounds"); do
  (cd "$work/base" && "$python" -m benchmarks.bench --call-overhead --json "$work/base-$round.json" >/dev/null 2>&1)
  (cd "$repo" && "$python" -m benchmarks.bench --call-overhead --json "$work/tree-$round.json" >/dev/null 2>&1)
done
"$python" - "$work" "$rounds" "$base" <<'PY'
import json, statistics, sys
work, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def medians(side):
    runs = [json.load(open(f"{work}/{side}-{r}.json"))["call_overhead_us"] for r in range(1, rounds + 1)]
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}
a, b = medians("base"), medians("tree")
for name in a:
    print(f"{name}: {base} {a[name]:.2f} us, this tree {b[name]:.2f} us ({b[name] - a[name]:+.2f} us)")
PY
