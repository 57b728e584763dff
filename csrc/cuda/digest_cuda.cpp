// CUDA backend of kvcanary::digest: argument checks and launches (the kernel is
// in digest_cuda_kernel.cu).
#include "cuda/digest_cuda.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/any.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/max.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "plan/digest_plan.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

// The eager checks of slots, then groups (the CPU kernel's order): reductions
// and host syncs, so they are skipped while a CUDA graph is being captured
// (the kernel then leaves such entries out, and never reads them).
void check_entries_cuda(const at::Tensor& slots, const at::Tensor& groups, int64_t capacity,
                        int64_t num_groups) {
  if (slots.numel() == 0 ||
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return;
  }
  // With no views (capacity -1) no slot reads anything.
  if (capacity >= 0 && slots.max().item<int64_t>() >= capacity) {
    const int64_t first = slots.ge(capacity).nonzero()[0][0].item<int64_t>();
    fail_slot_out_of_range(slots[first].item<int64_t>(), capacity);
  }
  if (!groups.defined()) {
    return;
  }
  const at::Tensor bad = slots.ge(0).logical_and(groups.lt(0).logical_or(groups.ge(num_groups)));
  if (bad.any().item<bool>()) {
    const int64_t first = bad.nonzero()[0][0].item<int64_t>();
    fail_group_out_of_range(groups[first].item<int64_t>(), num_groups);
  }
}

at::Tensor as_flat_long(const at::Tensor& t) { return t.reshape(-1).to(at::kLong).contiguous(); }

at::Tensor digest_cuda(at::TensorList views, const at::Tensor& slots, const at::Tensor& positions,
                       const std::optional<at::Tensor>& groups, at::IntArrayRef unit_offsets,
                       int64_t num_groups, bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const DigestPlan plan =
      make_digest_plan(views, slots, positions, groups, unit_offsets, num_groups);
  const at::Tensor flat_slots = as_flat_long(slots);
  const at::Tensor flat_positions = as_flat_long(positions);
  const at::Tensor flat_groups = groups.has_value() ? as_flat_long(*groups) : at::Tensor();
  if (check_bounds) {
    check_entries_cuda(flat_slots, flat_groups, plan.capacity, num_groups);
  }
  at::Tensor out = at::zeros({num_groups}, slots.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DigestLaunchArgs args{};
  args.capacity = plan.capacity;
  args.slots = flat_slots.const_data_ptr<int64_t>();
  args.positions = flat_positions.const_data_ptr<int64_t>();
  args.groups = groups.has_value() ? flat_groups.const_data_ptr<int64_t>() : nullptr;
  args.num_entries = flat_slots.numel();
  args.num_groups = num_groups;
  args.out = out.mutable_data_ptr<int64_t>();
  const int num_views = static_cast<int>(plan.views.size());
  for (int first = 0; first < num_views; first += kDigestViewsPerLaunch) {
    args.num_views = std::min(kDigestViewsPerLaunch, num_views - first);
    std::copy_n(plan.views.begin() + first, args.num_views, args.views);
    args.first_unit[0] = 0;
    for (int j = 0; j < args.num_views; ++j) {
      args.first_unit[j + 1] = args.first_unit[j] + args.views[j].num_units;
    }
    C10_CUDA_CHECK(launch_digest(args, stream));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) { m.impl("digest", &digest_cuda); }

}  // namespace kvcanary
