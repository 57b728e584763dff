// CPU kernel of kvcanary::fold: checks, the choice of instruction-set path,
// and the split of the slots across torch's threads.
#include "cpu/kernels/fold_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "cpu/fold_cpu_entry.h"
#include "cpu/kernels/fold_cpu_isa.h"
#include "cpu/kernels/fold_cpu_tasks.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

constexpr const char* kIsaVariable = "KVCANARY_CPU_ISA";

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_runs(isa)) {
      return isa;
    }
  }
  return CpuIsa::kScalar;
}

}  // namespace

// The best path this CPU has, or the one KVCANARY_CPU_ISA names (tests force
// each path that way; a path the CPU lacks is refused).
CpuIsa selected_cpu_isa() {
  static const CpuIsa best = best_cpu_isa();
  const char* forced = std::getenv(kIsaVariable);
  if (forced == nullptr || *forced == '\0') {
    return best;
  }
  for (int isa = 0; isa <= static_cast<int>(best); ++isa) {
    if (std::string(forced) == kCpuIsaNames[isa]) {
      return static_cast<CpuIsa>(isa);
    }
  }
  TORCH_CHECK_VALUE(false, "kv-canary: ", kIsaVariable, "=", forced,
                    " is not a path this CPU can run; use one of scalar..",
                    kCpuIsaNames[static_cast<int>(best)], " or unset it");
}

namespace {

void fold_task(CpuIsa isa, const CpuFoldWork& work, SlotSpan task, SlotSpan next) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return fold_task_avx512(work, task, next);
    case CpuIsa::kAvx2:
      return fold_task_avx2(work, task, next);
#endif
    default:
      return fold_task_scalar(work, task, next);
  }
}

int64_t task_size(const FoldPlan& plan) {
  int64_t bytes_per_slot = 0;
  for (const SourceLayout& src : plan.sources) bytes_per_slot += src.read_bytes;
  return task_slots(bytes_per_slot);
}

// Runs fold(task, next) over the tasks of `task` slots that cut [0, n), on
// torch's threads (run_tasks: each thread knows its next task before it folds
// the current one). Threads start with one task each and then claim tasks
// from a shared counter instead of taking an even share up front: the fold
// waits on memory, and on a shared machine an even split makes every call as
// slow as its slowest thread.
template <typename F>
void for_each_task(int64_t n, int64_t task, const F& fold) {
  const int64_t num_tasks = (n + task - 1) / task;
  const int64_t workers = std::min<int64_t>(num_tasks, at::get_num_threads());
  if (workers <= 1) {
    fold(SlotSpan{0, n}, SlotSpan{n, n});
    return;
  }
  std::atomic<int64_t> next{workers};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // Tasks [begin, end) are this thread's to start with (one, unless
    // parallel_for runs inline), then whatever it claims.
    run_tasks(begin, end, next, n, task, fold);
  });
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

std::string cpu_isa() { return kCpuIsaNames[static_cast<int>(selected_cpu_isa())]; }

}  // namespace

void fold_slots_cpu(const FoldPlan& plan, const at::Tensor& flat_slots, int64_t* out) {
  const CpuIsa isa = selected_cpu_isa();
  CpuFoldWork work{};
  work.sources = plan.sources.data();
  work.num_sources = static_cast<int>(plan.sources.size());
  work.capacity = plan.capacity;
  work.slots = flat_slots.const_data_ptr();
  work.slots_are_int32 = flat_slots.scalar_type() == at::kInt;
  work.out = out;
  for_each_task(flat_slots.numel(), task_size(plan),
                [&](SlotSpan task, SlotSpan next) { fold_task(isa, work, task, next); });
}

TORCH_LIBRARY_IMPL(kvcanary, CPU, m) { m.impl("fold", &fold_cpu); }
TORCH_LIBRARY_IMPL(kvcanary, CatchAll, m) { m.impl("cpu_isa", &cpu_isa); }

}  // namespace kvcanary
