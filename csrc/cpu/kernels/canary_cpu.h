// The CPU canary's bookkeeping once a call's folds are known (contract:
// docs/spec.md, "The canary records"): record applies its entries in entry
// order once all are folded; verify checks each lane group of entries on the
// thread that folded it, as the fold goes (FoldSideWork), the fold having
// requested the group's record lines while it hashed the group before.
// Torch-free, portable code: cpu/canary_cpu.cpp compiles it and the
// instruction-set units never include it.
//
// The loops read the per-entry inputs as int64 arrays (int32 ones converted
// first, see EntryColumns), without a test per value.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/canary_records.h"
#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {

// The canary's tables as record and verify see them.
using CpuRecordTables = CanaryTablePointers<int64_t>;
using CpuVerifyTables = CanaryTablePointers<const int64_t>;

// A call's per-entry inputs with every given one an int64 array: int64 inputs
// read in place, int32 ones converted into scratch. For record a missing
// input is an array of -1 too (what record stores for it), so that its loops
// read every input alike; for verify a missing input stays null (not
// checked).
class EntryColumns {
 public:
  // The int64 values `scratch` must hold for `in`.
  static int64_t scratch_values(const EntryInputs& in, bool fill_missing) {
    const auto copied = [&](const void* data, bool is_int32) {
      return data == nullptr ? fill_missing : is_int32;
    };
    const int columns =
        copied(in.slots, in.slots_int32) + copied(in.positions, in.positions_int32) +
        copied(in.tokens, in.tokens_int32) + copied(in.prev_slots, in.prev_slots_int32);
    return columns * in.num_entries;
  }

  EntryColumns(const EntryInputs& in, bool fill_missing, int64_t* scratch) : inputs_(in) {
    const int64_t n = in.num_entries;
    const auto column = [&](const void*& data, bool& is_int32) {
      if (data == nullptr && !fill_missing) return;
      if (data == nullptr) {
        std::fill_n(scratch, n, int64_t{-1});
      } else if (is_int32) {
        std::copy_n(static_cast<const int32_t*>(data), n, scratch);
      } else {
        return;
      }
      data = scratch;
      is_int32 = false;
      scratch += n;
    };
    column(inputs_.slots, inputs_.slots_int32);
    column(inputs_.positions, inputs_.positions_int32);
    column(inputs_.tokens, inputs_.tokens_int32);
    column(inputs_.prev_slots, inputs_.prev_slots_int32);
  }

  // The inputs for core/canary_records.h's functions.
  const EntryInputs& inputs() const { return inputs_; }
  int64_t size() const { return inputs_.num_entries; }
  // Each input's array; null where verify's input is missing.
  const int64_t* slots() const { return static_cast<const int64_t*>(inputs_.slots); }
  const int64_t* positions() const { return static_cast<const int64_t*>(inputs_.positions); }
  const int64_t* tokens() const { return static_cast<const int64_t*>(inputs_.tokens); }
  const int64_t* prev_slots() const { return static_cast<const int64_t*>(inputs_.prev_slots); }

 private:
  EntryInputs inputs_;
};

namespace canary_cpu {

// Appends a violation row (fill-once: rows past the ring's capacity are
// dropped and counted).
template <typename Int>
void append_row(const CanaryTablePointers<Int>& t, const int64_t* row) {
  const int64_t index = t.counters[kRingWrite]++;
  ++t.counters[kViolations];
  if (index >= t.ring_capacity) {
    ++t.counters[kRingOverflow];
    return;
  }
  std::copy_n(row, kViolationFields, t.ring + index * kViolationFields);
}

}  // namespace canary_cpu

// kvcanary::record's bookkeeping: the entries applied in entry order (an
// entry may chain through a slot an earlier one wrote), folds[i] being entry
// i's fold. The links of a request's positions form one serial chain of
// mix3s, which bounds the loop; the misses on the records of the entries
// after the current one overlap that chain, so nothing is requested ahead.
[[gnu::flatten]] inline void record_entries(const CpuRecordTables& t, const EntryColumns& columns,
                                            const int64_t* folds) {
  const EntryInputs& in = columns.inputs();
  // record's columns are all given (missing ones -1); so are the owner tags.
  const int64_t* slots = columns.slots();
  const int64_t* prev_slots = columns.prev_slots();
  const int64_t* positions = columns.positions();
  const int64_t* tokens = columns.tokens();
  const int64_t no_tag = -1;
  const int64_t* tags = in.tags != nullptr ? in.tags : &no_tag;
  const int64_t tag_mask = in.tags != nullptr && !in.tags_broadcast ? ~int64_t{0} : 0;
  int64_t written = 0;
  for (int64_t i = 0; i < columns.size(); ++i) {
    const int64_t s = slots[i];
    if (s < 0) continue;  // padding
    const int64_t p = prev_slots[i];
    if (s >= t.capacity || p >= t.capacity) {
      int64_t row[kViolationFields];
      out_of_range_row(row, kKindRecord, in, i);
      canary_cpu::append_row(t, row);
      continue;
    }
    // Read the link before writing the record: an entry may name its own slot.
    const int64_t chain = entry_link(t.records, in, i, p);
    int64_t* record = t.records + s * kRecordFields;
    record[kToken] = tokens[i];
    record[kPosition] = positions[i];
    record[kChain] = chain;
    record[kFold] = folds[i];
    t.owner_tags[s] = tags[i & tag_mask];
    ++written;
  }
  t.counters[kRecordCalls] += 1;
  t.counters[kSlotsRecorded] += written;
}

// The lines verify reads for entries `span` (FoldSideWork::lines): each
// entry's slot's record, its owner tag when tags are checked, and its
// previous slot's record when the chain is; returns how many it wrote to
// `out` (at most kSideLinesPerEntry per entry).
inline int verify_lines(const CpuVerifyTables& t, const EntryColumns& columns, SlotSpan span,
                        const void** out) {
  const int64_t* slots = columns.slots();
  const int64_t* prev_slots = columns.prev_slots();
  const bool owners = columns.inputs().tags != nullptr;
  int count = 0;
  for (int64_t i = span.begin; i < span.end; ++i) {
    const int64_t s = slots[i];
    if (s >= 0 && s < t.capacity) {
      out[count++] = t.records + s * kRecordFields;
      if (owners) out[count++] = t.owner_tags + s;
    }
    const int64_t p = prev_slots != nullptr ? prev_slots[i] : -1;
    if (p >= 0 && p < t.capacity) out[count++] = t.records + p * kRecordFields;
  }
  return count;
}

// kvcanary::verify's checks of entries `span`, folds[i] being entry i's fold:
// flagged[i] is whether entry i failed a check. Spans run on any thread, in
// any order.
[[gnu::flatten]] inline void verify_span(const CpuVerifyTables& t, const EntryColumns& columns,
                                         const int64_t* folds, int64_t padding_slot, SlotSpan span,
                                         bool* flagged) {
  const EntryInputs& in = columns.inputs();
  const int64_t* slots = columns.slots();
  const int64_t* prev_slots = columns.prev_slots();
  for (int64_t i = span.begin; i < span.end; ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s == padding_slot) {
      flagged[i] = false;
    } else if (s >= t.capacity || (prev_slots != nullptr && prev_slots[i] >= t.capacity)) {
      flagged[i] = true;
    } else {
      flagged[i] =
          verify_entry(t.records, t.owner_tags, in, i, s, folds[i], padding_slot).reasons != 0;
    }
  }
}

// kvcanary::verify's rows and counters, once every entry is checked: a row
// for each flagged entry, in entry order.
inline void verify_rows(const CpuVerifyTables& t, const EntryColumns& columns, const int64_t* folds,
                        int64_t padding_slot, const bool* flagged) {
  const EntryInputs& in = columns.inputs();
  const int64_t* slots = columns.slots();
  int64_t checked = 0;  // all but padding
  for (int64_t i = 0; i < in.num_entries; ++i) {
    checked += slots[i] >= 0 && slots[i] != padding_slot;
  }
  for (int64_t i = 0; i < in.num_entries; ++i) {
    if (!flagged[i]) continue;
    int64_t row[kViolationFields];
    const int64_t s = slots[i];
    if (s >= t.capacity || entry_prev_slot(in, i) >= t.capacity) {
      out_of_range_row(row, kKindVerify, in, i);
    } else {
      verify_row(row, t.records, in, i, s,
                 verify_entry(t.records, t.owner_tags, in, i, s, folds[i], padding_slot));
    }
    canary_cpu::append_row(t, row);
  }
  t.counters[kVerifyCalls] += 1;
  t.counters[kSlotsVerified] += checked;
}

// verify's side of the fold: each lane group's entries checked once folded,
// their lines requested while the group before is hashed.
struct VerifySide {
  CpuVerifyTables tables;
  const EntryColumns& columns;
  const int64_t* folds;
  int64_t padding_slot;
  bool* flagged;

  static int lines(const void* self, SlotSpan span, const void** out) {
    const auto& v = *static_cast<const VerifySide*>(self);
    return verify_lines(v.tables, v.columns, span, out);
  }
  static void after(const void* self, SlotSpan span) {
    const auto& v = *static_cast<const VerifySide*>(self);
    verify_span(v.tables, v.columns, v.folds, v.padding_slot, span, v.flagged);
  }
};

}  // namespace kvcanary
