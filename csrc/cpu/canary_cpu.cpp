// CPU kernels of kvcanary::record, kvcanary::verify and kvcanary::refold: the
// slots are folded with the CPU fold on torch's threads, verify checking each
// lane group of entries as it is folded and record applying the entries in
// order once all are, with the torch-free loops of cpu/kernels/canary_cpu.h,
// and refold writing each fold into its record.
#include "cpu/kernels/canary_cpu.h"

#include <torch/csrc/stable/library.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cpu/fold_cpu_entry.h"
#include "libtorch/tensors.h"
#include "plan/canary_plan.h"

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

void record_cpu(const CanaryInputs& args, const CanaryTables& tables, bool check_bounds) {
  const CpuCall call = plan_call(args, tables, check_bounds, true);
  fold_slots_cpu(call.fold, call.entries.slots, call.folds);
  record_entries(table_pointers<CpuRecordTables>(tables, call.capacity), call.columns, call.folds);
}

Tensor verify_cpu(const CanaryInputs& args, const CanaryTables& tables, int64_t padding_slot,
                  bool check_bounds) {
  const CpuCall call = plan_call(args, tables, check_bounds, false);
  Tensor flagged = new_tensor(args.slots.sizes(), ScalarType::Bool, args.slots.device());
  const VerifySide side{table_pointers<CpuVerifyTables>(tables, call.capacity), call.columns,
                        call.folds, padding_slot, flagged.mutable_data_ptr<bool>()};
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

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  register_canary_ops<record_cpu, verify_cpu, refold_cpu>(m);
}

}  // namespace kvcanary
