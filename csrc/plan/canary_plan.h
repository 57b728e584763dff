// Host-side validation of kvcanary::record and kvcanary::verify, shared by the
// CPU and CUDA backends: the per-entry inputs and the canary's tables are
// checked before anything is written, so a refused call changes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "core/canary_records.h"
#include "plan/checks.h"

namespace kvcanary {

// The entry inputs of one call as raw pointers, with the contiguous tensors
// they point into kept alive.
struct EntryPlan {
  EntryInputs inputs{};
  std::vector<at::Tensor> keep_alive;
  at::Tensor slots;       // contiguous
  at::Tensor prev_slots;  // contiguous; undefined when not given
};

EntryPlan make_entry_plan(const at::Tensor& slots, const std::optional<at::Tensor>& positions,
                          const std::optional<at::Tensor>& tokens,
                          const std::optional<at::Tensor>& prev_slots,
                          const std::optional<at::Tensor>& tags);

// Checks the canary's tables: records int64 [capacity, 4], owner_tags int64
// [capacity], counters int64 [kNumCounters], ring int64 [ring_capacity, 8]
// (when given), all contiguous and on the slots' device, and that the sources
// hold every slot of the canary. Returns the capacity.
int64_t check_canary_tables(const at::Tensor& records, const at::Tensor& owner_tags,
                            const at::Tensor& counters, const at::Tensor* ring,
                            const at::Tensor& slots, int64_t sources_capacity);

// check_bounds: IndexError for the first entry of slots, then of prev_slots
// (when given), that is >= the canary's capacity.
void check_entries_in_range(const EntryPlan& entries, int64_t capacity, const IndexSearch& search);

}  // namespace kvcanary
