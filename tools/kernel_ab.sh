#!/usr/bin/env bash
# Times two builds of the CPU fold kernel in one process (tools/kernel_ab.cpp):
# A from BASE (a git revision, or a directory holding a csrc tree; default
# HEAD), B from this tree's csrc. Every option after BASE goes to the harness:
#   --isa scalar|avx2|avx512   the path compared (default avx512)
#   --row-bytes N --pool-mib N --threads N --rounds N --order random|sequential
# Example: tools/kernel_ab.sh HEAD~3 --row-bytes 256 --threads 1
# One harness passes the same CpuFoldRange and SourceLayout to both builds, so
# A's fold_cpu.h and fold_math.h must declare them as B's do; a base whose
# fold_cpu.h differs is refused.
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
else
  mkdir "$work/a"
  git -C "$repo" archive "$base" csrc | tar -x -C "$work/a" --strip-components=1
fi
cp -r "$repo/csrc" "$work/b"
if ! cmp -s "$work/a/fold_cpu.h" "$work/b/fold_cpu.h"; then
  echo "kernel_ab: fold_cpu.h differs between $base and this tree; compare builds that share it" >&2
  exit 2
fi
CXX=${CXX:-g++}
flags=(-O3 -std=c++17)
"$CXX" "${flags[@]}" -Dfold_range_$isa=fold_range_a -c "$work/a/fold_cpu_$isa.cpp" -o "$work/a.o"
"$CXX" "${flags[@]}" -Dfold_range_$isa=fold_range_b -c "$work/b/fold_cpu_$isa.cpp" -o "$work/b.o"
"$CXX" "${flags[@]}" -DKERNEL_AB_ISA="\"$isa\"" -I"$work/b" "$repo/tools/kernel_ab.cpp" "$work/a.o" "$work/b.o" -o "$work/kernel_ab" -pthread
"$work/kernel_ab" "${args[@]}"
