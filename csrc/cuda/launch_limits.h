// How many layouts one CUDA launch takes: a fold's (and the canary's) sources,
// a digest's views. They travel by value in the kernel's arguments (no device
// table, so no host-to-device copy that CUDA-graph capture would have to
// replay), within the kernel parameter limit (kMaxLaunchArgBytes).
// More than this are taken by further launches: the fold continues the chain
// of the earlier ones, the digest adds to the same sums.
#pragma once

namespace kvcanary {

constexpr int kSourcesPerLaunch = 16;

// The kernel parameter limit every CUDA version allows.
constexpr unsigned kMaxLaunchArgBytes = 4096;

// The limit of CUDA 12.1 and later on Volta and later GPUs (the library builds
// for Ampere on, and links a CUDA 12.1 or later runtime): the engine step's
// fold takes a whole model's sources in one launch with it, so that the
// step's launches do not grow with the layers.
constexpr unsigned kMaxWideLaunchArgBytes = 32764;

}  // namespace kvcanary
