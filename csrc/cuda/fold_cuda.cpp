// CUDA backend of kvcanary::fold: argument checks and launches (the kernel is
// in cuda/fold_cuda_kernel.cu).
#include "cuda/fold_cuda.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/checks.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

at::Tensor fold_cuda(at::TensorList sources, const at::Tensor& slots, at::IntArrayRef read_bytes,
                     bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const FoldPlan plan = make_fold_plan(sources, slots, read_bytes);
  const at::Tensor flat = slots.contiguous().view(-1);
  if (check_bounds) {
    check_slots_in_range(flat, plan.capacity, kCudaSearch);
  }
  check_slots_per_call(flat.numel());
  at::Tensor out = at::empty(slots.sizes(), slots.options().dtype(at::kLong));
  const int num_sources = static_cast<int>(plan.sources.size());
  if (num_sources == 0) {
    return out.zero_();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  FoldLaunchArgs args{};
  args.capacity = plan.capacity;
  args.slots = flat.const_data_ptr();
  args.slots_are_int32 = flat.scalar_type() == at::kInt;
  args.num_slots = flat.numel();
  args.out = out.mutable_data_ptr<int64_t>();
  for (int first = 0; first < num_sources; first += kSourcesPerLaunch) {
    args.num_sources = std::min(kSourcesPerLaunch, num_sources - first);
    std::copy_n(plan.sources.begin() + first, args.num_sources, args.sources);
    args.continue_chain = first > 0;
    C10_CUDA_CHECK(launch_fold(args, stream));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) { m.impl("fold", &fold_cuda); }

}  // namespace kvcanary
