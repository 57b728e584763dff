"""A CUDA fold written the upstream way, as a benchmark baseline: a persistent grid of
64 blocks of 512 threads, one thread per slot, each thread looping 16-byte loads over
its own row. Compiled at run time with nvcc (torch.utils.cpp_extension.load_inline).
Row sources only (page_size 1, contiguous rows)."""

from __future__ import annotations

import functools

_CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

namespace {
constexpr int kMaxSources = 8;
struct Rows { const unsigned char* data[kMaxSources]; long long stride[kMaxSources]; int count; long long read_bytes; };

__device__ unsigned long long mix(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void __launch_bounds__(512) upstream_fold(Rows rows, const long long* slots, long long n, long long* out) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long slot = slots[i];
    unsigned long long acc = 0;
    if (slot >= 0) {
      for (int s = 0; s < rows.count; ++s) {
        const unsigned char* row = rows.data[s] + slot * rows.stride[s];
        unsigned long long h = 0;
        for (long long b = 0; b < rows.read_bytes; b += 16) {
          const ulonglong2 v = *reinterpret_cast<const ulonglong2*>(row + b);
          h = mix(h ^ v.x);
          h = mix(h ^ v.y);
        }
        acc = mix(acc ^ h);
      }
    }
    out[i] = slot >= 0 ? (long long)acc : 0;
  }
}
}  // namespace

torch::Tensor upstream_fold_cuda(std::vector<torch::Tensor> pools, torch::Tensor slots, int64_t read_bytes) {
  TORCH_CHECK(pools.size() <= kMaxSources);
  Rows rows{};
  rows.count = (int)pools.size();
  rows.read_bytes = read_bytes;
  for (size_t i = 0; i < pools.size(); ++i) {
    rows.data[i] = pools[i].data_ptr<unsigned char>();
    rows.stride[i] = pools[i].stride(0);
  }
  auto out = torch::empty_like(slots);
  upstream_fold<<<64, 512, 0, c10::cuda::getCurrentCUDAStream()>>>(rows, slots.data_ptr<int64_t>(), slots.numel(), out.data_ptr<int64_t>());
  return out;
}
"""


@functools.cache
def load_upstream_fold():
    """The baseline as a callable (pools, slots, read_bytes) -> int64 fingerprints."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(
        name="kvcanary_upstream_baseline",
        cpp_sources="torch::Tensor upstream_fold_cuda(std::vector<torch::Tensor> pools, torch::Tensor slots, int64_t read_bytes);",
        cuda_sources=_CUDA_SOURCE,
        functions=["upstream_fold_cuda"],
        extra_cuda_cflags=["-O3"],
    )
    return lambda pools, slots, read_bytes: module.upstream_fold_cuda(list(pools), slots, read_bytes)
