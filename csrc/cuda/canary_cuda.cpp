// CUDA backend of kvcanary::record, kvcanary::verify and kvcanary::refold:
// argument checks and launches (the kernels are in cuda/canary_cuda_kernel.cu).
// One launch per call
// when the sources fit one launch (kSourcesPerLaunch); more sources are
// folded first by the fold's kernel, whose chain the canary kernel continues.
#include "cuda/canary_cuda.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include "cuda/checks.h"
#include "cuda/stream.h"
#include "libtorch/tensors.h"
#include "plan/canary_plan.h"

namespace kvcanary {
namespace {

template <typename Table>
struct CudaCall {
  CanaryPlan plan;
  std::optional<Tensor> partial_folds;  // the fold of the sources before the last group
  CanaryLaunchArgs<Table> args{};
};

// Sets up `fold` for the canary kernel, which folds the last group of
// sources, after folding the groups before it into `partial_folds`.
void fold_leading_groups(const CanaryPlan& plan, const Tensor& slots,
                         std::optional<Tensor>& partial_folds, FoldLaunchArgs& fold,
                         cudaStream_t stream) {
  const std::span<const SourceLayout> sources = plan.fold.sources;
  const int64_t n = plan.entries.inputs.num_entries;
  fold.capacity = plan.fold.capacity;
  fold.slots = plan.entries.inputs.slots;
  fold.slots_are_int32 = plan.entries.inputs.slots_int32;
  fold.num_slots = n;
  const int num_sources = static_cast<int>(sources.size());
  const int last = num_sources <= kSourcesPerLaunch
                       ? 0
                       : (num_sources - 1) / kSourcesPerLaunch * kSourcesPerLaunch;
  if (last > 0) {
    partial_folds = new_tensor({n}, ScalarType::Long, slots.device());
    fold.out = partial_folds->mutable_data_ptr<int64_t>();
    for (int first = 0; first < last; first += kSourcesPerLaunch) {
      fold.num_sources = kSourcesPerLaunch;
      std::copy_n(sources.begin() + first, kSourcesPerLaunch, fold.sources);
      fold.continue_chain = first > 0;
      check_cuda(launch_fold(fold, stream));
    }
  }
  fold.num_sources = num_sources - last;
  std::copy_n(sources.begin() + last, fold.num_sources, fold.sources);
  fold.continue_chain = last > 0;
}

// Checks the entries of a planned call, then folds all but the last group of
// sources; the caller launches the canary kernel, which folds the last group.
template <typename Table>
void prepare(CudaCall<Table>& call, const Tensor& slots, const CanaryTables& tables,
             bool check_bounds, cudaStream_t stream) {
  const int64_t n = call.plan.entries.inputs.num_entries;
  check_slots_per_call(n);
  if (check_bounds) {
    check_entries_in_range(call.plan, kCudaSearch);
  }
  CanaryLaunchArgs<Table>& a = call.args;
  a.inputs = call.plan.entries.inputs;
  point_at_tables(tables, call.plan.capacity, a);
  a.padding_slot = -1;
  fold_leading_groups(call.plan, slots, call.partial_folds, a.fold, stream);
}

void record_cuda(const CanaryInputs& in, const CanaryTables& tables, bool check_bounds) {
  CudaCall<int64_t> call{make_canary_plan(in, tables), std::nullopt, {}};
  // The plan found every tensor on the slots' device, a CUDA one.
  const torch::stable::accelerator::DeviceGuard guard(in.slots.get_device_index());
  const cudaStream_t stream = current_stream(in.slots.get_device_index());
  prepare(call, in.slots, tables, check_bounds, stream);
  check_cuda(launch_record(call.args, stream));
}

Tensor verify_cuda(const CanaryInputs& in, const CanaryTables& tables, int64_t padding_slot,
                   bool check_bounds) {
  CudaCall<const int64_t> call{make_canary_plan(in, tables), std::nullopt, {}};
  const torch::stable::accelerator::DeviceGuard guard(in.slots.get_device_index());
  const cudaStream_t stream = current_stream(in.slots.get_device_index());
  prepare(call, in.slots, tables, check_bounds, stream);
  Tensor flagged = new_tensor(in.slots.sizes(), ScalarType::Bool, in.slots.device());
  call.args.padding_slot = padding_slot;
  call.args.flagged = flagged.mutable_data_ptr<bool>();
  check_cuda(launch_verify(call.args, stream));
  return flagged;
}

// The slots folded with the fold's kernel into a new tensor, one launch per
// kSourcesPerLaunch sources, then each fold written into its record.
void refold_cuda(const SourcesArg& sources, const Tensor& slots, Tensor& records,
                 bool check_bounds) {
  const CanaryPlan plan = make_refold_plan(sources, slots, records);
  const torch::stable::accelerator::DeviceGuard guard(slots.get_device_index());
  const cudaStream_t stream = current_stream(slots.get_device_index());
  const EntryInputs& entries = plan.entries.inputs;
  check_slots_per_call(entries.num_entries);
  if (check_bounds) {
    check_entries_in_range(plan, kCudaSearch);
  }
  Tensor folds = new_tensor({entries.num_entries}, ScalarType::Long, slots.device());
  FoldLaunchArgs fold{};
  fold.capacity = plan.fold.capacity;
  fold.slots = entries.slots;
  fold.slots_are_int32 = entries.slots_int32;
  fold.num_slots = entries.num_entries;
  fold.out = folds.mutable_data_ptr<int64_t>();
  const int num_sources = static_cast<int>(plan.fold.sources.size());
  if (num_sources == 0) {  // the fold of no source is 0
    check_cuda(cudaMemsetAsync(fold.out, 0, entries.num_entries * sizeof(int64_t), stream));
  }
  for (int first = 0; first < num_sources; first += kSourcesPerLaunch) {
    fold.num_sources = std::min(kSourcesPerLaunch, num_sources - first);
    std::copy_n(plan.fold.sources.begin() + first, fold.num_sources, fold.sources);
    fold.continue_chain = first > 0;
    check_cuda(launch_fold(fold, stream));
  }
  check_cuda(launch_refold(entries, folds.const_data_ptr<int64_t>(),
                           records.mutable_data_ptr<int64_t>(), plan.capacity, stream));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  register_canary_ops<record_cuda, verify_cuda, refold_cuda>(m);
}

}  // namespace kvcanary
