// The CPU digest's instruction-set paths. Each is compiled in the fold's
// instruction-set translation unit (cpu/isa/scalar.cpp, cpu/isa/avx2.cpp,
// cpu/isa/avx512.cpp) with that unit's lane type, as its second entry point;
// cpu/cpu_path.cpp picks one at run time, for the fold and the digest alike.
// Like cpu/kernels/fold_cpu.h, this header holds only data, constants and
// declarations.
#pragma once

#include <cstdint>

#include "core/digest_math.h"

namespace kvcanary {

// Entries a task holds at least: a lane group's worth on every path (a path
// hashes up to 64 entries side by side).
constexpr int64_t kDigestBatchEntries = 64;

// The terms of entries [begin, end): slots[i] >= 0 and < capacity (others add
// nothing) with groups[i] (null: all 0) in [0, num_groups), added (wrapping)
// to sums[groups[i]]. Data only, as cpu/kernels/fold_cpu.h says why.
struct CpuDigestRange {
  const DigestView* views;
  int num_views;
  int64_t capacity;
  const int64_t* slots;
  const int64_t* positions;
  const int64_t* groups;
  int64_t num_groups;
  int64_t begin;
  int64_t end;
  // The entries the thread digests after these (empty when none): their
  // first tokens are prefetched while the range's last ones are hashed.
  int64_t next_begin;
  int64_t next_end;
  uint64_t* sums;
};

void digest_range_scalar(const CpuDigestRange& range);
#if defined(__x86_64__)
void digest_range_avx2(const CpuDigestRange& range);
void digest_range_avx512(const CpuDigestRange& range);
#endif

}  // namespace kvcanary
