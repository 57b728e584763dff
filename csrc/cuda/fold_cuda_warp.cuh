// The warp-cooperative fold of one slot per lane, shared by the CUDA kernels
// of fold, record and verify (device code only; included by .cu files).
//
// A warp folds 32 slots, one per lane. Each source's rows are read in tiles
// of up to 8 chunks (128 bytes) per slot: the warp loads a tile
// cooperatively, consecutive lanes taking consecutive 16-byte chunks of the
// same row (coalesced), stages it in shared memory, and then each lane runs
// the serial splitmix64 chain over its own row. What keeps the memory busy is
// the loads in flight: a lane issues all loads of a tile (into registers)
// before it uses any, since with one load in flight per lane the kernel is
// bound by memory parallelism rather than bandwidth.
#pragma once

#include "cuda/fold_cuda.h"
#include "cuda/launch_shape.h"

namespace kvcanary {
namespace {

constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
constexpr int kTileChunks = 8;
// Row pitch of the staging tile, in chunks: one spare chunk per row puts the
// eight lanes of each shared-memory phase on distinct banks.
constexpr int kRowPitch = kTileChunks + 1;

using Tile = ulonglong2[kTileChunks];  // one lane's share of a tile's loads

__device__ __forceinline__ int64_t num_chunks(const SourceLayout& src) {
  return src.read_bytes / kReadAlign;
}

// Chunks per row in a tile: kTileChunks, or the largest power of two the row
// has (so that a lane's row and column in the tile are a shift and a mask).
__device__ __forceinline__ int tile_width(const SourceLayout& src) {
  const int64_t chunks = num_chunks(src);
  if (chunks >= kTileChunks) {
    return kTileChunks;
  }
  return chunks >= 4 ? 4 : (chunks >= 2 ? 2 : 1);
}

// Issues this lane's loads of the tile of `src` starting at chunk `first`
// (`width` = tile_width(src)): load k is chunk c % width of row c / width,
// c = lane + 32 k, where row r is lane r's `token` (null: nothing to read).
// Every lane must call it.
__device__ __forceinline__ void load_tile(const SourceLayout& src, int width,
                                          const unsigned char* token, int64_t first, Tile& regs) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t chunks = num_chunks(src);
  const int shift = __ffs(width) - 1;
#pragma unroll
  for (int k = 0; k < kTileChunks; ++k) {
    if (k >= width) {
      break;  // warp-uniform
    }
    const int c = lane + k * kWarpSize;
    const auto* row_token = reinterpret_cast<const unsigned char*>(
        __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(token), c >> shift));
    const int64_t chunk = first + (c & (width - 1));
    regs[k] = make_ulonglong2(0, 0);
    if (row_token != nullptr && chunk < chunks) {
      regs[k] = __ldg(
          reinterpret_cast<const ulonglong2*>(row_token + chunk_offset(src, chunk * kReadAlign)));
    }
  }
}

// Stores the loads of load_tile into the staging tile (row r at r * kRowPitch).
__device__ __forceinline__ void stage_tile(int width, const Tile& regs, ulonglong2* tile) {
  const int lane = threadIdx.x % kWarpSize;
  const int shift = __ffs(width) - 1;
#pragma unroll
  for (int k = 0; k < kTileChunks; ++k) {
    if (k >= width) {
      break;
    }
    const int c = lane + k * kWarpSize;
    tile[(c >> shift) * kRowPitch + (c & (width - 1))] = regs[k];
  }
}

// The fold of `slot` over sources[0, num_sources), continuing the chain from
// `acc` (0 for a fresh fold). `tile` is this warp's staging tile, [kWarpSize *
// kRowPitch]. Every lane of the warp must call it; lanes whose slot is not
// live (padding, out of range, past the batch) read nothing and return acc.
__device__ __forceinline__ uint64_t fold_lane_slot(const SourceLayout* sources, int num_sources,
                                                   int64_t slot, bool live, ulonglong2* tile,
                                                   uint64_t acc) {
  const int lane = threadIdx.x % kWarpSize;
  for (int s = 0; s < num_sources; ++s) {
    const SourceLayout& src = sources[s];
    const unsigned char* token = live ? src.data + token_offset(src, slot) : nullptr;
    const int64_t chunks = num_chunks(src);
    const int width = tile_width(src);
    uint64_t h = 0;
    for (int64_t first = 0; first < chunks; first += width) {
      Tile regs;
      load_tile(src, width, token, first, regs);
      stage_tile(width, regs, tile);
      __syncwarp();
      if (token != nullptr) {
        const ulonglong2* row = &tile[lane * kRowPitch];
        const int count = chunks - first < width ? static_cast<int>(chunks - first) : width;
        for (int col = 0; col < count; ++col) {
          const ulonglong2 v = row[col];
          h = fold_chunk<uint64_t>(h, v.x, v.y);
        }
      }
      __syncwarp();  // the tile is read before it is staged again
    }
    if (live) {
      acc = splitmix64(acc ^ h);
    }
  }
  return acc;
}

}  // namespace
}  // namespace kvcanary
