// The CPU fold's instruction-set paths. Each lives in its own translation unit
// (fold_cpu_scalar.cpp, fold_cpu_avx2.cpp, fold_cpu_avx512.cpp); fold_cpu.cpp
// picks one at run time. Those units compile every function they see for
// their instruction set, and the linker keeps one copy of each inline function
// or template instantiation with external linkage, from whichever unit it
// likes: so this header, which they include, holds only data, constants and
// declarations, and everything they define is static or in an anonymous
// namespace, but for their one entry point (tests/test_build.py checks it).
#pragma once

#include <cstdint>

#include "fold_math.h"

namespace kvcanary {

// out[i] for slots[i], begin <= i < end.
struct CpuFoldRange {
  const SourceLayout* sources;
  int num_sources;
  int64_t capacity;  // smallest source capacity; slots outside give 0
  const void* slots;
  bool slots_are_int32;
  int64_t begin;
  int64_t end;
  // The slots the same thread folds next, [next_begin, next_end) (empty when
  // none): the first of them are prefetched while the last group is folded.
  int64_t next_begin;
  int64_t next_end;
  int64_t* out;
};

// Every path folds slots in lane groups whose size divides this; tasks handed
// to threads are multiples of it, so no group is split between two tasks.
constexpr int64_t kLaneGroupMultiple = 64;

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

void fold_range_scalar(const CpuFoldRange& range);
#if defined(__x86_64__)
void fold_range_avx2(const CpuFoldRange& range);
void fold_range_avx512(const CpuFoldRange& range);
#endif

}  // namespace kvcanary
