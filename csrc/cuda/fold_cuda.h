// The interface between the CUDA op (cuda/fold_cuda.cpp, plain C++) and its
// kernel (cuda/fold_cuda_kernel.cu, compiled by nvcc without the torch
// headers).
#pragma once

#include <cuda_runtime_api.h>

#include "core/fold_math.h"
#include "cuda/launch_limits.h"
#include "cuda/launch_shape.h"

namespace kvcanary {

// One thread per slot, in a 1-D grid.
constexpr int kThreadsPerBlock = 128;
constexpr int64_t kMaxSlotsPerCall = kMaxGridBlocks * kThreadsPerBlock;

struct FoldLaunchArgs {
  SourceLayout sources[kSourcesPerLaunch];
  int num_sources;
  int64_t capacity;   // smallest source capacity of the whole fold
  const void* slots;  // int32 or int64, contiguous
  bool slots_are_int32;
  int64_t num_slots;
  int64_t* out;         // one int64 per slot
  bool continue_chain;  // start from `out` (the fold of earlier sources)
};
static_assert(sizeof(FoldLaunchArgs) <= kMaxLaunchArgBytes,
              "a launch's arguments must fit the limit");

cudaError_t launch_fold(const FoldLaunchArgs& args, cudaStream_t stream);

}  // namespace kvcanary
