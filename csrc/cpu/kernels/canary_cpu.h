// The CPU canary's bookkeeping once a call's folds are known (contract:
// docs/spec.md, "The canary records"): record applies its entries in entry
// order, verify checks each task of entries on the thread that folded it.
// Torch-free, portable code: cpu/canary_cpu.cpp compiles it and the
// instruction-set units never include it.
//
// Both wait on the records of random slots more than they compute, so every
// loop requests the lines of the entries kRecordPrefetchDistance ahead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

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

namespace canary_cpu {

// Entries ahead of the one being handled whose lines are requested: the
// records of random slots miss the cache, and a loop over entries does little
// else than wait for them.
constexpr int64_t kRecordPrefetchDistance = 16;

// Every function that prefetches is always inlined: GCC counts a prefetch as
// having no effect and drops the calls of a function that only prefetches.
[[gnu::always_inline]] inline void prefetch_line(const void* address, bool for_write) {
  if (for_write) {
    __builtin_prefetch(address, 1, 3);
  } else {
    __builtin_prefetch(address, 0, 3);
  }
}

// Requests the lines entry i reads and writes, when i is an entry: its slot's
// record and owner tag and its previous slot's record.
template <typename Int>
[[gnu::always_inline]] inline void prefetch_entry(const CpuCanaryTables<Int>& t,
                                                  const EntryInputs& in, int64_t i,
                                                  bool for_write) {
  if (i >= in.num_entries) return;
  const int64_t s = entry_slot(in, i);
  const int64_t p = entry_prev_slot(in, i);
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

// Whether entry i writes its record: a slot and a previous slot in range
// (negative slots are padding; a slot or previous slot past the capacity
// appends a row instead).
inline bool writes_record(const EntryInputs& in, int64_t i, int64_t capacity) {
  const int64_t s = entry_slot(in, i);
  return s >= 0 && s < capacity && entry_prev_slot(in, i) < capacity;
}

// Whether a slot in entries [begin, end) is `slot`.
inline bool slot_among(const EntryInputs& in, int64_t begin, int64_t end, int64_t slot) {
  bool found = false;
  if (in.slots_int32) {
    const auto* slots = static_cast<const int32_t*>(in.slots);
    for (int64_t j = begin; j < end; ++j) found |= slots[j] == slot;
  } else {
    const auto* slots = static_cast<const int64_t*>(in.slots);
    for (int64_t j = begin; j < end; ++j) found |= slots[j] == slot;
  }
  return found;
}

// An input not given: -1 for every entry.
struct MissingInput {};

template <typename T>
int64_t input_at(const void* data, int64_t i) {
  if constexpr (std::is_same_v<T, MissingInput>) {
    return -1;
  } else {
    return static_cast<const T*>(data)[i];
  }
}

// Calls f(T{}) with T the type of an entry input's values (int32_t, int64_t,
// or MissingInput when not given), so that loops over entries read them
// without a test per value.
template <typename F>
decltype(auto) with_input_type(const void* data, bool is_int32, const F& f) {
  if (data == nullptr) return f(MissingInput{});
  if (is_int32) return f(int32_t{});
  return f(int64_t{});
}

// Record's chains, computed side by side.
//
// An entry's chain is the link of its previous slot's record as the entries
// before it left it. Within a run of entries that each chain through the
// slot the entry before wrote (a request's positions: prev_slots[i] ==
// slots[i - 1]), each link is the mix3 of the one before, a serial chain of
// multiplies; the runs of a call are independent of each other but for the
// slots they read. So record takes the entries in windows: a window's runs
// compute their chains kChainLanes at a time, one run per lane, and then the
// window's entries are applied in entry order. Only the first entry of a run
// reads the table, before anything of its window is applied, which is exact
// as long as no earlier entry of the window writes the slot it reads: a run
// whose first entry would read such a slot starts the next window instead.
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
    while ((int64_t{1} << shift_complement_) < bits_) ++shift_complement_;
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
    return (static_cast<uint64_t>(slot) * 0x9E3779B97F4A7C15ull) >> (64 - shift_complement_);
  }
  uint64_t words_[kMaxBits / 64];
  int64_t bits_ = 512;
  int shift_complement_ = 0;
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

// Forms the window that starts at entry `begin` into `w`; the first entry of
// each run has its previous slot's record requested.
inline void form_window(const CpuRecordTables& t, const EntryInputs& in, int64_t begin,
                        SlotFilter& written, ChainWindow& w) {
  w.begin = begin;
  w.num_runs = 0;
  written.clear();
  const int64_t end = std::min(in.num_entries, begin + kWindowEntries);
  bool previous_writes = false;  // whether entry j - 1 is in the window and writes
  int64_t previous_slot = -1;
  int64_t j = begin;
  for (; j < end; ++j) {
    const int64_t s = entry_slot(in, j);
    const int64_t p = entry_prev_slot(in, j);
    const bool writes = s >= 0 && s < t.capacity && p < t.capacity;
    if (writes && previous_writes && p == previous_slot) {
      ++w.runs[w.num_runs - 1].length;
    } else if (writes) {
      if (w.num_runs == kWindowRuns) break;
      if (p >= 0) {
        if (written.may_hold(p) && slot_among(in, begin, j, p)) break;
        prefetch_line(t.records + p * kRecordFields, false);
      }
      w.runs[w.num_runs++] = Run{j, 1};
    }
    if (writes) written.add(s);
    previous_writes = writes;
    previous_slot = s;
  }
  w.end = j;
}

// chains[i - w.begin] = the chain of each entry i of kChainLanes runs of the
// window (fewer at its end) from `first_run` on, their links computed side by
// side: in steps, each as many entries long as the shortest run left, the
// lanes with entries left going together.
template <typename Token, typename Position>
void lane_chains(const CpuRecordTables& t, const EntryInputs& in, const ChainWindow& w,
                 int first_run, int64_t* chains) {
  uint64_t link[kChainLanes];
  int64_t next[kChainLanes];  // each lane's next entry
  int64_t left[kChainLanes];  // and how many it has left
  for (int r = 0; r < kChainLanes; ++r) {
    const bool used = first_run + r < w.num_runs;
    const Run run = used ? w.runs[first_run + r] : Run{w.begin, 0};
    next[r] = run.first;
    left[r] = run.length;
    link[r] = used ? static_cast<uint64_t>(link_at(t.records, entry_prev_slot(in, run.first))) : 0;
  }
  // The link entry i's successor reads: mix3 of the record entry i writes.
  const auto successor_link = [&](uint64_t chain, int64_t i) {
    return mix3<uint64_t>(chain, static_cast<uint64_t>(input_at<Token>(in.tokens, i)),
                          static_cast<uint64_t>(input_at<Position>(in.positions, i)));
  };
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
        if (!last_step || left[r] > steps) link[r] = successor_link(link[r], i);
      }
    }
    for (int r = 0; r < kChainLanes; ++r) {
      if (left[r] == 0) continue;
      next[r] += steps;
      left[r] -= steps;
    }
  }
}

template <typename Token, typename Position>
void window_chains(const CpuRecordTables& t, const EntryInputs& in, const ChainWindow& w,
                   int64_t* chains) {
  for (int first_run = 0; first_run < w.num_runs; first_run += kChainLanes) {
    lane_chains<Token, Position>(t, in, w, first_run, chains);
  }
}

// Applies entry i, whose chain is `chain` when it writes its record; returns
// whether it did.
inline bool apply_entry(const CpuRecordTables& t, const EntryInputs& in, int64_t i, int64_t chain,
                        const int64_t* folds) {
  const int64_t s = entry_slot(in, i);
  if (s < 0) return false;  // padding
  if (s >= t.capacity || entry_prev_slot(in, i) >= t.capacity) {
    int64_t row[kViolationFields];
    out_of_range_row(row, kKindRecord, in, i);
    append_row(t, row);
    return false;
  }
  int64_t* record = t.records + s * kRecordFields;
  record[kToken] = entry_token(in, i);
  record[kPosition] = entry_position(in, i);
  record[kChain] = chain;
  record[kFold] = folds[i];
  t.owner_tags[s] = in.tags != nullptr ? entry_tag(in, i) : -1;
  return true;
}

// Applies the window's entries in entry order; returns the records written.
inline int64_t apply_window(const CpuRecordTables& t, const EntryInputs& in, const ChainWindow& w,
                            const int64_t* chains, const int64_t* folds) {
  int64_t written = 0;
  for (int64_t i = w.begin; i < w.end; ++i) {
    prefetch_entry(t, in, i + kRecordPrefetchDistance, true);
    written += apply_entry(t, in, i, chains[i - w.begin], folds);
  }
  return written;
}

// Whether entry i starts a run of two entries or more (a window pays off).
inline bool starts_run(const CpuRecordTables& t, const EntryInputs& in, int64_t i) {
  return i + 1 < in.num_entries && writes_record(in, i, t.capacity) &&
         writes_record(in, i + 1, t.capacity) && entry_prev_slot(in, i + 1) == entry_slot(in, i);
}

}  // namespace canary_cpu

// kvcanary::record's bookkeeping: every entry applied as if in entry order
// (an entry may chain through a slot an earlier one wrote), folds[i] being
// entry i's fold; `chains` is scratch of in.num_entries values.
inline void record_entries(const CpuRecordTables& t, const EntryInputs& in, const int64_t* folds,
                           int64_t* chains) {
  using namespace canary_cpu;
  int64_t written = 0;
  SlotFilter filter(in.num_entries);
  ChainWindow window;
  for (int64_t i = 0; i < kRecordPrefetchDistance; ++i) prefetch_entry(t, in, i, true);
  // Entries outside runs (a decode step: each its request's next position)
  // are applied one by one, their chains read from the table as the entries
  // before them left it; a run starts a window.
  with_input_type(in.tokens, in.tokens_int32, [&](auto token) {
    with_input_type(in.positions, in.positions_int32, [&](auto position) {
      for (int64_t i = 0; i < in.num_entries;) {
        if (starts_run(t, in, i)) {
          form_window(t, in, i, filter, window);
          window_chains<decltype(token), decltype(position)>(t, in, window, chains + i);
          written += apply_window(t, in, window, chains + i, folds);
          i = window.end;
          continue;
        }
        prefetch_entry(t, in, i + kRecordPrefetchDistance, true);
        const int64_t p = entry_prev_slot(in, i);
        const bool in_range = p < t.capacity;  // else apply_entry appends a row
        written += apply_entry(t, in, i, in_range ? link_at(t.records, p) : 0, folds);
        ++i;
      }
    });
  });
  t.counters[kRecordCalls] += 1;
  t.counters[kSlotsRecorded] += written;
}

// kvcanary::verify's checks of entries [task.begin, task.end), folds[i] being
// entry i's fold: flagged[i] is whether entry i failed a check; returns the
// entries checked (all but padding). Tasks run on any thread, in any order.
inline int64_t verify_task(const CpuVerifyTables& t, const EntryInputs& in, const int64_t* folds,
                           int64_t padding_slot, SlotSpan task, bool* flagged) {
  using namespace canary_cpu;
  int64_t checked = 0;
  for (int64_t i = task.begin; i < task.end; ++i) {
    if (i + kRecordPrefetchDistance < task.end) {
      prefetch_entry(t, in, i + kRecordPrefetchDistance, false);
    }
    const int64_t s = entry_slot(in, i);
    if (s < 0 || s == padding_slot) {
      flagged[i] = false;
      continue;
    }
    ++checked;
    if (s >= t.capacity || entry_prev_slot(in, i) >= t.capacity) {
      flagged[i] = true;
    } else {
      flagged[i] =
          verify_entry(t.records, t.owner_tags, in, i, s, folds[i], padding_slot).reasons != 0;
    }
  }
  return checked;
}

// Requests the lines of the first entries of a verify task (ahead of its
// fold, so that they are there when the task's checks start).
inline void prefetch_verify_task(const CpuVerifyTables& t, const EntryInputs& in, SlotSpan task) {
  const int64_t end = std::min(task.end, task.begin + canary_cpu::kRecordPrefetchDistance);
  for (int64_t i = task.begin; i < end; ++i) canary_cpu::prefetch_entry(t, in, i, false);
}

// kvcanary::verify's rows and counters, once every task is checked: a row for
// each flagged entry, in entry order.
inline void verify_rows(const CpuVerifyTables& t, const EntryInputs& in, const int64_t* folds,
                        int64_t padding_slot, const bool* flagged, int64_t checked) {
  for (int64_t i = 0; i < in.num_entries; ++i) {
    if (!flagged[i]) continue;
    int64_t row[kViolationFields];
    const int64_t s = entry_slot(in, i);
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
