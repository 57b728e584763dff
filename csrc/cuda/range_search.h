// The interface between the CUDA range checks (cuda/checks.cpp, plain C++) and
// their kernels (cuda/range_search_kernel.cu, compiled by nvcc without torch):
// the position of the first entry a check refuses, found on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvcanary {

// What *first holds when no entry is refused.
constexpr unsigned long long kNoEntry = ~0ULL;

// *first = the position of the first of the n entries of `index` (int32 when
// index_int32, int64 otherwise) that is >= limit, or kNoEntry.
cudaError_t launch_first_at_least(const void* index, bool index_int32, int64_t n, int64_t limit,
                                  unsigned long long* first, cudaStream_t stream);

// *first = the position of the first of the n entries whose slot is >= 0 and
// whose group is outside [0, num_groups), or kNoEntry.
cudaError_t launch_first_bad_group(const int64_t* slots, const int64_t* groups, int64_t n,
                                   int64_t num_groups, unsigned long long* first,
                                   cudaStream_t stream);

}  // namespace kvcanary
