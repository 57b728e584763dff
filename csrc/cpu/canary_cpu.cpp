// CPU kernels of kvcanary::record, kvcanary::verify, kvcanary::refold and
// kvcanary::verify_context: the slots are folded with the CPU fold on torch's
// threads, verify checking each lane group of entries as it is folded and
// record applying the entries in order once all are, with the torch-free loops
// of cpu/kernels/canary_cpu.h, and refold writing each fold into its record;
// verify_context plans its entries with cpu/kernels/context_slots_cpu.h first.
#include "cpu/kernels/canary_cpu.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/fold_cpu_entry.h"
#include "cpu/kernels/context_slots_cpu.h"
#include "libtorch/tensors.h"
#include "plan/canary_plan.h"
#include "plan/context_slots_plan.h"

namespace kvcanary {
namespace {

// A checked call (a refused call has written nothing yet): its entries as
// int64 columns and room for their folds.
struct CpuCall {
  EntryPlan entries;
  FoldPlan fold;
  int64_t capacity;
  std::unique_ptr<int64_t[]> scratch;
  EntryColumns columns;
  int64_t* folds;
};

// record fills missing inputs with -1; verify leaves them missing.
CpuCall plan_call(const CanaryInputs& in, const CanaryTables& tables, bool check_bounds,
                  bool fill_missing) {
  CanaryPlan plan = make_canary_plan(in, tables);
  if (check_bounds) {
    check_entries_in_range(plan, kHostSearch);
  }
  const EntryInputs& inputs = plan.entries.inputs;
  const int64_t n = inputs.num_entries;
  auto scratch = std::make_unique_for_overwrite<int64_t[]>(
      n + EntryColumns::scratch_values(inputs, fill_missing));
  int64_t* folds = scratch.get();
  EntryColumns columns(inputs, fill_missing, folds + n);
  return {std::move(plan.entries),
          std::move(plan.fold),
          plan.capacity,
          std::move(scratch),
          columns,
          folds};
}

template <typename Int>
CpuCanaryTables<Int> cpu_tables(const CanaryTables& tables, int64_t capacity, Int* records,
                                Int* owner_tags) {
  return {records,
          owner_tags,
          tables.counters.mutable_data_ptr<int64_t>(),
          tables.ring.mutable_data_ptr<int64_t>(),
          tables.ring.size(0),
          capacity};
}

void record_cpu(const CanaryInputs& args, const CanaryTables& tables, bool check_bounds) {
  const CpuCall call = plan_call(args, tables, check_bounds, true);
  fold_slots_cpu(call.fold, call.entries.slots, call.folds);
  record_entries(cpu_tables(tables, call.capacity, tables.records.mutable_data_ptr<int64_t>(),
                            tables.owner_tags.mutable_data_ptr<int64_t>()),
                 call.columns, call.folds);
}

Tensor verify_cpu(const CanaryInputs& args, const CanaryTables& tables, int64_t padding_slot,
                  bool check_bounds) {
  const CpuCall call = plan_call(args, tables, check_bounds, false);
  Tensor flagged = new_tensor(args.slots.sizes(), ScalarType::Bool, args.slots.device());
  const VerifySide side{cpu_tables(tables, call.capacity, tables.records.const_data_ptr<int64_t>(),
                                   tables.owner_tags.const_data_ptr<int64_t>()),
                        call.columns, call.folds, padding_slot, flagged.mutable_data_ptr<bool>()};
  fold_slots_cpu(call.fold, call.entries.slots, call.folds,
                 {&VerifySide::lines, &VerifySide::after, &side});
  verify_rows(side.tables, call.columns, call.folds, padding_slot, side.flagged);
  return flagged;
}

void refold_cpu(const SourcesArg& sources, const Tensor& slots, Tensor& records,
                bool check_bounds) {
  const CanaryPlan plan = make_refold_plan(sources, slots, records);
  if (check_bounds) {
    check_entries_in_range(plan, kHostSearch);
  }
  const EntryInputs& in = plan.entries.inputs;
  const auto folds = std::make_unique_for_overwrite<int64_t[]>(in.num_entries);
  fold_slots_cpu(plan.fold, plan.entries.slots, folds.get());
  int64_t* fields = records.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < in.num_entries; ++i) {
    const int64_t s = entry_slot(in, i);
    if (s >= 0 && s < plan.capacity) {
      fields[s * kRecordFields + kFold] = folds[i];
    }
  }
}

// The number of entries that wait for the deferred call, the entries written
// on torch's threads, each taking a span.
int64_t plan_context_entries(const ContextRanges& c, const ContextChecks& k, int64_t* tokens) {
  if (c.num_entries <= kContextSlotsGrain) {
    return context_checks_range(c, k, tokens, 0, c.num_entries);
  }
  std::atomic<int64_t> waiting{0};
  torch::stable::parallel_for(0, c.num_entries, kContextSlotsGrain,
                              [&](int64_t begin, int64_t end) {
                                waiting += context_checks_range(c, k, tokens, begin, end);
                              });
  return waiting.load();
}

// verify of verify_context's chosen entries (slot >= 0): when some are not
// chosen (a sample under every > 1, the entries of the other call), the
// chosen ones are packed first, so that the fold spends no lanes on the
// others; their answers are then spread back, false elsewhere.
Tensor verify_chosen(const ContextVerifyInputs& in, const CanaryTables& tables,
                     int64_t padding_slot, bool check_bounds, const Tensor& slots,
                     const Tensor& positions, const Tensor& prev_slots,
                     const std::optional<Tensor>& tokens) {
  const int64_t n = slots.numel();
  const int64_t* slot_values = slots.const_data_ptr<int64_t>();
  const int64_t chosen =
      std::count_if(slot_values, slot_values + n, [](int64_t s) { return s >= 0; });
  const std::optional<Tensor> no_tags;
  if (chosen == n) {
    return verify_cpu({in.sources, slots, positions, tokens, prev_slots, no_tags}, tables,
                      padding_slot, check_bounds);
  }
  const Device device = slots.device();
  Tensor packed_slots = new_tensor({chosen}, ScalarType::Long, device);
  Tensor packed_positions = new_tensor({chosen}, ScalarType::Long, device);
  Tensor packed_prev_slots = new_tensor({chosen}, ScalarType::Long, device);
  std::optional<Tensor> packed_tokens;
  if (tokens.has_value()) {
    packed_tokens = new_tensor({chosen}, ScalarType::Long, device);
  }
  const int64_t* position_values = positions.const_data_ptr<int64_t>();
  const int64_t* prev_values = prev_slots.const_data_ptr<int64_t>();
  const int64_t* token_values = tokens.has_value() ? tokens->const_data_ptr<int64_t>() : nullptr;
  int64_t* out_slots = packed_slots.mutable_data_ptr<int64_t>();
  int64_t* out_positions = packed_positions.mutable_data_ptr<int64_t>();
  int64_t* out_prev = packed_prev_slots.mutable_data_ptr<int64_t>();
  int64_t* out_tokens = token_values ? packed_tokens->mutable_data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0, k = 0; i < n; ++i) {
    if (slot_values[i] < 0) continue;
    out_slots[k] = slot_values[i];
    out_positions[k] = position_values[i];
    out_prev[k] = prev_values[i];
    if (out_tokens) out_tokens[k] = token_values[i];
    ++k;
  }
  const Tensor packed_flagged = verify_cpu(
      {in.sources, packed_slots, packed_positions, packed_tokens, packed_prev_slots, no_tags},
      tables, padding_slot, check_bounds);
  Tensor flagged = new_tensor({n}, ScalarType::Bool, device);
  const bool* packed_answers = packed_flagged.const_data_ptr<bool>();
  bool* answers = flagged.mutable_data_ptr<bool>();
  for (int64_t i = 0, k = 0; i < n; ++i) {
    answers[i] = false;
    if (slot_values[i] >= 0) {
      answers[i] = packed_answers[k];
      ++k;
    }
  }
  return flagged;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> verify_context_cpu(const ContextVerifyInputs& in,
                                                              const CanaryTables& tables,
                                                              int64_t padding_slot,
                                                              bool check_bounds) {
  ContextSlotsPlan ranges_plan = make_context_slots_plan(
      in.block_table, in.offsets, in.starts, in.block_size, in.num_entries, in.cut_slot);
  ContextRanges& c = ranges_plan.ranges;
  const ContextChecksPlan checks_plan =
      make_context_checks_plan(in.block_table, c.num_rows, in.written, in.history, in.history_known,
                               in.history_rows, in.every, in.turn, in.deferred);
  if (check_bounds) {
    check_context_ranges(c, c.offsets, c.starts);
    check_context_checks(c, checks_plan.checks);
  }
  const Device device = in.block_table.device();
  const ContextSlotsOutputs out = new_context_slots_outputs(c, device);
  std::optional<Tensor> tokens;
  if (in.history.has_value()) {
    tokens = new_tensor({in.num_entries}, ScalarType::Long, device);
  }
  Tensor waiting = new_tensor({1}, ScalarType::Long, device);
  *waiting.mutable_data_ptr<int64_t>() = plan_context_entries(
      c, checks_plan.checks, tokens.has_value() ? tokens->mutable_data_ptr<int64_t>() : nullptr);
  Tensor flagged = verify_chosen(in, tables, padding_slot, check_bounds, out.slots, out.positions,
                                 out.prev_slots, tokens);
  return {out.slots, out.rows, flagged, waiting};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("record", TORCH_BOX(&record_op<record_cpu>));
  m.impl("verify", TORCH_BOX(&verify_op<verify_cpu>));
  m.impl("verify_context", TORCH_BOX(&verify_context_op<verify_context_cpu>));
  m.impl("refold", TORCH_BOX(&refold_op<refold_cpu>));
  m.impl("record.bound", TORCH_BOX(&record_bound_op<record_cpu>));
  m.impl("verify.bound", TORCH_BOX(&verify_bound_op<verify_cpu>));
  m.impl("verify_context.bound", TORCH_BOX(&verify_context_bound_op<verify_context_cpu>));
  m.impl("refold.bound", TORCH_BOX(&refold_bound_op<refold_cpu>));
}

}  // namespace kvcanary
