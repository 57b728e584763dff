// CUDA backend of kvcanary::digest: argument checks and launches (the kernel is
// in cuda/digest_cuda_kernel.cu).
#include "cuda/digest_cuda.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/checks.h"
#include "plan/digest_plan.h"

namespace kvcanary {
namespace {

at::Tensor digest_cuda(at::TensorList views, const at::Tensor& slots, const at::Tensor& positions,
                       const std::optional<at::Tensor>& groups, at::IntArrayRef unit_offsets,
                       int64_t num_groups, bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const DigestPlan plan =
      make_digest_plan(views, slots, positions, groups, unit_offsets, num_groups);
  if (check_bounds) {
    check_digest_entries_in_range(plan, kCudaSearch);
  }
  at::Tensor out = at::zeros({num_groups}, slots.options().dtype(at::kLong));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DigestLaunchArgs args{};
  args.capacity = plan.capacity;
  args.slots = plan.slots.const_data_ptr<int64_t>();
  args.positions = plan.positions.const_data_ptr<int64_t>();
  args.groups = plan.groups.defined() ? plan.groups.const_data_ptr<int64_t>() : nullptr;
  args.num_entries = plan.slots.numel();
  args.num_groups = num_groups;
  args.out = out.mutable_data_ptr<int64_t>();
  const int num_views = static_cast<int>(plan.views.size());
  for (int first = 0; first < num_views; first += kSourcesPerLaunch) {
    args.num_views = std::min(kSourcesPerLaunch, num_views - first);
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
