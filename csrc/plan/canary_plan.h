// Host-side validation of kvcanary::record and kvcanary::verify, shared by the
// CPU and CUDA backends: the per-entry inputs and the canary's tables are
// checked before anything is written, so a refused call changes nothing.
#pragma once

#include <torch/csrc/stable/library.h>

#include <optional>
#include <type_traits>
#include <vector>

#include "core/canary_records.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"
#include "plan/fold_plan.h"

namespace kvcanary {

// The inputs of a record or verify call, as the op receives them (the schema
// in ops.cpp): the sources folded at each entry's slot (a Tensor[] or a bound
// table), and the per-entry inputs.
struct CanaryInputs {
  SourcesArg sources;
  const Tensor& slots;
  const std::optional<Tensor>& positions;
  const std::optional<Tensor>& tokens;
  const std::optional<Tensor>& prev_slots;
  const std::optional<Tensor>& tags;
  const std::optional<Tensor>& roots;  // int64, one per slot: first positions' links
};

// The canary's tables. record writes every one; verify reads records and
// owner_tags and writes counters and ring.
struct CanaryTables {
  const Tensor& records;     // int64 [capacity, kRecordFields]
  const Tensor& owner_tags;  // int64 [capacity]
  const Tensor& counters;    // int64 [kNumCounters]
  const Tensor& ring;        // int64 [ring_capacity, kViolationFields]
};

// The pointer a kernel gets to one of the canary's tables: writable where it
// writes (record), read-only where it only reads (verify).
template <typename Int>
Int* table_data(const Tensor& table) {
  if constexpr (std::is_const_v<Int>) {
    return table.const_data_ptr<int64_t>();
  } else {
    return table.mutable_data_ptr<int64_t>();
  }
}

// Points a kernel's view of the canary's tables (a CPU kernel's tables, a
// CUDA launch's arguments) at `tables`.
template <typename Int>
void point_at_tables(const CanaryTables& tables, int64_t capacity, CanaryTablePointers<Int>& out) {
  out.records = table_data<Int>(tables.records);
  out.owner_tags = table_data<Int>(tables.owner_tags);
  out.counters = tables.counters.mutable_data_ptr<int64_t>();
  out.ring = tables.ring.mutable_data_ptr<int64_t>();
  out.ring_capacity = tables.ring.size(0);
  out.capacity = capacity;
}

// The same as a new value of a struct that holds nothing else.
template <typename Pointers>
Pointers table_pointers(const CanaryTables& tables, int64_t capacity) {
  Pointers out{};
  point_at_tables(tables, capacity, out);
  return out;
}

// A backend's record and verify on the bundled arguments.
using RecordKernel = void (*)(const CanaryInputs& in, const CanaryTables& tables,
                              bool check_bounds);
using VerifyKernel = Tensor (*)(const CanaryInputs& in, const CanaryTables& tables,
                                int64_t padding_slot, bool check_bounds);

// The ops' C++ signatures (the schema in ops.cpp), written once: a backend
// registers record_op<its record> and verify_op<its verify>, and their bound
// overloads record_bound_op<its record> and verify_bound_op<its verify>.
template <RecordKernel record>
void record_op(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes,
               const Tensor& slots, const std::optional<Tensor>& positions,
               const std::optional<Tensor>& tokens, const std::optional<Tensor>& prev_slots,
               const std::optional<Tensor>& tags, Tensor& records, Tensor& owner_tags,
               Tensor& counters, Tensor& ring, bool check_bounds,
               const std::optional<Tensor>& roots) {
  record({{&sources, &read_bytes}, slots, positions, tokens, prev_slots, tags, roots},
         {records, owner_tags, counters, ring}, check_bounds);
}

template <RecordKernel record>
void record_bound_op(const Tensor& sources_table, const Tensor& slots,
                     const std::optional<Tensor>& positions, const std::optional<Tensor>& tokens,
                     const std::optional<Tensor>& prev_slots, const std::optional<Tensor>& tags,
                     Tensor& records, Tensor& owner_tags, Tensor& counters, Tensor& ring,
                     bool check_bounds, const std::optional<Tensor>& roots) {
  record({{.table = &sources_table}, slots, positions, tokens, prev_slots, tags, roots},
         {records, owner_tags, counters, ring}, check_bounds);
}

template <VerifyKernel verify>
Tensor verify_op(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes,
                 const Tensor& slots, const std::optional<Tensor>& positions,
                 const std::optional<Tensor>& tokens, const std::optional<Tensor>& prev_slots,
                 const std::optional<Tensor>& tags, const Tensor& records, const Tensor& owner_tags,
                 Tensor& counters, Tensor& ring, int64_t padding_slot, bool check_bounds,
                 const std::optional<Tensor>& roots) {
  return verify({{&sources, &read_bytes}, slots, positions, tokens, prev_slots, tags, roots},
                {records, owner_tags, counters, ring}, padding_slot, check_bounds);
}

template <VerifyKernel verify>
Tensor verify_bound_op(const Tensor& sources_table, const Tensor& slots,
                       const std::optional<Tensor>& positions, const std::optional<Tensor>& tokens,
                       const std::optional<Tensor>& prev_slots, const std::optional<Tensor>& tags,
                       const Tensor& records, const Tensor& owner_tags, Tensor& counters,
                       Tensor& ring, int64_t padding_slot, bool check_bounds,
                       const std::optional<Tensor>& roots) {
  return verify({{.table = &sources_table}, slots, positions, tokens, prev_slots, tags, roots},
                {records, owner_tags, counters, ring}, padding_slot, check_bounds);
}

// A backend's refold on either form of sources, and the op's two signatures.
using RefoldKernel = void (*)(const SourcesArg& sources, const Tensor& slots, Tensor& records,
                              bool check_bounds);

template <RefoldKernel refold>
void refold_op(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes,
               const Tensor& slots, Tensor& records, bool check_bounds) {
  refold({&sources, &read_bytes}, slots, records, check_bounds);
}

template <RefoldKernel refold>
void refold_bound_op(const Tensor& sources_table, const Tensor& slots, Tensor& records,
                     bool check_bounds) {
  refold({.table = &sources_table}, slots, records, check_bounds);
}

// A backend's registration of the canary ops: each of record, verify and
// refold in its Tensor[] form and its bound overload.
template <RecordKernel record, VerifyKernel verify, RefoldKernel refold, typename Library>
void register_canary_ops(Library& m) {
  m.impl("record", TORCH_BOX(&record_op<record>));
  m.impl("verify", TORCH_BOX(&verify_op<verify>));
  m.impl("refold", TORCH_BOX(&refold_op<refold>));
  m.impl("record.bound", TORCH_BOX(&record_bound_op<record>));
  m.impl("verify.bound", TORCH_BOX(&verify_bound_op<verify>));
  m.impl("refold.bound", TORCH_BOX(&refold_bound_op<refold>));
}

// The per-entry inputs of one call as raw pointers, with the contiguous
// tensors they point into kept alive.
struct EntryPlan {
  EntryInputs inputs{};
  std::vector<Tensor> keep_alive;
  Tensor slots;                      // contiguous
  std::optional<Tensor> prev_slots;  // contiguous; nullopt when not given
};

// A checked call: its sources laid out, its entries, and the canary's
// capacity.
struct CanaryPlan {
  FoldPlan fold;
  int64_t capacity = 0;
  EntryPlan entries;
};

// Checks the canary's tables (int64, contiguous, on the slots' device) and
// that the sources hold every slot of the canary; returns its capacity.
int64_t check_canary_tables(const CanaryTables& tables, const Tensor& slots,
                            int64_t sources_capacity);

// Checks the sources, the canary's tables (int64, contiguous, on the slots'
// device, of one capacity that the sources hold) and the per-entry inputs.
CanaryPlan make_canary_plan(const CanaryInputs& in, const CanaryTables& tables);

// refold's checks: the sources, the records table and the slots.
CanaryPlan make_refold_plan(const SourcesArg& sources, const Tensor& slots, const Tensor& records);

// check_bounds: IndexError for the first entry of slots, then of prev_slots
// (when given), that is >= the canary's capacity.
void check_entries_in_range(const CanaryPlan& plan, const IndexSearch& search);

}  // namespace kvcanary
