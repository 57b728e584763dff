// kvcanary::step_plan: the host's plan of a paged serving step in one call,
// where an engine plugin would otherwise spend tens of small array operations
// per step. Host work on host tensors, whatever device the step runs on, so
// it is registered for every backend and refuses tensors off the CPU itself.
#include "cpu/kernels/step_plan_cpu.h"

#include <torch/csrc/stable/library.h>

#include <tuple>

#include "core/indices.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

// A plan holds at most kMaxPlanValues values (positions and block sizes stay
// below kMaxTokens, core/indices.h).
constexpr int64_t kMaxPlanValues = int64_t{1} << 31;

void check_host_int64(const Tensor& t, const char* name) {
  KVCANARY_CHECK_TYPE(t.scalar_type() == ScalarType::Long, name, " must be an int64 tensor, got ",
                      dtype_of(t));
  KVCANARY_CHECK_VALUE(t.device().type() == DeviceType::CPU, name, " is on ", device_of(t),
                       "; the step's plan is host work: pass CPU tensors (torch.from_numpy)");
}

// Every count of the plan is at most the sum over the rows of computed +
// scheduled + block_size, which is kept below 2**62.
void check_step_values(const StepInputs& in) {
  int64_t total = 0;
  for (int64_t i = 0; i < in.num_rows; ++i) {
    const int64_t computed = in.computed[i];
    const int64_t scheduled = in.scheduled[i];
    KVCANARY_CHECK_VALUE(
        computed >= 0 && computed < kMaxTokens && scheduled >= 0 && scheduled < kMaxTokens, "row ",
        i, " has computed ", computed, " and scheduled ", scheduled,
        "; each must be in [0, 2**48)");
    for (int64_t g = 0; g < in.num_groups; ++g) {
      const int64_t first = in.firsts[g * in.num_rows + i];
      KVCANARY_CHECK_VALUE(first >= 0 && first <= computed, "firsts[", g, ", ", i, "] is ", first,
                           "; a row's first attended position must be in [0, computed] = [0, ",
                           computed, "]");
    }
    total += computed + scheduled + in.block_size;  // each term < 2**50
    KVCANARY_CHECK_VALUE(total < (int64_t{1} << 62), "the rows' tokens add up past 2**62 by row ",
                         i, "; a step's rows hold far fewer");
  }
}

std::tuple<Tensor, Tensor, Tensor> step_plan(const Tensor& computed, const Tensor& scheduled,
                                             const Tensor& firsts, int64_t block_size,
                                             bool blocks_packed) {
  check_host_int64(computed, "computed");
  check_host_int64(scheduled, "scheduled");
  check_host_int64(firsts, "firsts");
  KVCANARY_CHECK_VALUE(computed.dim() == 1, "computed must be 1-D (one value per row), got shape ",
                       shape_of(computed));
  const int64_t rows = computed.numel();
  KVCANARY_CHECK_VALUE(scheduled.dim() == 1 && scheduled.numel() == rows,
                       "scheduled must be 1-D with ", rows, " entries (one per row), got shape ",
                       shape_of(scheduled));
  KVCANARY_CHECK_VALUE(firsts.dim() == 2 && firsts.size(1) == rows, "firsts must be [num_groups, ",
                       rows, "] (one row per KV cache group), got shape ", shape_of(firsts));
  KVCANARY_CHECK_VALUE(block_size >= 1 && block_size < kMaxTokens,
                       "block_size must be in [1, 2**48), got ", block_size);
  const Tensor computed_values = in_memory_order(computed);
  const Tensor scheduled_values = in_memory_order(scheduled);
  const Tensor first_values = in_memory_order(firsts);
  const StepInputs in{computed_values.const_data_ptr<int64_t>(),
                      scheduled_values.const_data_ptr<int64_t>(),
                      first_values.const_data_ptr<int64_t>(),
                      rows,
                      firsts.size(0),
                      block_size,
                      blocks_packed};
  check_step_values(in);

  const StepRanges ranges = step_ranges(in);
  const int64_t num_sets = num_step_sets(in.num_groups);
  const StepLayout layout = step_layout(ranges, rows, num_sets);
  KVCANARY_CHECK_VALUE(layout.size < kMaxPlanValues, "the step's plan would hold ", layout.size,
                       " values; a step schedules at most 2**31 tokens in all");
  const Device cpu(DeviceType::CPU);
  Tensor plan = new_tensor({layout.size}, ScalarType::Long, cpu);
  write_step_plan(ranges, layout, rows, plan.mutable_data_ptr<int64_t>());
  Tensor sets = new_tensor({2, num_sets}, ScalarType::Long, cpu);
  int64_t* set_values = sets.mutable_data_ptr<int64_t>();
  std::copy(layout.bases.begin(), layout.bases.end(), set_values);
  std::copy(layout.counts.begin(), layout.counts.end(), set_values + num_sets);
  Tensor in_batch_order = new_tensor({}, ScalarType::Bool, cpu);
  *in_batch_order.mutable_data_ptr<bool>() = std::is_sorted(in.computed, in.computed + rows);
  return {plan, sets, in_batch_order};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CompositeExplicitAutograd, m) {
  m.impl("step_plan", TORCH_BOX(&step_plan));
}

}  // namespace kvcanary
