// The shape of the CUDA launches, for every kernel: a warp's size and full
// mask, and the 1-D grid that gives each of n items a thread. Plain C++, so
// that the launchers (*.cpp) and the kernels (*.cu) share it.
#pragma once

#include <cstdint>

namespace kvcanary {

constexpr int kWarpSize = 32;

// Every lane of a warp, for the *_sync intrinsics.
constexpr unsigned kFullMask = 0xffffffffu;

// The most blocks of a 1-D grid.
constexpr int64_t kMaxGridBlocks = (int64_t{1} << 31) - 1;

// The blocks of `threads` threads that give each of n items a thread, at
// least one and at most max_blocks (a grid-stride loop takes the items past
// them).
inline unsigned int grid_blocks(int64_t n, int threads, int64_t max_blocks = kMaxGridBlocks) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks < max_blocks ? blocks : max_blocks));
}

}  // namespace kvcanary
