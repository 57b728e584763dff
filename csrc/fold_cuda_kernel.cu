// CUDA kernel of kvcanary::fold. Kept free of torch headers so that nvcc
// compiles it in seconds; argument checks live in fold_cuda.cpp.
//
// A warp folds 32 slots, one per lane. Rows are read in tiles of up to
// 8 chunks (128 bytes) per slot: the warp loads a tile cooperatively, so
// consecutive lanes read consecutive 16-byte chunks of the same row
// (coalesced 128-bit loads), stages it in shared memory, and then each lane
// runs the serial splitmix64 chain over its own row. The grid is sized to the
// batch, so a decode step of a few hundred slots launches a handful of blocks.
#include "fold_cuda.h"

namespace kvcanary {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
constexpr int kTileChunks = 8;
// Row pitch of the staging tile, in chunks: one spare chunk per row puts the
// eight lanes of each shared-memory phase on distinct banks.
constexpr int kRowPitch = kTileChunks + 1;

struct LoadReadOnly {
  __device__ void operator()(const unsigned char* p, uint64_t* lo,
                             uint64_t* hi) const {
    const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(p));
    *lo = v.x;
    *hi = v.y;
  }
};

// The per-source hash h of the lanes' slots; `token` is null for lanes with
// nothing to read. Every lane of the warp must call it.
__device__ uint64_t fold_tokens_cooperatively(const SourceLayout& src,
                                              const unsigned char* token,
                                              ulonglong2* tile) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t chunks = src.read_bytes / kReadAlign;
  const int width = chunks < kTileChunks ? static_cast<int>(chunks) : kTileChunks;
  const LoadReadOnly load;
  uint64_t h = 0;
  for (int64_t first = 0; first < chunks; first += width) {
    for (int c = lane; c < kWarpSize * width; c += kWarpSize) {
      const int row = c / width;
      const int64_t chunk = first + c % width;
      const auto* row_token = reinterpret_cast<const unsigned char*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(token), row));
      uint64_t lo = 0, hi = 0;
      if (row_token != nullptr && chunk < chunks) {
        load(row_token + chunk_offset(src, chunk * kReadAlign), &lo, &hi);
      }
      tile[row * kRowPitch + c % width] = make_ulonglong2(lo, hi);
    }
    __syncwarp();
    if (token != nullptr) {
      const int64_t end = chunks - first < width ? chunks - first : width;
      for (int col = 0; col < end; ++col) {
        const ulonglong2 v = tile[lane * kRowPitch + col];
        h = fold_chunk<uint64_t>(h, v.x, v.y);
      }
    }
    __syncwarp();
  }
  return h;
}

template <typename index_t>
__global__ void __launch_bounds__(kThreadsPerBlock)
    fold_kernel(const FoldLaunchArgs args) {
  __shared__ ulonglong2 tiles[kWarpsPerBlock][kWarpSize * kRowPitch];
  const int warp = threadIdx.x / kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (i - threadIdx.x % kWarpSize >= args.num_slots) {
    return;  // the whole warp is past the batch
  }
  const bool in_batch = i < args.num_slots;
  const int64_t slot =
      in_batch ? static_cast<int64_t>(static_cast<const index_t*>(args.slots)[i]) : -1;
  // Padding and out-of-range slots read nothing and give 0.
  const bool live = slot >= 0 && slot < args.capacity;
  uint64_t acc = live && args.continue_chain ? static_cast<uint64_t>(args.out[i]) : 0;
  for (int s = 0; s < args.num_sources; ++s) {
    const SourceLayout& src = args.sources[s];
    const unsigned char* token = live ? src.data + token_offset(src, slot) : nullptr;
    acc = splitmix64(acc ^ fold_tokens_cooperatively(src, token, tiles[warp]));
  }
  if (in_batch) {
    args.out[i] = live ? static_cast<int64_t>(acc) : 0;
  }
}

}  // namespace

cudaError_t launch_fold(const FoldLaunchArgs& args, cudaStream_t stream) {
  if (args.num_slots == 0) {
    return cudaSuccess;
  }
  const int64_t blocks = (args.num_slots + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (args.slots_are_int32) {
    fold_kernel<int32_t><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(args);
  } else {
    fold_kernel<int64_t><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace kvcanary
