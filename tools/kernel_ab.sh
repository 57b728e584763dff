#!/usr/bin/env bash
# Times two builds of the CPU fold kernel in one process (tools/kernel_ab.cpp):
# A from BASE (a git revision, or a directory holding a csrc tree; default
# HEAD), B from this tree's csrc. Every option after BASE goes to the harness:
#   --isa scalar|avx2|avx512   the path compared (default avx512)
#   --row-bytes N --pool-mib N --threads N --rounds N --order random|sequential
# Example: tools/kernel_ab.sh HEAD~3 --row-bytes 256 --threads 1
# Each build is compiled with its own headers, namespace and side
# (tools/kernel_ab_side.cpp: a revision's own copy, this tree's for B and for a
# csrc directory), so A may be any revision that has tools/kernel_ab_side.cpp.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
base=${1:-HEAD}
shift || true
isa=avx512
args=()
while (($#)); do
  if [[ $1 == --isa ]]; then isa=$2; shift 2; else args+=("$1"); shift; fi
done
if [[ ! $isa =~ ^(scalar|avx2|avx512)$ ]]; then
  echo "kernel_ab: --isa must be scalar, avx2 or avx512" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -d $base ]]; then
  cp -r "$base" "$work/a"
  cp "$repo/tools/kernel_ab_side.cpp" "$work/side_a.cpp"
else
  mkdir "$work/a"
  git -C "$repo" archive "$base" csrc | tar -x -C "$work/a" --strip-components=1
  git -C "$repo" show "$base:tools/kernel_ab_side.cpp" > "$work/side_a.cpp"
fi
cp -r "$repo/csrc" "$work/b"
cp "$repo/tools/kernel_ab_side.cpp" "$work/side_b.cpp"
CXX=${CXX:-g++}
flags=(-O3 -std=c++17)
# KERNEL_AB_KERNEL names the path's entry point for sides older than KERNEL_AB_PATH.
for side in a b; do
  renamed=(-Dkvcanary=kvcanary_$side -I"$work/$side")
  unit="$work/$side/cpu/isa/$isa.cpp"  # csrc/cpu/isa/, or a flat csrc/ before it had folders
  [[ -f $unit ]] || unit="$work/$side/fold_cpu_$isa.cpp"
  "$CXX" "${flags[@]}" "${renamed[@]}" -c "$unit" -o "$work/kernel_$side.o"
  "$CXX" "${flags[@]}" "${renamed[@]}" -DKERNEL_AB_ENTRY=fold_all_$side -DKERNEL_AB_KERNEL=fold_range_$isa -DKERNEL_AB_PATH=$isa \
    -c "$work/side_$side.cpp" -o "$work/side_$side.o"
done
"$CXX" "${flags[@]}" -DKERNEL_AB_ISA="\"$isa\"" -I"$work/b" "$repo/tools/kernel_ab.cpp" "$work"/*.o -o "$work/kernel_ab" -pthread
"$work/kernel_ab" "${args[@]}"
