// CUDA kernel of kvcanary::context_slots: one thread per entry in a
// grid-stride loop, its row found by a binary search in the offsets (a step
// has at most a few thousand rows, so the search stays in cache).
#include <algorithm>

#include "cuda/context_slots_cuda.h"

namespace kvcanary {
namespace {

constexpr int kContextThreads = 256;
constexpr int64_t kMaxContextBlocks = 8192;

__global__ void __launch_bounds__(kContextThreads) context_slots_kernel(const ContextRanges c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kContextThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kContextThreads + threadIdx.x;
       i < c.num_entries; i += stride) {
    write_entry(c, i, row_of(c, i));
  }
}

}  // namespace

cudaError_t launch_context_slots(const ContextRanges& ranges, cudaStream_t stream) {
  if (ranges.num_entries == 0) {
    return cudaSuccess;
  }
  const int64_t blocks =
      std::min(kMaxContextBlocks, (ranges.num_entries + kContextThreads - 1) / kContextThreads);
  context_slots_kernel<<<static_cast<unsigned int>(blocks), kContextThreads, 0, stream>>>(ranges);
  return cudaGetLastError();
}

}  // namespace kvcanary
