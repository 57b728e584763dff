// CPU kernel of kvcanary::fold: checks, then the slots folded on torch's
// threads by the instruction-set path this process takes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu/cpu_path.h"
#include "cpu/fold_cpu_entry.h"
#include "cpu/parallel_tasks.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

int64_t task_size(const FoldPlan& plan) {
  int64_t bytes_per_slot = 0;
  for (const SourceLayout& src : plan.sources) bytes_per_slot += src.read_bytes;
  return task_slots(bytes_per_slot);
}

at::Tensor fold_cpu(at::TensorList sources, const at::Tensor& slots, at::IntArrayRef read_bytes,
                    bool check_bounds) {
  const FoldPlan plan = make_fold_plan(sources, slots, read_bytes);
  const at::Tensor flat = slots.contiguous();
  if (check_bounds) {
    check_slots_in_range(flat, plan.capacity, kHostSearch);
  }
  at::Tensor out = at::empty(slots.sizes(), slots.options().dtype(at::kLong));
  fold_slots_cpu(plan, flat, out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace

void fold_slots_cpu(const FoldPlan& plan, const at::Tensor& flat_slots, int64_t* out,
                    const FoldSideWork& side) {
  const CpuPath& path = cpu_path();
  CpuFoldWork work{};
  work.sources = plan.sources.data();
  work.num_sources = static_cast<int>(plan.sources.size());
  work.capacity = plan.capacity;
  work.slots = flat_slots.const_data_ptr();
  work.slots_are_int32 = flat_slots.scalar_type() == at::kInt;
  work.out = out;
  work.side = side;
  parallel_tasks(flat_slots.numel(), task_size(plan), [&](const auto& run_my_tasks) {
    run_my_tasks([&](SlotSpan task, SlotSpan next) { path.fold_task(work, task, next); });
  });
}

TORCH_LIBRARY_IMPL(kvcanary, CPU, m) { m.impl("fold", &fold_cpu); }

}  // namespace kvcanary
