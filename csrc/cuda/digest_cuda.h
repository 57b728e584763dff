// The interface between the CUDA digest op (cuda/digest_cuda.cpp, plain C++)
// and its kernel (cuda/digest_cuda_kernel.cu, compiled by nvcc without the
// torch headers).
#pragma once

#include <cuda_runtime_api.h>

#include "core/digest_math.h"
#include "cuda/launch_limits.h"

namespace kvcanary {

struct DigestLaunchArgs {
  DigestView views[kSourcesPerLaunch];
  // Units of views [0, j) per entry: term t of the launch is entry
  // t / units_per_entry, unit t % units_per_entry of the views in order.
  int64_t first_unit[kSourcesPerLaunch + 1];
  int num_views;
  int64_t capacity;          // smallest view capacity of the whole digest
  const int64_t* slots;      // contiguous, num_entries
  const int64_t* positions;  // contiguous, num_entries
  const int64_t* groups;     // contiguous, num_entries; null: every entry in group 0
  int64_t num_entries;
  int64_t num_groups;
  int64_t* out;  // num_groups sums, added to (wrapping)
};
static_assert(sizeof(DigestLaunchArgs) <= kMaxLaunchArgBytes,
              "a launch's arguments must fit the limit");

cudaError_t launch_digest(const DigestLaunchArgs& args, cudaStream_t stream);

}  // namespace kvcanary
