// CPU kernels of kvcanary::record and kvcanary::verify: the slots are folded
// with the CPU fold on torch's threads, then the records are applied (record:
// in entry order, since an entry may chain through an earlier one) or checked
// (verify: in parallel, the flagged rows appended in entry order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "cpu/fold_cpu_entry.h"
#include "plan/canary_plan.h"

namespace kvcanary {
namespace {

// The canary's tables as raw pointers.
struct CpuTables {
  int64_t* records;
  int64_t* owner_tags;
  int64_t* counters;
};

CpuTables tables_of(at::Tensor& records, at::Tensor& owner_tags, at::Tensor& counters) {
  return {records.mutable_data_ptr<int64_t>(), owner_tags.mutable_data_ptr<int64_t>(),
          counters.mutable_data_ptr<int64_t>()};
}

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

// The current fold of every entry's slot (0 for padding and past the capacity).
std::vector<int64_t> fold_entries(const FoldPlan& plan, const at::Tensor& flat_slots) {
  std::vector<int64_t> folds(flat_slots.numel(), 0);
  fold_slots_cpu(plan, flat_slots, folds.data());
  return folds;
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
// has written nothing yet) and every entry's fold.
struct CpuCall {
  EntryPlan entries;
  int64_t capacity;
  std::vector<int64_t> folds;
};

CpuCall prepare_call(at::TensorList sources, at::IntArrayRef read_bytes, const at::Tensor& slots,
                     const std::optional<at::Tensor>& positions,
                     const std::optional<at::Tensor>& tokens,
                     const std::optional<at::Tensor>& prev_slots,
                     const std::optional<at::Tensor>& tags, const at::Tensor& records,
                     const at::Tensor& owner_tags, const at::Tensor& counters,
                     const at::Tensor& ring, bool check_bounds) {
  const FoldPlan fold_plan = make_fold_plan(sources, slots, read_bytes);
  CpuCall call;
  call.capacity =
      check_canary_tables(records, owner_tags, counters, &ring, slots, fold_plan.capacity);
  call.entries = make_entry_plan(slots, positions, tokens, prev_slots, tags);
  if (check_bounds) {
    check_entries_in_range(call.entries, call.capacity, kHostSearch);
  }
  call.folds = fold_entries(fold_plan, call.entries.slots);
  return call;
}

void record_cpu(at::TensorList sources, at::IntArrayRef read_bytes, const at::Tensor& slots,
                const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& tokens,
                const std::optional<at::Tensor>& prev_slots, const std::optional<at::Tensor>& tags,
                at::Tensor& records, at::Tensor& owner_tags, at::Tensor& counters, at::Tensor& ring,
                bool check_bounds) {
  const CpuCall call = prepare_call(sources, read_bytes, slots, positions, tokens, prev_slots, tags,
                                    records, owner_tags, counters, ring, check_bounds);
  const EntryInputs& in = call.entries.inputs;
  const int64_t capacity = call.capacity;
  const std::vector<int64_t>& folds = call.folds;
  const CpuTables t = tables_of(records, owner_tags, counters);
  int64_t* ring_rows = ring.mutable_data_ptr<int64_t>();
  int64_t recorded = 0;
  for (int64_t i = 0; i < in.num_entries; ++i) {
    prefetch_records(t.records, t.owner_tags, in, i + kRecordPrefetchDistance, capacity);
    const int64_t s = entry_slot(in, i);
    if (s < 0) {
      continue;  // padding
    }
    const int64_t p = entry_prev_slot(in, i);
    if (s >= capacity || p >= capacity) {
      int64_t row[kViolationFields];
      out_of_range_row(row, kKindRecord, in, i);
      append_row(t.counters, ring_rows, ring.size(0), row);
      continue;
    }
    // Read the link before writing the record: an entry may name its own slot.
    const int64_t chain = link_at(t.records, p);
    int64_t* record = t.records + s * kRecordFields;
    record[kToken] = entry_token(in, i);
    record[kPosition] = entry_position(in, i);
    record[kChain] = chain;
    record[kFold] = folds[i];
    t.owner_tags[s] = in.tags != nullptr ? entry_tag(in, i) : -1;
    ++recorded;
  }
  t.counters[kRecordCalls] += 1;
  t.counters[kSlotsRecorded] += recorded;
}

at::Tensor verify_cpu(at::TensorList sources, at::IntArrayRef read_bytes, const at::Tensor& slots,
                      const std::optional<at::Tensor>& positions,
                      const std::optional<at::Tensor>& tokens,
                      const std::optional<at::Tensor>& prev_slots,
                      const std::optional<at::Tensor>& tags, const at::Tensor& records,
                      const at::Tensor& owner_tags, at::Tensor& counters, at::Tensor& ring,
                      int64_t padding_slot, bool check_bounds) {
  const CpuCall call = prepare_call(sources, read_bytes, slots, positions, tokens, prev_slots, tags,
                                    records, owner_tags, counters, ring, check_bounds);
  const EntryInputs& in = call.entries.inputs;
  const int64_t capacity = call.capacity;
  const std::vector<int64_t>& folds = call.folds;
  const int64_t* table = records.const_data_ptr<int64_t>();
  const int64_t* owners = owner_tags.const_data_ptr<int64_t>();
  at::Tensor flagged = at::empty(slots.sizes(), slots.options().dtype(at::kBool));
  bool* out = flagged.mutable_data_ptr<bool>();
  // Reason bits per entry: -1 for an entry that is not checked (padding).
  std::vector<int64_t> reasons(in.num_entries);
  at::parallel_for(0, in.num_entries, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      prefetch_records(table, owners, in, i + kRecordPrefetchDistance, capacity);
      const int64_t s = entry_slot(in, i);
      if (s < 0 || s == padding_slot) {
        reasons[i] = -1;
      } else if (s >= capacity || entry_prev_slot(in, i) >= capacity) {
        reasons[i] = kSlotOutOfRange;
      } else {
        reasons[i] = verify_entry(table, owners, in, i, s, folds[i], padding_slot).reasons;
      }
      out[i] = reasons[i] > 0;
    }
  });
  int64_t* c = counters.mutable_data_ptr<int64_t>();
  int64_t* ring_rows = ring.mutable_data_ptr<int64_t>();
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
      verify_row(row, table, in, i, s,
                 verify_entry(table, owners, in, i, s, folds[i], padding_slot));
    }
    append_row(c, ring_rows, ring.size(0), row);
  }
  c[kVerifyCalls] += 1;
  c[kSlotsVerified] += verified;
  return flagged;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("record", &record_cpu);
  m.impl("verify", &verify_cpu);
}

}  // namespace kvcanary
