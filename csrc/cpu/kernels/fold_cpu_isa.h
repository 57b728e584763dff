// The CPU kernels' instruction-set paths by name, and which ones this CPU
// runs. Portable code only (cpu/cpu_path.cpp, tools/kernel_ab.cpp): see
// cpu/kernels/fold_cpu.h.
#pragma once

#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {

// Indexed by CpuIsa.
constexpr const char* kCpuIsaNames[] = {"scalar", "avx2", "avx512"};

// Whether this CPU has the instructions of `isa`'s path.
inline bool cpu_runs(CpuIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2");
    case CpuIsa::kScalar:
      return true;
  }
  return false;
#else
  return isa == CpuIsa::kScalar;
#endif
}

}  // namespace kvcanary
