// CUDA backend of kvcanary::record and kvcanary::verify: argument checks and
// launches (the kernels are in canary_cuda_kernel.cu). One launch per call
// when the sources fit one launch (kSourcesPerLaunch); more sources are
// folded first by the fold's kernel, whose chain the canary kernel continues.
#include "cuda/canary_cuda.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/eager_checks.h"
#include "plan/canary_plan.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

struct CanaryCall {
  FoldPlan fold_plan;
  EntryPlan entries;
  at::Tensor partial_folds;  // the fold of the sources before the last launch's
  CanaryLaunchArgs args{};
};

// Checks everything, then folds all but the last group of sources; the
// caller launches the canary kernel, which folds the last group.
void prepare(CanaryCall& call, at::TensorList sources, at::IntArrayRef read_bytes,
             const at::Tensor& slots, const std::optional<at::Tensor>& positions,
             const std::optional<at::Tensor>& tokens, const std::optional<at::Tensor>& prev_slots,
             const std::optional<at::Tensor>& tags, const at::Tensor& records,
             const at::Tensor& owner_tags, const at::Tensor& counters, const at::Tensor& ring,
             bool check_bounds, cudaStream_t stream) {
  call.fold_plan = make_fold_plan(sources, slots, read_bytes);
  const int64_t capacity =
      check_canary_tables(records, owner_tags, counters, &ring, slots, call.fold_plan.capacity);
  call.entries = make_entry_plan(slots, positions, tokens, prev_slots, tags);
  const int64_t n = call.entries.inputs.num_entries;
  TORCH_CHECK_VALUE(n <= kMaxSlotsPerCall, "kv-canary: at most ", kMaxSlotsPerCall,
                    " slots per call on CUDA, got ", n, "; split the batch");
  if (check_bounds) {
    check_entries_in_range(call.entries, capacity, kCudaSearch);
  }
  CanaryLaunchArgs& a = call.args;
  a.inputs = call.entries.inputs;
  a.records = const_cast<int64_t*>(records.const_data_ptr<int64_t>());
  a.owner_tags = const_cast<int64_t*>(owner_tags.const_data_ptr<int64_t>());
  a.counters = const_cast<int64_t*>(counters.const_data_ptr<int64_t>());
  a.ring = const_cast<int64_t*>(ring.const_data_ptr<int64_t>());
  a.ring_capacity = ring.size(0);
  a.capacity = capacity;
  a.padding_slot = -1;
  FoldLaunchArgs& fold = a.fold;
  fold.capacity = call.fold_plan.capacity;
  fold.slots = a.inputs.slots;
  fold.slots_are_int32 = a.inputs.slots_int32;
  fold.num_slots = n;
  const int num_sources = static_cast<int>(call.fold_plan.sources.size());
  const int last = num_sources <= kSourcesPerLaunch
                       ? 0
                       : (num_sources - 1) / kSourcesPerLaunch * kSourcesPerLaunch;
  if (last > 0) {
    call.partial_folds = at::empty({n}, slots.options().dtype(at::kLong));
    fold.out = call.partial_folds.mutable_data_ptr<int64_t>();
    for (int first = 0; first < last; first += kSourcesPerLaunch) {
      fold.num_sources = kSourcesPerLaunch;
      std::copy_n(call.fold_plan.sources.begin() + first, kSourcesPerLaunch, fold.sources);
      fold.continue_chain = first > 0;
      C10_CUDA_CHECK(launch_fold(fold, stream));
    }
  }
  fold.num_sources = num_sources - last;
  std::copy_n(call.fold_plan.sources.begin() + last, fold.num_sources, fold.sources);
  fold.continue_chain = last > 0;
}

void record_cuda(at::TensorList sources, at::IntArrayRef read_bytes, const at::Tensor& slots,
                 const std::optional<at::Tensor>& positions,
                 const std::optional<at::Tensor>& tokens,
                 const std::optional<at::Tensor>& prev_slots, const std::optional<at::Tensor>& tags,
                 at::Tensor& records, at::Tensor& owner_tags, at::Tensor& counters,
                 at::Tensor& ring, bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  CanaryCall call;
  prepare(call, sources, read_bytes, slots, positions, tokens, prev_slots, tags, records,
          owner_tags, counters, ring, check_bounds, stream);
  C10_CUDA_CHECK(launch_record(call.args, stream));
}

at::Tensor verify_cuda(at::TensorList sources, at::IntArrayRef read_bytes, const at::Tensor& slots,
                       const std::optional<at::Tensor>& positions,
                       const std::optional<at::Tensor>& tokens,
                       const std::optional<at::Tensor>& prev_slots,
                       const std::optional<at::Tensor>& tags, const at::Tensor& records,
                       const at::Tensor& owner_tags, at::Tensor& counters, at::Tensor& ring,
                       int64_t padding_slot, bool check_bounds) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  CanaryCall call;
  prepare(call, sources, read_bytes, slots, positions, tokens, prev_slots, tags, records,
          owner_tags, counters, ring, check_bounds, stream);
  at::Tensor flagged = at::empty(slots.sizes(), slots.options().dtype(at::kBool));
  call.args.padding_slot = padding_slot;
  call.args.flagged = flagged.mutable_data_ptr<bool>();
  C10_CUDA_CHECK(launch_verify(call.args, stream));
  return flagged;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  m.impl("record", &record_cuda);
  m.impl("verify", &verify_cuda);
}

}  // namespace kvcanary
