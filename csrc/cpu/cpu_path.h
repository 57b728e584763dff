// The CPU kernels' instruction-set paths (one translation unit each, under
// cpu/isa/) as one table of entry points, and the path this process takes.
#pragma once

#include "cpu/kernels/digest_cpu.h"
#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {

// One path's entry points.
struct CpuPath {
  CpuIsa isa;
  void (*fold_task)(const CpuFoldWork& work, SlotSpan task, SlotSpan next);
  void (*digest_range)(const CpuDigestRange& range);
};

// The path this process takes, chosen on its first use: the best one this CPU
// has, or the lesser one $KVCANARY_CPU_ISA names. The variable is read then
// and never again (as torch reads ATEN_CPU_CAPABILITY), so every kernel of a
// process takes one path; tests force each path in a process of its own.
// Raises ValueError, on every call, when the variable names a path this CPU
// cannot run.
const CpuPath& cpu_path();

}  // namespace kvcanary
