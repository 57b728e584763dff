// CUDA kernel of kvcanary::fold. Kept free of torch headers so that nvcc
// compiles it in seconds; argument checks live in fold_cuda.cpp.
//
// A warp folds 32 slots, one per lane. Each source's rows are read in tiles
// of up to 8 chunks (128 bytes) per slot: the warp copies a tile
// cooperatively, consecutive lanes taking consecutive 16-byte chunks of the
// same row (coalesced), into shared memory, and then each lane runs the
// serial splitmix64 chain over its own row. The copies are asynchronous
// (cp.async) and run kStages - 1 tiles ahead of the hashing, across source
// boundaries, so a warp keeps its memory requests in flight while it hashes:
// the chain is serial, and without this each tile would pay a full memory
// latency (a decode step of a few slots is all latency). The grid is sized to
// the batch.
#include <cuda_pipeline_primitives.h>

#include "fold_cuda.h"

namespace kvcanary {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
constexpr int kTileChunks = 8;
constexpr int kStages = 4;
// Row pitch of a staging tile, in chunks: one spare chunk per row puts the
// eight lanes of each shared-memory phase on distinct banks.
constexpr int kRowPitch = kTileChunks + 1;
constexpr int kTileSize = kWarpSize * kRowPitch;  // in 16-byte chunks
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t num_chunks(const SourceLayout& src) {
  return src.read_bytes / kReadAlign;
}

__device__ __forceinline__ int tile_width(const SourceLayout& src) {
  const int64_t chunks = num_chunks(src);
  return chunks < kTileChunks ? static_cast<int>(chunks) : kTileChunks;
}

// Where a warp is in its walk over the tiles of all sources: tile `first`
// (a chunk index) of source `source`, whose token for this lane's slot is
// `token` (null when the lane has nothing to read).
struct TileCursor {
  int source;
  int64_t first;
  const unsigned char* token;
};

__device__ __forceinline__ const unsigned char* token_of(
    const FoldLaunchArgs& args, int source, int64_t slot, bool live) {
  if (!live || source >= args.num_sources) {
    return nullptr;
  }
  const SourceLayout& src = args.sources[source];
  return src.data + token_offset(src, slot);
}

// Moves to the next tile; returns whether the tile left was its source's last.
__device__ __forceinline__ bool advance(TileCursor& cursor,
                                        const FoldLaunchArgs& args,
                                        int64_t slot, bool live) {
  const SourceLayout& src = args.sources[cursor.source];
  cursor.first += tile_width(src);
  if (cursor.first < num_chunks(src)) {
    return false;
  }
  cursor.source += 1;
  cursor.first = 0;
  cursor.token = token_of(args, cursor.source, slot, live);
  return true;
}

// Starts copying the cursor's tile into `tile` (row r at tile[r * kRowPitch])
// and commits the copies as one group; past the last source, commits an empty
// group so that every iteration commits exactly one. Every lane must call it.
__device__ __forceinline__ void copy_tile_async(const FoldLaunchArgs& args,
                                                const TileCursor& cursor,
                                                ulonglong2* tile) {
  if (cursor.source < args.num_sources) {
    const SourceLayout& src = args.sources[cursor.source];
    const int lane = threadIdx.x % kWarpSize;
    const int64_t chunks = num_chunks(src);
    const int width = tile_width(src);
#pragma unroll
    for (int k = 0; k < kTileChunks; ++k) {
      if (k >= width) {
        break;  // warp-uniform
      }
      const int c = lane + k * kWarpSize;
      const int row = c / width;
      const int col = c % width;
      const auto* row_token = reinterpret_cast<const unsigned char*>(__shfl_sync(
          kFullMask, reinterpret_cast<unsigned long long>(cursor.token), row));
      const int64_t chunk = cursor.first + col;
      if (row_token != nullptr && chunk < chunks) {
        __pipeline_memcpy_async(&tile[row * kRowPitch + col],
                                row_token + chunk_offset(src, chunk * kReadAlign),
                                sizeof(ulonglong2));
      }
    }
  }
  __pipeline_commit();
}

template <typename index_t>
__global__ void __launch_bounds__(kThreadsPerBlock)
    fold_kernel(const __grid_constant__ FoldLaunchArgs args) {
  __shared__ ulonglong2 tiles[kWarpsPerBlock][kStages][kTileSize];
  const int warp = threadIdx.x / kWarpSize;
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

  TileCursor hashing{0, 0, token_of(args, 0, slot, live)};
  TileCursor copying = hashing;
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    copy_tile_async(args, copying, tiles[warp][stage]);
    if (copying.source < args.num_sources) {
      advance(copying, args, slot, live);
    }
  }

  uint64_t acc = live && args.continue_chain ? static_cast<uint64_t>(args.out[i]) : 0;
  uint64_t h = 0;
  for (int stage = 0; hashing.source < args.num_sources; stage = (stage + 1) % kStages) {
    copy_tile_async(args, copying, tiles[warp][(stage + kStages - 1) % kStages]);
    if (copying.source < args.num_sources) {
      advance(copying, args, slot, live);
    }
    __pipeline_wait_prior(kStages - 1);  // this lane's copies of tile `stage` landed
    __syncwarp();                         // and so did the other lanes'
    const SourceLayout& src = args.sources[hashing.source];
    if (hashing.token != nullptr) {
      const ulonglong2* row = &tiles[warp][stage][lane * kRowPitch];
      const int64_t left = num_chunks(src) - hashing.first;
      const int count = left < kTileChunks ? static_cast<int>(left) : tile_width(src);
      for (int col = 0; col < count; ++col) {
        const ulonglong2 v = row[col];
        h = fold_chunk<uint64_t>(h, v.x, v.y);
      }
    }
    __syncwarp();  // the tile is read before its buffer is refilled
    if (advance(hashing, args, slot, live)) {
      acc = splitmix64(acc ^ h);
      h = 0;
    }
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
