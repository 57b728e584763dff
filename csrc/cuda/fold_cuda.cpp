// CUDA backend of kvcanary::fold: argument checks and launches (the kernel is
// in fold_cuda_kernel.cu).
#include "cuda/fold_cuda.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/max.h>
#include <ATen/ops/nonzero.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

// The eager range check: one reduction and a host sync, so it is skipped
// while a CUDA graph is being captured (the kernel then gives 0 for such
// slots, and never reads them).
void check_slots_in_range_cuda(const at::Tensor& slots, int64_t capacity) {
  if (capacity < 0 || slots.numel() == 0 ||
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return;
  }
  if (slots.max().item<int64_t>() < capacity) {
    return;
  }
  const at::Tensor first = at::ge(slots, capacity).nonzero()[0][0];
  fail_slot_out_of_range(slots[first.item<int64_t>()].item<int64_t>(), capacity);
}

at::Tensor fold_cuda(at::TensorList sources, const at::Tensor& slots, at::IntArrayRef read_bytes,
                     bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const FoldPlan plan = make_fold_plan(sources, slots, read_bytes);
  const at::Tensor flat = slots.contiguous().view(-1);
  if (check_bounds) {
    check_slots_in_range_cuda(flat, plan.capacity);
  }
  TORCH_CHECK_VALUE(flat.numel() <= kMaxSlotsPerCall, "kv-canary: at most ", kMaxSlotsPerCall,
                    " slots per call on CUDA, got ", flat.numel(), "; split the batch");
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
