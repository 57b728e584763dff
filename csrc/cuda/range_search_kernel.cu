// CUDA kernels of the range checks (cuda/checks.cpp): each thread takes a
// strided share of the entries and lowers *first to the first position it
// refuses, so *first ends as the first refused position of all.
#include "cuda/launch_shape.h"
#include "cuda/range_search.h"

namespace kvcanary {
namespace {

constexpr int kSearchThreads = 256;
constexpr int64_t kMaxSearchBlocks = 1024;

template <typename Refused>
__global__ void __launch_bounds__(kSearchThreads)
    first_refused_kernel(int64_t n, Refused refused, unsigned long long* first) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSearchThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSearchThreads + threadIdx.x; i < n;
       i += stride) {
    if (refused(i)) {
      atomicMin(first, static_cast<unsigned long long>(i));
      return;  // this thread's later entries come after i
    }
  }
}

template <typename Refused>
cudaError_t launch_search(int64_t n, Refused refused, unsigned long long* first,
                          cudaStream_t stream) {
  const cudaError_t reset = cudaMemsetAsync(first, 0xFF, sizeof(*first), stream);  // kNoEntry
  if (reset != cudaSuccess || n == 0) {
    return reset;
  }
  first_refused_kernel<<<grid_blocks(n, kSearchThreads, kMaxSearchBlocks), kSearchThreads, 0,
                         stream>>>(n, refused, first);
  return cudaGetLastError();
}

template <typename index_t>
struct AtLeast {
  const index_t* index;
  int64_t limit;
  __device__ bool operator()(int64_t i) const { return static_cast<int64_t>(index[i]) >= limit; }
};

struct BadGroup {
  const int64_t* slots;
  const int64_t* groups;
  int64_t num_groups;
  __device__ bool operator()(int64_t i) const {
    return slots[i] >= 0 && (groups[i] < 0 || groups[i] >= num_groups);
  }
};

}  // namespace

cudaError_t launch_first_at_least(const void* index, bool index_int32, int64_t n, int64_t limit,
                                  unsigned long long* first, cudaStream_t stream) {
  if (index_int32) {
    return launch_search(n, AtLeast<int32_t>{static_cast<const int32_t*>(index), limit}, first,
                         stream);
  }
  return launch_search(n, AtLeast<int64_t>{static_cast<const int64_t*>(index), limit}, first,
                       stream);
}

cudaError_t launch_first_bad_group(const int64_t* slots, const int64_t* groups, int64_t n,
                                   int64_t num_groups, unsigned long long* first,
                                   cudaStream_t stream) {
  return launch_search(n, BadGroup{slots, groups, num_groups}, first, stream);
}

}  // namespace kvcanary
