// The violation ring's device side, shared by the CUDA kernels of record,
// verify and paged_step (device code only; included by .cu files). Rows are
// claimed with atomics, so the ring's rows are in no particular order.
#pragma once

#include <cstdint>

#include "core/canary_records.h"

namespace kvcanary {
namespace {

__device__ __forceinline__ unsigned long long* as_counter(int64_t* p) {
  return reinterpret_cast<unsigned long long*>(p);
}

// Counts a violation and claims its ring row: the row's index, or -1 where
// the ring is full (the row is dropped, counted as an overflow).
__device__ __forceinline__ int64_t claim_ring_row(int64_t* counters, int64_t ring_capacity) {
  const auto index = static_cast<int64_t>(atomicAdd(as_counter(counters + kRingWrite), 1ull));
  atomicAdd(as_counter(counters + kViolations), 1ull);
  if (index >= ring_capacity) {
    atomicAdd(as_counter(counters + kRingOverflow), 1ull);
    return -1;
  }
  return index;
}

// Writes the kViolationFields values of `row` at ring row `index`.
__device__ __forceinline__ void write_ring_row(int64_t* ring, int64_t index, const int64_t* row) {
  for (int f = 0; f < kViolationFields; ++f) {
    ring[index * kViolationFields + f] = row[f];
  }
}

}  // namespace
}  // namespace kvcanary
