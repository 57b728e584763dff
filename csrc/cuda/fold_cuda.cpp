// CUDA backend of kvcanary::fold: argument checks and launches (the kernel is
// in cuda/fold_cuda_kernel.cu).
#include "cuda/fold_cuda.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>

#include "cuda/checks.h"
#include "cuda/stream.h"
#include "libtorch/tensors.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

Tensor fold_cuda(const SourcesArg& sources, const Tensor& slots, bool check_bounds) {
  const FoldPlan plan = make_fold_plan(sources, slots);  // slots on a CUDA device
  const torch::stable::accelerator::DeviceGuard guard(slots.get_device_index());
  const Tensor flat = in_memory_order(slots);
  if (check_bounds) {
    check_slots_in_range(flat, plan.capacity, kCudaSearch);
  }
  check_slots_per_call(flat.numel());
  Tensor out = new_tensor(slots.sizes(), ScalarType::Long, slots.device());
  const cudaStream_t stream = current_stream(slots.get_device_index());
  const int num_sources = static_cast<int>(plan.sources.size());
  if (num_sources == 0) {
    check_cuda(cudaMemsetAsync(out.mutable_data_ptr(), 0, flat.numel() * sizeof(int64_t), stream));
    return out;
  }
  FoldLaunchArgs args{};
  args.capacity = plan.capacity;
  args.slots = flat.const_data_ptr();
  args.slots_are_int32 = flat.scalar_type() == ScalarType::Int;
  args.num_slots = flat.numel();
  args.out = out.mutable_data_ptr<int64_t>();
  for (int first = 0; first < num_sources; first += kSourcesPerLaunch) {
    args.num_sources = std::min(kSourcesPerLaunch, num_sources - first);
    std::copy_n(plan.sources.begin() + first, args.num_sources, args.sources);
    args.continue_chain = first > 0;
    check_cuda(launch_fold(args, stream));
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  m.impl("fold", TORCH_BOX(&fold_op<fold_cuda>));
  m.impl("fold.bound", TORCH_BOX(&fold_bound_op<fold_cuda>));
}

}  // namespace kvcanary
