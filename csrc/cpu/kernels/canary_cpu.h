// The CPU canary's bookkeeping once a call's folds are known (contract:
// docs/spec.md, "The canary records"): record applies its entries in entry
// order, verify checks each task of entries on the thread that folded it.
// Torch-free, portable code: cpu/canary_cpu.cpp compiles it and the
// instruction-set units never include it.
//
// The loops read the per-entry inputs as int64 arrays (int32 ones converted
// first, see EntryColumns), without a test per value. They wait on the
// records of random slots more than they compute, so those lines are
// requested ahead: by the fold while it hashes the group before (see
// entry_lines), and by record's loops kRecordPrefetchDistance entries ahead.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/canary_records.h"
#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {

// The canary's tables as the CPU kernels see them: Int is int64_t where
// record writes the records and owner tags, const int64_t where verify reads
// them.
template <typename Int>
struct CpuCanaryTables {
  Int* records;       // [capacity, kRecordFields]
  Int* owner_tags;    // [capacity]
  int64_t* counters;  // [kNumCounters]
  int64_t* ring;      // [ring_capacity, kViolationFields]
  int64_t ring_capacity;
  int64_t capacity;
};
using CpuRecordTables = CpuCanaryTables<int64_t>;
using CpuVerifyTables = CpuCanaryTables<const int64_t>;

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

// Entries ahead of the one being handled whose lines are requested: the
// records of random slots miss the cache, and a loop over entries does little
// else than wait for them.
constexpr int64_t kRecordPrefetchDistance = 32;

// Every function that prefetches is always inlined: GCC counts a prefetch as
// having no effect and drops the calls of a function that only prefetches.
[[gnu::always_inline]] inline void prefetch_line(const void* address, bool for_write) {
  if (for_write) {
    __builtin_prefetch(address, 1, 3);
  } else {
    __builtin_prefetch(address, 0, 3);
  }
}

// Requests the lines an entry at slot s with previous slot p reads and
// writes: its slot's record and owner tag and its previous slot's record.
template <typename Int>
[[gnu::always_inline]] inline void prefetch_entry(const CpuCanaryTables<Int>& t, int64_t s,
                                                  int64_t p, bool for_write) {
  if (s >= 0 && s < t.capacity) {
    prefetch_line(t.records + s * kRecordFields, for_write);
    prefetch_line(t.owner_tags + s, for_write);
  }
  if (p >= 0 && p < t.capacity) prefetch_line(t.records + p * kRecordFields, false);
}

// Appends a violation row (fill-once: rows past the ring's capacity are
// dropped and counted).
template <typename Int>
void append_row(const CpuCanaryTables<Int>& t, const int64_t* row) {
  const int64_t index = t.counters[kRingWrite]++;
  ++t.counters[kViolations];
  if (index >= t.ring_capacity) {
    ++t.counters[kRingOverflow];
    return;
  }
  std::copy_n(row, kViolationFields, t.ring + index * kViolationFields);
}

// Record's entries: the columns, all given (missing ones -1), and each
// entry's owner tag (-1 when not given).
struct RecordEntries {
  const EntryColumns& columns;
  const int64_t* slots;
  const int64_t* prev_slots;
  const int64_t* positions;
  const int64_t* tokens;
  const int64_t* tags;
  int64_t tag_mask;  // tag of entry i: tags[i & tag_mask]
  int64_t size;

  static constexpr int64_t kNoTag = -1;

  explicit RecordEntries(const EntryColumns& c)
      : columns(c),
        slots(c.slots()),
        prev_slots(c.prev_slots()),
        positions(c.positions()),
        tokens(c.tokens()),
        tags(c.inputs().tags != nullptr ? c.inputs().tags : &kNoTag),
        tag_mask(c.inputs().tags != nullptr && !c.inputs().tags_broadcast ? ~int64_t{0} : 0),
        size(c.size()) {}

  // Whether entry i writes its record: a slot and a previous slot in range
  // (negative slots are padding; a slot or previous slot past the capacity
  // appends a row instead).
  bool writes(int64_t i, int64_t capacity) const {
    return slots[i] >= 0 && slots[i] < capacity && prev_slots[i] < capacity;
  }
};

// Whether a slot in entries [begin, end) is `slot`.
inline bool slot_among(const int64_t* slots, int64_t begin, int64_t end, int64_t slot) {
  bool found = false;
  for (int64_t j = begin; j < end; ++j) found |= slots[j] == slot;
  return found;
}

// Record's chains, computed side by side.
//
// An entry's chain is the link of its previous slot's record as the entries
// before it left it. Within a run of entries that each chain through the
// slot the entry before wrote (a request's positions: prev_slots[i] ==
// slots[i - 1]), each link is the mix3 of the one before, a serial chain of
// multiplies; the runs of a call are independent of each other but for the
// slots they read. So record takes the entries of runs in windows: a
// window's runs compute their chains kChainLanes at a time, one run per lane,
// and then the window's entries are applied in entry order. Only the first
// entry of a run reads the table, before anything of its window is applied,
// which is exact as long as no earlier entry of the window writes the slot it
// reads: a run whose first entry would read such a slot starts the next
// window instead. Entries outside runs (a decode step: each its request's
// next position) are applied one by one, each reading the table as the
// entries before it left it.
constexpr int kChainLanes = 8;
// Bounds of a window: its runs (the scratch they take) and entries (the
// false hits of its slot filter).
constexpr int kWindowRuns = 256;
constexpr int64_t kWindowEntries = int64_t{1} << 14;

// The slots a window writes, as one bit each of a hash: a slot whose bit is
// clear is not among them; a set bit may be another slot's (a caller then
// looks for the slot itself).
class SlotFilter {
 public:
  // Enough bits for the windows of a call of `entries` entries to set few.
  explicit SlotFilter(int64_t entries) {
    const int64_t wanted = 16 * std::min(entries, kWindowEntries);
    while (bits_ < wanted && bits_ < kMaxBits) bits_ *= 2;
    while ((int64_t{1} << index_bits_) < bits_) ++index_bits_;
  }
  void clear() { std::fill_n(words_, bits_ / 64, uint64_t{0}); }
  void add(int64_t slot) {
    const uint64_t bit = index(slot);
    words_[bit / 64] |= uint64_t{1} << (bit % 64);
  }
  bool may_hold(int64_t slot) const {
    const uint64_t bit = index(slot);
    return (words_[bit / 64] >> (bit % 64)) & 1;
  }

 private:
  static constexpr int64_t kMaxBits = int64_t{1} << 16;
  uint64_t index(int64_t slot) const {
    return (static_cast<uint64_t>(slot) * 0x9E3779B97F4A7C15ull) >> (64 - index_bits_);
  }
  uint64_t words_[kMaxBits / 64];
  int64_t bits_ = 512;
  int index_bits_ = 0;
};

// A run: entries [first, first + length), each chaining through the slot the
// one before wrote.
struct Run {
  int64_t first;
  int64_t length;
};

// A window of entries [begin, end) and its runs (the entries that write a
// record, in order; entries that write nothing belong to no run).
struct ChainWindow {
  int64_t begin = 0;
  int64_t end = 0;
  int num_runs = 0;
  Run runs[kWindowRuns];
};

// Whether entry i starts a run of two entries or more (a window pays off).
[[gnu::always_inline]] inline bool starts_run(const RecordEntries& e, int64_t i, int64_t capacity) {
  return i + 1 < e.size && e.writes(i, capacity) && e.writes(i + 1, capacity) &&
         e.prev_slots[i + 1] == e.slots[i];
}

// Forms the window that starts at entry `begin` into `w`; the first entry of
// each run has its previous slot's record requested.
[[gnu::flatten]] inline void form_window(const CpuRecordTables& t, const RecordEntries& e,
                                         int64_t begin, SlotFilter& written, ChainWindow& w) {
  w.begin = begin;
  w.num_runs = 0;
  written.clear();
  const int64_t end = std::min(e.size, begin + kWindowEntries);
  bool previous_writes = false;  // whether entry j - 1 is in the window and writes
  int64_t j = begin;
  for (; j < end; ++j) {
    const int64_t s = e.slots[j];
    const int64_t p = e.prev_slots[j];
    const bool writes = s >= 0 && s < t.capacity && p < t.capacity;
    if (writes && previous_writes && p == e.slots[j - 1]) {
      ++w.runs[w.num_runs - 1].length;
    } else if (writes) {
      if (w.num_runs == kWindowRuns) break;
      if (p >= 0) {
        if (written.may_hold(p) && slot_among(e.slots, begin, j, p)) break;
        prefetch_line(t.records + p * kRecordFields, false);
      }
      w.runs[w.num_runs++] = Run{j, 1};
    }
    if (writes) written.add(s);
    previous_writes = writes;
  }
  w.end = j;
}

// The link entry i's successor reads, `chain` being entry i's: mix3 of the
// record entry i writes.
[[gnu::always_inline]] inline uint64_t successor_link(const RecordEntries& e, uint64_t chain,
                                                      int64_t i) {
  return mix3<uint64_t>(chain, static_cast<uint64_t>(e.tokens[i]),
                        static_cast<uint64_t>(e.positions[i]));
}

// chains[i - w.begin] = the chain of each entry i of kChainLanes runs of the
// window (fewer at its end) from `first_run` on, their links computed side by
// side: in steps, each as many entries long as the shortest run left, the
// lanes with entries left going together.
[[gnu::flatten]] inline void lane_chains(const CpuRecordTables& t, const RecordEntries& e,
                                         const ChainWindow& w, int first_run, int64_t* chains) {
  uint64_t link[kChainLanes];
  int64_t next[kChainLanes];  // each lane's next entry
  int64_t left[kChainLanes];  // and how many it has left
  for (int r = 0; r < kChainLanes; ++r) {
    const bool used = first_run + r < w.num_runs;
    const Run run = used ? w.runs[first_run + r] : Run{w.begin, 0};
    next[r] = run.first;
    left[r] = run.length;
    link[r] = used ? static_cast<uint64_t>(link_at(t.records, e.prev_slots[run.first])) : 0;
  }
  for (;;) {
    int64_t steps = INT64_MAX;
    for (int r = 0; r < kChainLanes; ++r) {
      if (left[r] > 0) steps = std::min(steps, left[r]);
    }
    if (steps == INT64_MAX) return;
    for (int64_t step = 0; step < steps; ++step) {
      // At its run's last entry a lane has no successor to link.
      const bool last_step = step == steps - 1;
#pragma GCC unroll 8
      for (int r = 0; r < kChainLanes; ++r) {
        if (left[r] == 0) continue;
        const int64_t i = next[r] + step;
        chains[i - w.begin] = static_cast<int64_t>(link[r]);
        if (!last_step || left[r] > steps) link[r] = successor_link(e, link[r], i);
      }
    }
    for (int r = 0; r < kChainLanes; ++r) {
      if (left[r] == 0) continue;
      next[r] += steps;
      left[r] -= steps;
    }
  }
}

// Applies entry i, whose chain is `chain` when it writes its record; returns
// whether it did.
[[gnu::always_inline]] inline bool apply_entry(const CpuRecordTables& t, const RecordEntries& e,
                                               int64_t i, int64_t chain, const int64_t* folds) {
  const int64_t s = e.slots[i];
  if (s < 0) return false;  // padding
  if (s >= t.capacity || e.prev_slots[i] >= t.capacity) {
    int64_t row[kViolationFields];
    out_of_range_row(row, kKindRecord, e.columns.inputs(), i);
    append_row(t, row);
    return false;
  }
  int64_t* record = t.records + s * kRecordFields;
  record[kToken] = e.tokens[i];
  record[kPosition] = e.positions[i];
  record[kChain] = chain;
  record[kFold] = folds[i];
  t.owner_tags[s] = e.tags[i & e.tag_mask];
  return true;
}

// Requests the lines of entry i, when i is an entry, for record.
[[gnu::always_inline]] inline void prefetch_record(const CpuRecordTables& t, const RecordEntries& e,
                                                   int64_t i) {
  if (i < e.size) prefetch_entry(t, e.slots[i], e.prev_slots[i], true);
}

// Applies the window's entries in entry order; returns the records written.
[[gnu::flatten]] inline int64_t apply_window(const CpuRecordTables& t, const RecordEntries& e,
                                             const ChainWindow& w, const int64_t* chains,
                                             const int64_t* folds) {
  int64_t written = 0;
  for (int64_t i = w.begin; i < w.end; ++i) {
    prefetch_record(t, e, i + kRecordPrefetchDistance);
    written += apply_entry(t, e, i, chains[i - w.begin], folds);
  }
  return written;
}

// Applies entries one by one from `begin` up to the first that starts a run
// (or the end), each chain read from the table as the entries before left
// it; returns where it stopped and adds the records written to `written`.
[[gnu::flatten]] inline int64_t apply_outside_runs(const CpuRecordTables& t, const RecordEntries& e,
                                                   int64_t begin, const int64_t* folds,
                                                   int64_t& written) {
  int64_t i = begin;
  for (; i < e.size && !starts_run(e, i, t.capacity); ++i) {
    prefetch_record(t, e, i + kRecordPrefetchDistance);
    const int64_t p = e.prev_slots[i];
    const bool in_range = p < t.capacity;  // else apply_entry appends a row
    written += apply_entry(t, e, i, in_range ? link_at(t.records, p) : 0, folds);
  }
  return i;
}

}  // namespace canary_cpu

// kvcanary::record's bookkeeping: every entry applied as if in entry order
// (an entry may chain through a slot an earlier one wrote), folds[i] being
// entry i's fold; `chains` is scratch of as many values as entries.
inline void record_entries(const CpuRecordTables& t, const EntryColumns& columns,
                           const int64_t* folds, int64_t* chains) {
  using namespace canary_cpu;
  const RecordEntries e(columns);
  int64_t written = 0;
  SlotFilter filter(e.size);
  ChainWindow window;
  for (int64_t i = 0; i < kRecordPrefetchDistance; ++i) prefetch_record(t, e, i);
  for (int64_t i = apply_outside_runs(t, e, 0, folds, written); i < e.size;
       i = apply_outside_runs(t, e, i, folds, written)) {
    form_window(t, e, i, filter, window);
    for (int first_run = 0; first_run < window.num_runs; first_run += kChainLanes) {
      lane_chains(t, e, window, first_run, chains + i);
    }
    written += apply_window(t, e, window, chains + i, folds);
    i = window.end;
  }
  t.counters[kRecordCalls] += 1;
  t.counters[kSlotsRecorded] += written;
}

// The lines the canary reads or writes for entries `span` beside the fold
// (FoldSideWork::lines): each entry's slot's record and, when `owners`, owner
// tag, and its previous slot's record; returns how many it wrote to `out`.
template <typename Int>
int entry_lines(const CpuCanaryTables<Int>& t, const EntryColumns& columns, bool owners,
                SlotSpan span, const void** out) {
  const int64_t* slots = columns.slots();
  const int64_t* prev_slots = columns.prev_slots();
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

}  // namespace kvcanary
