// CPU kernels of kvcanary::record and kvcanary::verify: the slots are folded
// with the CPU fold on torch's threads, then the records are applied (record:
// in entry order, since an entry may chain through an earlier one) or checked
// (verify: in parallel, the flagged rows appended in entry order).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cpu/fold_cpu_entry.h"
#include "plan/canary_plan.h"
#include "plan/tensors.h"

namespace kvcanary {
namespace {

// Appends a violation row (fill-once: rows past the ring's capacity are
// dropped and counted).
void append_row(int64_t* counters, int64_t* ring, int64_t ring_capacity, const int64_t* row) {
  const int64_t index = counters[kRingWrite]++;
  ++counters[kViolations];
  if (index >= ring_capacity) {
    ++counters[kRingOverflow];
    return;
  }
  std::copy_n(row, kViolationFields, ring + index * kViolationFields);
}

// Entries ahead of the one being applied whose records are requested from
// memory: the records of random slots miss the cache, and the loops do little
// else than wait for them.
constexpr int64_t kRecordPrefetchDistance = 32;

// Requests the records an entry reads: its slot's record and owner tag, and
// its previous slot's record.
void prefetch_records(const int64_t* records, const int64_t* owner_tags, const EntryInputs& in,
                      int64_t i, int64_t capacity) {
  if (i >= in.num_entries) {
    return;
  }
  const int64_t s = entry_slot(in, i);
  const int64_t p = entry_prev_slot(in, i);
  if (s >= 0 && s < capacity) {
    __builtin_prefetch(records + s * kRecordFields);
    __builtin_prefetch(owner_tags + s);
  }
  if (p >= 0 && p < capacity) __builtin_prefetch(records + p * kRecordFields);
}

// What record and verify start from: every argument checked (a refused call
// has written nothing yet) and every entry's fold (0 for padding and past the
// capacity).
struct CpuCall {
  EntryPlan entries;
  int64_t capacity;
  std::vector<int64_t> folds;
};

CpuCall prepare_call(const CanaryInputs& in, const CanaryTables& tables, bool check_bounds) {
  CanaryPlan plan = make_canary_plan(in, tables);
  if (check_bounds) {
    check_entries_in_range(plan, kHostSearch);
  }
  CpuCall call{std::move(plan.entries), plan.capacity, {}};
  call.folds.assign(call.entries.inputs.num_entries, 0);
  fold_slots_cpu(plan.fold, call.entries.slots, call.folds.data());
  return call;
}

void record_cpu(const CanaryInputs& args, const CanaryTables& tables, bool check_bounds) {
  const CpuCall call = prepare_call(args, tables, check_bounds);
  const EntryInputs& in = call.entries.inputs;
  const int64_t capacity = call.capacity;
  const std::vector<int64_t>& folds = call.folds;
  int64_t* records = tables.records.mutable_data_ptr<int64_t>();
  int64_t* owner_tags = tables.owner_tags.mutable_data_ptr<int64_t>();
  int64_t* counters = tables.counters.mutable_data_ptr<int64_t>();
  int64_t* ring = tables.ring.mutable_data_ptr<int64_t>();
  int64_t recorded = 0;
  for (int64_t i = 0; i < in.num_entries; ++i) {
    prefetch_records(records, owner_tags, in, i + kRecordPrefetchDistance, capacity);
    const int64_t s = entry_slot(in, i);
    if (s < 0) {
      continue;  // padding
    }
    const int64_t p = entry_prev_slot(in, i);
    if (s >= capacity || p >= capacity) {
      int64_t row[kViolationFields];
      out_of_range_row(row, kKindRecord, in, i);
      append_row(counters, ring, tables.ring.size(0), row);
      continue;
    }
    // Read the link before writing the record: an entry may name its own slot.
    const int64_t chain = link_at(records, p);
    int64_t* record = records + s * kRecordFields;
    record[kToken] = entry_token(in, i);
    record[kPosition] = entry_position(in, i);
    record[kChain] = chain;
    record[kFold] = folds[i];
    owner_tags[s] = in.tags != nullptr ? entry_tag(in, i) : -1;
    ++recorded;
  }
  counters[kRecordCalls] += 1;
  counters[kSlotsRecorded] += recorded;
}

Tensor verify_cpu(const CanaryInputs& args, const CanaryTables& tables, int64_t padding_slot,
                  bool check_bounds) {
  const CpuCall call = prepare_call(args, tables, check_bounds);
  const EntryInputs& in = call.entries.inputs;
  const int64_t capacity = call.capacity;
  const std::vector<int64_t>& folds = call.folds;
  const int64_t* records = tables.records.const_data_ptr<int64_t>();
  const int64_t* owner_tags = tables.owner_tags.const_data_ptr<int64_t>();
  Tensor flagged = new_tensor(args.slots.sizes(), ScalarType::Bool, args.slots.device());
  bool* out = flagged.mutable_data_ptr<bool>();
  // Reason bits per entry: -1 for an entry that is not checked (padding).
  std::vector<int64_t> reasons(in.num_entries);
  torch::stable::parallel_for(0, in.num_entries, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      prefetch_records(records, owner_tags, in, i + kRecordPrefetchDistance, capacity);
      const int64_t s = entry_slot(in, i);
      if (s < 0 || s == padding_slot) {
        reasons[i] = -1;
      } else if (s >= capacity || entry_prev_slot(in, i) >= capacity) {
        reasons[i] = kSlotOutOfRange;
      } else {
        reasons[i] = verify_entry(records, owner_tags, in, i, s, folds[i], padding_slot).reasons;
      }
      out[i] = reasons[i] > 0;
    }
  });
  int64_t* counters = tables.counters.mutable_data_ptr<int64_t>();
  int64_t* ring = tables.ring.mutable_data_ptr<int64_t>();
  int64_t verified = 0;
  for (int64_t i = 0; i < in.num_entries; ++i) {
    verified += reasons[i] >= 0;
    if (reasons[i] <= 0) {
      continue;
    }
    int64_t row[kViolationFields];
    const int64_t s = entry_slot(in, i);
    if (reasons[i] == kSlotOutOfRange) {
      out_of_range_row(row, kKindVerify, in, i);
    } else {
      verify_row(row, records, in, i, s,
                 verify_entry(records, owner_tags, in, i, s, folds[i], padding_slot));
    }
    append_row(counters, ring, tables.ring.size(0), row);
  }
  counters[kVerifyCalls] += 1;
  counters[kSlotsVerified] += verified;
  return flagged;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("record", TORCH_BOX(&record_op<record_cpu>));
  m.impl("verify", TORCH_BOX(&verify_op<verify_cpu>));
}

}  // namespace kvcanary
