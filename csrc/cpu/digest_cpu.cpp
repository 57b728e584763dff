// CPU kernel of kvcanary::digest: checks, the instruction-set path (the
// fold's choice), and the split of the entries across torch's threads. Each
// thread adds its terms into sums of its own; the wrapping sums are then added
// together, so the result does not depend on the split or the order.
#include "cpu/kernels/digest_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "cpu/kernels/fold_cpu.h"
#include "cpu/kernels/fold_cpu_isa.h"
#include "cpu/kernels/fold_cpu_tasks.h"
#include "plan/digest_plan.h"

namespace kvcanary {
namespace {

void digest_range(CpuIsa isa, const CpuDigestRange& range) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return digest_range_avx512(range);
    case CpuIsa::kAvx2:
      return digest_range_avx2(range);
#endif
    default:
      return digest_range_scalar(range);
  }
}

// Entries per task: about 256 KiB of reads, as the fold's tasks, and never
// fewer than a batch of entries, whose terms fill the lanes.
int64_t task_entries(const DigestPlan& plan) {
  int64_t bytes_per_entry = 0;
  for (const DigestView& view : plan.views)
    bytes_per_entry += view.num_units * view.unit.read_bytes;
  return std::max<int64_t>(kDigestBatchEntries, (int64_t{1} << 18) / (bytes_per_entry + 1));
}

at::Tensor digest_cpu(at::TensorList views, const at::Tensor& slots, const at::Tensor& positions,
                      const std::optional<at::Tensor>& groups, at::IntArrayRef unit_offsets,
                      int64_t num_groups, bool check_bounds) {
  const DigestPlan plan =
      make_digest_plan(views, slots, positions, groups, unit_offsets, num_groups);
  if (check_bounds) {
    check_digest_entries_in_range(plan, kHostSearch);
  }
  const int64_t n = plan.slots.numel();
  at::Tensor out = at::zeros({num_groups}, slots.options().dtype(at::kLong));
  if (plan.views.empty() || n == 0) {
    return out;
  }
  CpuDigestRange range{};
  range.views = plan.views.data();
  range.num_views = static_cast<int>(plan.views.size());
  range.capacity = plan.capacity;
  range.slots = plan.slots.const_data_ptr<int64_t>();
  range.positions = plan.positions.const_data_ptr<int64_t>();
  range.groups = plan.groups.defined() ? plan.groups.const_data_ptr<int64_t>() : nullptr;
  range.num_groups = num_groups;

  const CpuIsa isa = selected_cpu_isa();
  auto* total = reinterpret_cast<uint64_t*>(out.mutable_data_ptr<int64_t>());
  const int64_t task = task_entries(plan);
  const int64_t num_tasks = (n + task - 1) / task;
  const int64_t workers = std::min<int64_t>(num_tasks, at::get_num_threads());
  std::atomic<int64_t> next{workers};
  std::mutex merge;
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> sums(static_cast<size_t>(num_groups), 0);
    CpuDigestRange mine = range;
    mine.sums = sums.data();
    run_tasks(begin, end, next, n, task, [&](SlotSpan entries, SlotSpan) {
      mine.begin = entries.begin;
      mine.end = entries.end;
      digest_range(isa, mine);
    });
    const std::lock_guard<std::mutex> lock(merge);
    for (int64_t g = 0; g < num_groups; ++g) total[g] += sums[g];
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CPU, m) { m.impl("digest", &digest_cpu); }

}  // namespace kvcanary
