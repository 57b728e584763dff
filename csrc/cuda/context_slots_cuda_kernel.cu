// CUDA kernels of kvcanary::context_slots and of verify_context's entries:
// one thread per entry in a grid-stride loop, its row found by a binary search
// in the offsets (a step has at most a few thousand rows, so the search stays
// in cache).
#include "cuda/context_slots_cuda.h"
#include "cuda/launch_shape.h"

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

__global__ void __launch_bounds__(kContextThreads)
    context_checks_kernel(const ContextRanges c, const ContextChecks k, int64_t* tokens,
                          unsigned long long* waiting) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kContextThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kContextThreads + threadIdx.x;
       i < c.num_entries; i += stride) {
    const int64_t r = row_of(c, i);
    write_entry(c, i, r);
    if (select_entry(c, k, i, r, tokens)) {
      atomicAdd(waiting, 1ull);
    }
  }
}

}  // namespace

cudaError_t launch_context_checks(const ContextRanges& ranges, const ContextChecks& checks,
                                  int64_t* tokens, int64_t* waiting, cudaStream_t stream) {
  cudaError_t error = cudaMemsetAsync(waiting, 0, sizeof(int64_t), stream);
  if (error != cudaSuccess || ranges.num_entries == 0) {
    return error;
  }
  context_checks_kernel<<<grid_blocks(ranges.num_entries, kContextThreads, kMaxContextBlocks),
                          kContextThreads, 0, stream>>>(
      ranges, checks, tokens, reinterpret_cast<unsigned long long*>(waiting));
  return cudaGetLastError();
}

cudaError_t launch_context_slots(const ContextRanges& ranges, cudaStream_t stream) {
  if (ranges.num_entries == 0) {
    return cudaSuccess;
  }
  context_slots_kernel<<<grid_blocks(ranges.num_entries, kContextThreads, kMaxContextBlocks),
                         kContextThreads, 0, stream>>>(ranges);
  return cudaGetLastError();
}

}  // namespace kvcanary
