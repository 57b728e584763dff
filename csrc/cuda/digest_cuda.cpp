// CUDA backend of kvcanary::digest: argument checks and launches (the kernel is
// in cuda/digest_cuda_kernel.cu).
#include "cuda/digest_cuda.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>

#include "cuda/checks.h"
#include "cuda/stream.h"
#include "libtorch/tensors.h"
#include "plan/digest_plan.h"

namespace kvcanary {
namespace {

Tensor digest_cuda(const std::vector<Tensor>& views, const Tensor& slots, const Tensor& positions,
                   const std::optional<Tensor>& groups, const std::vector<int64_t>& unit_offsets,
                   int64_t num_groups, bool check_bounds) {
  const DigestPlan plan =
      make_digest_plan(views, slots, positions, groups, unit_offsets, num_groups);
  // The plan found every tensor on the slots' device, a CUDA one.
  const torch::stable::accelerator::DeviceGuard guard(slots.get_device_index());
  if (check_bounds) {
    check_digest_entries_in_range(plan, kCudaSearch);
  }
  Tensor out = new_tensor({num_groups}, ScalarType::Long, slots.device());
  const cudaStream_t stream = current_stream(slots.get_device_index());
  check_cuda(cudaMemsetAsync(out.mutable_data_ptr(), 0, num_groups * sizeof(int64_t), stream));
  DigestLaunchArgs args{};
  point_at_entries(plan, args);
  args.num_entries = plan.slots.numel();
  args.out = out.mutable_data_ptr<int64_t>();
  const int num_views = static_cast<int>(plan.views.size());
  for (int first = 0; first < num_views; first += kSourcesPerLaunch) {
    args.num_views = std::min(kSourcesPerLaunch, num_views - first);
    std::copy_n(plan.views.begin() + first, args.num_views, args.views);
    args.first_unit[0] = 0;
    for (int j = 0; j < args.num_views; ++j) {
      args.first_unit[j + 1] = args.first_unit[j] + args.views[j].num_units;
    }
    check_cuda(launch_digest(args, stream));
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) { m.impl("digest", TORCH_BOX(&digest_cuda)); }

}  // namespace kvcanary
