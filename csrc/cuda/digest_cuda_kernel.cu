// CUDA kernel of kvcanary::digest. Kept free of torch headers, like the fold's
// kernel; argument checks live in cuda/digest_cuda.cpp.
//
// One thread per (entry, unit) term, in a grid-stride loop: consecutive
// threads take consecutive units of an entry, so a warp reads neighbouring
// units (a token's heads) together. A thread folds its unit with 128-bit loads
// when the view allows (aligned_chunks), issuing kChunksInFlight loads before
// hashing any; otherwise word by word in the widest aligned pieces. Terms are
// summed in registers while a thread's group stays the same, then each warp
// adds its sums with one atomicAdd when all its lanes hold the same group
// (unsigned 64-bit atomicAdd wraps, as the digest's sum does), or lane by lane.
#include "cuda/digest_cuda.h"
#include "cuda/launch_shape.h"

namespace kvcanary {
namespace {

constexpr int kDigestThreads = 256;
constexpr int64_t kMaxDigestBlocks = 8192;
constexpr int kChunksInFlight = 8;

__device__ __forceinline__ uint64_t fold_unit(const DigestView& view, const unsigned char* unit) {
  uint64_t h = 0;
  int64_t word = 0;
  if (view.aligned_chunks) {
    const int64_t chunks = view.unit.read_bytes / kReadAlign;
    for (int64_t first = 0; first < chunks; first += kChunksInFlight) {
      ulonglong2 regs[kChunksInFlight];
#pragma unroll
      for (int c = 0; c < kChunksInFlight; ++c) {
        if (first + c < chunks) {
          regs[c] = __ldg(reinterpret_cast<const ulonglong2*>(
              unit + chunk_offset(view.unit, (first + c) * kReadAlign)));
        }
      }
#pragma unroll
      for (int c = 0; c < kChunksInFlight; ++c) {
        if (first + c < chunks) {
          h = fold_chunk<uint64_t>(h, regs[c].x, regs[c].y);
        }
      }
    }
    word = chunks * 2;
  }
  for (const int64_t words = unit_words(view); word < words; ++word) {
    h = splitmix64(h ^ unit_word(view, unit, word));
  }
  return h;
}

__device__ __forceinline__ void add_to(int64_t* out, int64_t group, uint64_t value) {
  atomicAdd(reinterpret_cast<unsigned long long*>(out + group),
            static_cast<unsigned long long>(value));
}

__global__ void __launch_bounds__(kDigestThreads) digest_kernel(const DigestLaunchArgs args) {
  const int64_t units_per_entry = args.first_unit[args.num_views];
  const int64_t num_terms = args.num_entries * units_per_entry;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kDigestThreads;
  long long group = -1;  // the group `sum` belongs to (-1: none yet)
  unsigned long long sum = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kDigestThreads + threadIdx.x; t < num_terms;
       t += stride) {
    const int64_t entry = t / units_per_entry;
    const int64_t unit = t - entry * units_per_entry;
    const int64_t slot = args.slots[entry];
    const int64_t g = args.groups != nullptr ? args.groups[entry] : 0;
    // Padding, out-of-range slots and groups read nothing and add nothing.
    if (slot < 0 || slot >= args.capacity || g < 0 || g >= args.num_groups) {
      continue;
    }
    int j = 0;
    while (unit >= args.first_unit[j + 1]) {
      ++j;
    }
    const DigestView& view = args.views[j];
    const int64_t k = unit - args.first_unit[j];
    const uint64_t h = fold_unit(view, unit_address(view, slot, k));
    if (g != group) {
      if (group >= 0) {
        add_to(args.out, group, sum);
      }
      group = g;
      sum = 0;
    }
    sum += mix3<uint64_t>(view.first_unit_id + static_cast<uint64_t>(k),
                          static_cast<uint64_t>(args.positions[entry]), h);
  }
  // Every thread of the warp gets here (blocks are whole warps).
  const long long lead = __shfl_sync(kFullMask, group, 0);
  if (__all_sync(kFullMask, group == lead)) {
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_down_sync(kFullMask, sum, offset);
    }
    if (threadIdx.x % 32 == 0 && lead >= 0) {
      add_to(args.out, lead, sum);
    }
  } else if (group >= 0) {
    add_to(args.out, group, sum);
  }
}

}  // namespace

cudaError_t launch_digest(const DigestLaunchArgs& args, cudaStream_t stream) {
  const int64_t num_terms = args.num_entries * args.first_unit[args.num_views];
  if (num_terms == 0) {
    return cudaSuccess;
  }
  digest_kernel<<<grid_blocks(num_terms, kDigestThreads, kMaxDigestBlocks), kDigestThreads, 0,
                  stream>>>(args);
  return cudaGetLastError();
}

}  // namespace kvcanary
