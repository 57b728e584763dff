// CPU kernel of kvcanary::fold: checks, then the slots folded on torch's
// threads by the instruction-set path this process takes.
#include <torch/csrc/stable/library.h>

#include "cpu/cpu_path.h"
#include "cpu/fold_cpu_entry.h"
#include "cpu/parallel_tasks.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

int64_t task_size(const FoldPlan& plan) {
  int64_t bytes_per_slot = 0;
  for (const SourceLayout& src : plan.sources) bytes_per_slot += src.read_bytes;
  return task_slots(bytes_per_slot);
}

Tensor fold_cpu(const SourcesArg& sources, const Tensor& slots, bool check_bounds) {
  const FoldPlan plan = make_fold_plan(sources, slots);
  const Tensor flat = in_memory_order(slots);
  if (check_bounds) {
    check_slots_in_range(flat, plan.capacity, kHostSearch);
  }
  Tensor out = new_tensor(slots.sizes(), ScalarType::Long, slots.device());
  fold_slots_cpu(plan, flat, out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

void fold_slots_cpu(const FoldPlan& plan, const Tensor& flat_slots, int64_t* out,
                    const FoldSideWork& side) {
  fold_slot_values_cpu(plan, flat_slots.const_data_ptr(),
                       flat_slots.scalar_type() == ScalarType::Int, flat_slots.numel(), out, side);
}

void fold_slot_values_cpu(const FoldPlan& plan, const void* slots, bool slots_int32,
                          int64_t num_slots, int64_t* out, const FoldSideWork& side) {
  const CpuPath& path = cpu_path();
  CpuFoldWork work{};
  work.sources = plan.sources.data();
  work.num_sources = static_cast<int>(plan.sources.size());
  work.capacity = plan.capacity;
  work.slots = slots;
  work.slots_are_int32 = slots_int32;
  work.out = out;
  work.side = side;
  parallel_tasks(num_slots, task_size(plan), [&](const auto& run_my_tasks) {
    run_my_tasks([&](SlotSpan task, SlotSpan next) { path.fold_task(work, task, next); });
  });
}

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("fold", TORCH_BOX(&fold_op<fold_cpu>));
  m.impl("fold.bound", TORCH_BOX(&fold_bound_op<fold_cpu>));
}

}  // namespace kvcanary
