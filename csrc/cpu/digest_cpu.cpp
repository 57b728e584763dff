// CPU kernel of kvcanary::digest: checks, then the entries digested on
// torch's threads by the instruction-set path this process takes. Each thread
// adds its terms into sums of its own; the wrapping sums are then added
// together, so the result does not depend on the split or the order.
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "cpu/cpu_path.h"
#include "cpu/parallel_tasks.h"
#include "libtorch/tensors.h"
#include "plan/digest_plan.h"

namespace kvcanary {
namespace {

// Entries per task: about kTaskReadBytes of reads, as the fold's tasks, and never
// fewer than a batch of entries, whose terms fill the lanes.
int64_t task_entries(const DigestPlan& plan) {
  int64_t bytes_per_entry = 0;
  for (const DigestView& view : plan.views)
    bytes_per_entry += view.num_units * view.unit.read_bytes;
  return std::max<int64_t>(kDigestBatchEntries, kTaskReadBytes / (bytes_per_entry + 1));
}

Tensor digest_cpu(const std::vector<Tensor>& views, const Tensor& slots, const Tensor& positions,
                  const std::optional<Tensor>& groups, const std::vector<int64_t>& unit_offsets,
                  int64_t num_groups, bool check_bounds) {
  const DigestPlan plan =
      make_digest_plan(views, slots, positions, groups, unit_offsets, num_groups);
  if (check_bounds) {
    check_digest_entries_in_range(plan, kHostSearch);
  }
  const int64_t n = plan.slots.numel();
  Tensor out = new_tensor({num_groups}, ScalarType::Long, slots.device());
  auto* total = reinterpret_cast<uint64_t*>(out.mutable_data_ptr<int64_t>());
  std::fill_n(total, num_groups, 0);
  if (plan.views.empty() || n == 0) {
    return out;
  }
  CpuDigestRange range{};
  range.views = plan.views.data();
  range.num_views = static_cast<int>(plan.views.size());
  point_at_entries(plan, range);

  const CpuPath& path = cpu_path();
  std::mutex merge;
  parallel_tasks(n, task_entries(plan), [&](const auto& run_my_tasks) {
    std::vector<uint64_t> sums(static_cast<size_t>(num_groups), 0);
    CpuDigestRange mine = range;
    mine.sums = sums.data();
    run_my_tasks([&](SlotSpan entries, SlotSpan next) {
      mine.begin = entries.begin;
      mine.end = entries.end;
      mine.next_begin = next.begin;
      mine.next_end = next.end;
      path.digest_range(mine);
    });
    const std::lock_guard<std::mutex> lock(merge);
    for (int64_t g = 0; g < num_groups; ++g) total[g] += sums[g];
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) { m.impl("digest", TORCH_BOX(&digest_cpu)); }

}  // namespace kvcanary
