#include "plan/canary_plan.h"

#include <utility>

#include "plan/checks.h"

namespace kvcanary {
namespace {

// How a per-slot input is checked: its dtype, then what its message calls
// its values and the remedy for another count.
struct PerSlotRule {
  void (*check_dtype)(const Tensor& t, const char* name);
  const char* values;
  const char* remedy;
};

// An optional input of one value per slot, on the slots' device, checked as
// `rule` says. Returns it in memory order (nullopt when not given).
std::optional<Tensor> per_slot_tensor(const std::optional<Tensor>& input, const char* name,
                                      const Tensor& slots, const PerSlotRule& rule) {
  if (!input.has_value()) {
    return std::nullopt;
  }
  const Tensor& t = *input;
  rule.check_dtype(t, name);
  check_on_slots_device(t, slots, kPutOnOneDevice, name);
  KVCANARY_CHECK_VALUE(t.numel() == slots.numel(), name, " has ", t.numel(), " ", rule.values,
                       " (shape ", shape_of(t), ") but slots has ", slots.numel(), " (shape ",
                       shape_of(slots), "); ", rule.remedy);
  return in_memory_order(t);
}

// A per-entry input (positions, tokens, prev_slots): int32/int64.
std::optional<Tensor> entry_tensor(const std::optional<Tensor>& input, const char* name,
                                   const Tensor& slots) {
  return per_slot_tensor(input, name, slots,
                         {&check_index_dtype, "entries", "pass one value per slot"});
}

// The tag input: int64, on the slots' device, one value or one per slot.
std::optional<Tensor> tag_tensor(const std::optional<Tensor>& input, const Tensor& slots) {
  if (!input.has_value()) {
    return std::nullopt;
  }
  const Tensor& t = *input;
  KVCANARY_CHECK_TYPE(t.scalar_type() == ScalarType::Long,
                      "tag must be an int or an int64 tensor, got ", dtype_of(t));
  check_on_slots_device(t, slots, kPutOnOneDevice, "tag");
  KVCANARY_CHECK_VALUE(t.numel() == 1 || t.numel() == slots.numel(), "tag has ", t.numel(),
                       " values (shape ", shape_of(t), ") but slots has ", slots.numel(),
                       "; pass one int, or one value per slot");
  return in_memory_order(t);
}

// The roots input: int64.
std::optional<Tensor> root_tensor(const std::optional<Tensor>& input, const Tensor& slots) {
  const auto check_dtype = [](const Tensor& t, const char*) { check_roots_dtype(t); };
  return per_slot_tensor(input, "roots", slots,
                         {check_dtype, "values", "pass one root per slot, shaped like slots"});
}

void check_table(const Tensor& t, const char* name, const Tensor& slots,
                 std::initializer_list<int64_t> trailing) {
  KVCANARY_CHECK_TYPE(t.scalar_type() == ScalarType::Long, "the canary's ", name,
                      " must be int64, got ", dtype_of(t));
  check_on_slots_device(t, slots, kPutSlotsOnCanaryDevice, "the canary's ", name);
  KVCANARY_CHECK_VALUE(t.is_contiguous() && t.dim() == 1 + static_cast<int64_t>(trailing.size()),
                       "the canary's ", name, " must be a contiguous ", 1 + trailing.size(),
                       "-D tensor, got shape ", shape_of(t));
  int64_t d = 1;
  for (int64_t size : trailing) {
    KVCANARY_CHECK_VALUE(t.size(d) == size, "the canary's ", name, " must have ", size,
                         " columns, got shape ", shape_of(t));
    ++d;
  }
}

const void* data_of(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr() : nullptr;
}

bool is_int32(const std::optional<Tensor>& t) {
  return t.has_value() && t->scalar_type() == ScalarType::Int;
}

EntryPlan make_entry_plan(const CanaryInputs& call) {
  const Tensor& slots = call.slots;
  check_index_dtype(slots, "slots");
  std::optional<Tensor> positions = entry_tensor(call.positions, "positions", slots);
  std::optional<Tensor> tokens = entry_tensor(call.tokens, "tokens", slots);
  std::optional<Tensor> prev_slots = entry_tensor(call.prev_slots, "prev_slots", slots);
  std::optional<Tensor> tags = tag_tensor(call.tags, slots);
  std::optional<Tensor> roots = root_tensor(call.roots, slots);
  EntryPlan plan{{}, {}, in_memory_order(slots), std::move(prev_slots)};
  EntryInputs& in = plan.inputs;
  in.slots = plan.slots.const_data_ptr();
  in.slots_int32 = plan.slots.scalar_type() == ScalarType::Int;
  in.positions = data_of(positions);
  in.positions_int32 = is_int32(positions);
  in.tokens = data_of(tokens);
  in.tokens_int32 = is_int32(tokens);
  in.prev_slots = data_of(plan.prev_slots);
  in.prev_slots_int32 = is_int32(plan.prev_slots);
  in.tags = tags.has_value() ? tags->const_data_ptr<int64_t>() : nullptr;
  in.tags_broadcast = tags.has_value() && tags->numel() == 1;
  in.num_entries = plan.slots.numel();
  in.roots = roots.has_value() ? roots->const_data_ptr<int64_t>() : nullptr;
  for (std::optional<Tensor>* kept : {&positions, &tokens, &tags, &roots}) {
    if (kept->has_value()) plan.keep_alive.push_back(std::move(**kept));
  }
  return plan;
}

}  // namespace

int64_t check_canary_tables(const CanaryTables& tables, const Tensor& slots,
                            int64_t sources_capacity) {
  check_table(tables.records, "records", slots, {kRecordFields});
  const int64_t capacity = tables.records.size(0);
  check_table(tables.owner_tags, "owner tags", slots, {});
  KVCANARY_CHECK_VALUE(tables.owner_tags.size(0) == capacity, "the canary's owner tags hold ",
                       tables.owner_tags.size(0), " slots but its records hold ", capacity);
  check_table(tables.counters, "counters", slots, {});
  KVCANARY_CHECK_VALUE(tables.counters.size(0) == kNumCounters, "the canary's counters must hold ",
                       static_cast<int>(kNumCounters), " values, got ", tables.counters.size(0));
  check_table(tables.ring, "violation ring", slots, {kViolationFields});
  KVCANARY_CHECK_VALUE(tables.ring.size(0) >= 1, "the violation ring needs at least one row");
  KVCANARY_CHECK_VALUE(sources_capacity < 0 || capacity <= sources_capacity, "the canary holds ",
                       capacity, " slots but its sources only ", sources_capacity,
                       "; build the canary over these sources");
  return capacity;
}

CanaryPlan make_canary_plan(const CanaryInputs& in, const CanaryTables& tables) {
  FoldPlan fold = make_fold_plan(in.sources, in.slots);
  const int64_t capacity = check_canary_tables(tables, in.slots, fold.capacity);
  return CanaryPlan{std::move(fold), capacity, make_entry_plan(in)};
}

CanaryPlan make_refold_plan(const SourcesArg& sources, const Tensor& slots, const Tensor& records) {
  FoldPlan fold = make_fold_plan(sources, slots);
  check_table(records, "records", slots, {kRecordFields});
  const int64_t capacity = records.size(0);
  KVCANARY_CHECK_VALUE(fold.capacity < 0 || capacity <= fold.capacity, "the canary holds ",
                       capacity, " slots but its sources only ", fold.capacity,
                       "; build the canary over these sources");
  const std::optional<Tensor> none;
  return CanaryPlan{std::move(fold), capacity,
                    make_entry_plan({sources, slots, none, none, none, none, none})};
}

void check_entries_in_range(const CanaryPlan& plan, const IndexSearch& search) {
  check_entries_in_range(plan.entries.slots, "slots", plan.capacity, search);
  if (plan.entries.prev_slots.has_value()) {
    check_entries_in_range(*plan.entries.prev_slots, "prev_slots", plan.capacity, search);
  }
}

}  // namespace kvcanary
