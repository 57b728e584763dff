// CUDA kernel of kvcanary::fold. Kept free of torch headers so that nvcc
// compiles it in seconds; argument checks live in cuda/fold_cuda.cpp. A warp
// folds 32 slots, one per lane (cuda/fold_cuda_warp.cuh, shared with the canary's
// kernels); the grid is sized to the batch. docs/design.md has the reasons.
#include "cuda/fold_cuda_warp.cuh"

namespace kvcanary {
namespace {

template <typename index_t>
__global__ void __launch_bounds__(kThreadsPerBlock) fold_kernel(const FoldLaunchArgs args) {
  __shared__ ulonglong2 tiles[kWarpsPerBlock][kWarpSize * kRowPitch];
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (i - lane >= args.num_slots) {
    return;  // the whole warp is past the batch
  }
  const bool in_batch = i < args.num_slots;
  const int64_t slot =
      in_batch ? static_cast<int64_t>(static_cast<const index_t*>(args.slots)[i]) : -1;
  // Padding and out-of-range slots read nothing and give 0.
  const bool live = slot >= 0 && slot < args.capacity;
  const uint64_t start = live && args.continue_chain ? static_cast<uint64_t>(args.out[i]) : 0;
  const uint64_t acc = fold_lane_slot(args.sources, args.num_sources, slot, live,
                                      tiles[threadIdx.x / kWarpSize], start);
  if (in_batch) {
    args.out[i] = live ? static_cast<int64_t>(acc) : 0;
  }
}

}  // namespace
cudaError_t launch_fold(const FoldLaunchArgs& args, cudaStream_t stream) {
  if (args.num_slots == 0) {
    return cudaSuccess;
  }
  const unsigned int blocks = grid_blocks(args.num_slots, kThreadsPerBlock);
  if (args.slots_are_int32) {
    fold_kernel<int32_t><<<blocks, kThreadsPerBlock, 0, stream>>>(args);
  } else {
    fold_kernel<int64_t><<<blocks, kThreadsPerBlock, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace kvcanary
