#include "plan/canary_plan.h"

#include <c10/util/Exception.h>

#include "plan/checks.h"

namespace kvcanary {
namespace {

// A tensor whose entries are read in memory order (its shape is not needed):
// itself when contiguous, which spares a new tensor per input and call.
at::Tensor in_memory_order(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// An optional per-entry input: int32/int64, on the slots' device, one value
// per slot. Returns it in memory order (undefined when not given).
at::Tensor entry_tensor(const std::optional<at::Tensor>& input, const char* name,
                        const at::Tensor& slots) {
  if (!input.has_value()) {
    return at::Tensor();
  }
  const at::Tensor& t = *input;
  check_index_dtype(t, name);
  check_on_slots_device(t, slots, kPutOnOneDevice, name);
  TORCH_CHECK_VALUE(t.numel() == slots.numel(), "kv-canary: ", name, " has ", t.numel(),
                    " entries (shape ", t.sizes(), ") but slots has ", slots.numel(), " (shape ",
                    slots.sizes(), "); pass one value per slot");
  return in_memory_order(t);
}

void check_table(const at::Tensor& t, const char* name, const at::Tensor& slots,
                 std::initializer_list<int64_t> trailing) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "kv-canary: the canary's ", name,
                   " must be int64, got ", t.scalar_type());
  check_on_slots_device(t, slots, kPutSlotsOnCanaryDevice, "the canary's ", name);
  TORCH_CHECK_VALUE(t.is_contiguous() && t.dim() == 1 + static_cast<int64_t>(trailing.size()),
                    "kv-canary: the canary's ", name, " must be a contiguous ", 1 + trailing.size(),
                    "-D tensor, got shape ", t.sizes());
  int64_t d = 1;
  for (int64_t size : trailing) {
    TORCH_CHECK_VALUE(t.size(d) == size, "kv-canary: the canary's ", name, " must have ", size,
                      " columns, got shape ", t.sizes());
    ++d;
  }
}

EntryPlan make_entry_plan(const CanaryInputs& call) {
  const at::Tensor& slots = call.slots;
  check_index_dtype(slots, "slots");
  EntryPlan plan;
  plan.slots = in_memory_order(slots);
  const at::Tensor flat_positions = entry_tensor(call.positions, "positions", slots);
  const at::Tensor flat_tokens = entry_tensor(call.tokens, "tokens", slots);
  plan.prev_slots = entry_tensor(call.prev_slots, "prev_slots", slots);
  at::Tensor flat_tags;
  if (call.tags.has_value()) {
    const at::Tensor& t = *call.tags;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong,
                     "kv-canary: tag must be an int or an int64 tensor, got ", t.scalar_type());
    check_on_slots_device(t, slots, kPutOnOneDevice, "tag");
    TORCH_CHECK_VALUE(t.numel() == 1 || t.numel() == slots.numel(), "kv-canary: tag has ",
                      t.numel(), " values (shape ", t.sizes(), ") but slots has ", slots.numel(),
                      "; pass one int, or one value per slot");
    flat_tags = in_memory_order(t);
  }
  const auto data = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; };
  const auto int32 = [](const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kInt; };
  EntryInputs& in = plan.inputs;
  in.slots = plan.slots.const_data_ptr();
  in.slots_int32 = int32(plan.slots);
  in.positions = data(flat_positions);
  in.positions_int32 = int32(flat_positions);
  in.tokens = data(flat_tokens);
  in.tokens_int32 = int32(flat_tokens);
  in.prev_slots = data(plan.prev_slots);
  in.prev_slots_int32 = int32(plan.prev_slots);
  in.tags = flat_tags.defined() ? flat_tags.const_data_ptr<int64_t>() : nullptr;
  in.tags_broadcast = flat_tags.defined() && flat_tags.numel() == 1;
  in.num_entries = plan.slots.numel();
  plan.keep_alive = {flat_positions, flat_tokens, flat_tags};
  return plan;
}

// Checks the canary's tables and that the sources hold every slot of the
// canary; returns its capacity.
int64_t check_tables(const CanaryTables& tables, const at::Tensor& slots,
                     int64_t sources_capacity) {
  check_table(tables.records, "records", slots, {kRecordFields});
  const int64_t capacity = tables.records.size(0);
  check_table(tables.owner_tags, "owner tags", slots, {});
  TORCH_CHECK_VALUE(tables.owner_tags.size(0) == capacity,
                    "kv-canary: the canary's owner tags hold ", tables.owner_tags.size(0),
                    " slots but its records hold ", capacity);
  check_table(tables.counters, "counters", slots, {});
  TORCH_CHECK_VALUE(tables.counters.size(0) == kNumCounters,
                    "kv-canary: the canary's counters must hold ", static_cast<int>(kNumCounters),
                    " values, got ", tables.counters.size(0));
  check_table(tables.ring, "violation ring", slots, {kViolationFields});
  TORCH_CHECK_VALUE(tables.ring.size(0) >= 1,
                    "kv-canary: the violation ring needs at least one row");
  TORCH_CHECK_VALUE(sources_capacity < 0 || capacity <= sources_capacity,
                    "kv-canary: the canary holds ", capacity, " slots but its sources only ",
                    sources_capacity, "; build the canary over these sources");
  return capacity;
}

}  // namespace

CanaryPlan make_canary_plan(const CanaryInputs& in, const CanaryTables& tables) {
  CanaryPlan plan;
  plan.fold = make_fold_plan(in.sources, in.slots, in.read_bytes);
  plan.capacity = check_tables(tables, in.slots, plan.fold.capacity);
  plan.entries = make_entry_plan(in);
  return plan;
}

void check_entries_in_range(const CanaryPlan& plan, const IndexSearch& search) {
  check_entries_in_range(plan.entries.slots, "slots", plan.capacity, search);
  if (plan.entries.prev_slots.defined()) {
    check_entries_in_range(plan.entries.prev_slots, "prev_slots", plan.capacity, search);
  }
}

}  // namespace kvcanary
