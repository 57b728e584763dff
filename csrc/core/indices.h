// Reading the ops' index inputs (slots, positions, block tables, token
// histories: int32 or int64) and searching sorted int64 arrays. Torch-free,
// shared by the CPU and CUDA kernels.
#pragma once

#include <cstdint>

#include "core/fold_math.h"

namespace kvcanary {

// Positions, token counts and block sizes stay far below int64's range, so
// that sums and small multiples of a few never overflow.
constexpr int64_t kMaxTokens = int64_t{1} << 48;

// Element `at` (in elements, any strides already applied) of an index
// tensor's data, int32 when is_int32, else int64.
KVC_HOST_DEVICE int64_t load_index(const void* data, bool is_int32, int64_t at) {
  return is_int32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[at])
                  : static_cast<const int64_t*>(data)[at];
}

// The first i in [0, n) with values[i] >= key, or n when there is none
// (values nondecreasing): a binary search.
KVC_HOST_DEVICE int64_t lower_bound_of(const int64_t* values, int64_t n, int64_t key) {
  int64_t lo = 0;
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (values[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace kvcanary
