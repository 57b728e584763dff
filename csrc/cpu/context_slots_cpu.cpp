// CPU kernel of kvcanary::context_slots: checks, then the entries written on
// torch's threads, each taking a span of entries.
#include "cpu/kernels/context_slots_cpu.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <tuple>

#include "libtorch/tensors.h"
#include "plan/checks.h"
#include "plan/context_slots_plan.h"

namespace kvcanary {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> context_slots_cpu(
    const Tensor& block_table, const Tensor& offsets, const Tensor& starts, int64_t block_size,
    int64_t num_entries, int64_t cut_slot, bool check_bounds) {
  ContextSlotsPlan plan =
      make_context_slots_plan(block_table, offsets, starts, block_size, num_entries, cut_slot);
  ContextRanges& c = plan.ranges;
  if (check_bounds) {
    check_context_ranges(c, c.offsets, c.starts);
  }
  ContextSlotsOutputs out = new_context_slots_outputs(c, block_table.device());
  if (num_entries <= kContextSlotsGrain) {
    context_slots_range(c, 0, num_entries);
  } else {
    torch::stable::parallel_for(
        0, num_entries, kContextSlotsGrain,
        [&](int64_t begin, int64_t end) { context_slots_range(c, begin, end); });
  }
  return {out.slots, out.positions, out.prev_slots, out.rows};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("context_slots", TORCH_BOX(&context_slots_cpu));
}

}  // namespace kvcanary
