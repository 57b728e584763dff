#include "cuda/checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/any.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/max.h>
#include <ATen/ops/nonzero.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

#include "cuda/fold_cuda.h"

namespace kvcanary {
namespace {

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The value of `values` at the first entry where the flat bool `flags` is
// true (one host sync per step; the caller knows one is).
int64_t value_at_first(const at::Tensor& values, const at::Tensor& flags) {
  return values[flags.nonzero()[0][0].item<int64_t>()].item<int64_t>();
}

std::optional<int64_t> first_at_least_cuda(const at::Tensor& index, int64_t limit) {
  if (index.numel() == 0 || capturing() || index.max().item<int64_t>() < limit) {
    return std::nullopt;
  }
  const at::Tensor flat = index.reshape(-1);
  return value_at_first(flat, at::ge(flat, limit));
}

std::optional<int64_t> first_bad_group_cuda(const at::Tensor& slots, const at::Tensor& groups,
                                            int64_t num_groups) {
  if (slots.numel() == 0 || capturing()) {
    return std::nullopt;
  }
  const at::Tensor bad = slots.ge(0).logical_and(groups.lt(0).logical_or(groups.ge(num_groups)));
  if (!bad.any().item<bool>()) {
    return std::nullopt;
  }
  return value_at_first(groups, bad);
}

}  // namespace

const IndexSearch kCudaSearch{first_at_least_cuda, first_bad_group_cuda};

void check_slots_per_call(int64_t num_slots) {
  TORCH_CHECK_VALUE(num_slots <= kMaxSlotsPerCall, "kv-canary: at most ", kMaxSlotsPerCall,
                    " slots per call on CUDA, got ", num_slots, "; split the batch");
}

}  // namespace kvcanary
