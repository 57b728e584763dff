// Host-side validation of kvcanary::context_slots's arguments, shared by its
// CPU and CUDA kernels: the ranges' layout, or a `kv-canary:` error that says
// what to change.
#pragma once

#include <cstdint>
#include <optional>

#include "core/context_slots.h"
#include "libtorch/tensors.h"

namespace kvcanary {

struct ContextSlotsPlan {
  // The inputs laid out for the kernels (outputs not yet set).
  ContextRanges ranges;
  // offsets and starts, contiguous and int64 (starts copied when int32).
  Tensor offsets;
  Tensor starts;
};

// Checks what the op's contract (ops.cpp) says of its arguments without reading
// their data: dtypes, shapes, devices, block_size and num_entries.
ContextSlotsPlan make_context_slots_plan(const Tensor& block_table, const Tensor& offsets,
                                         const Tensor& starts, int64_t block_size,
                                         int64_t num_entries, int64_t cut_slot);

// context_slots' outputs, int64 [num_entries] each, uninitialised.
struct ContextSlotsOutputs {
  Tensor slots;
  Tensor positions;
  Tensor prev_slots;
  Tensor rows;
};

// Allocates context_slots' outputs on `device` and points `ranges` at them.
ContextSlotsOutputs new_context_slots_outputs(ContextRanges& ranges, const Device& device);

// check_bounds: the checks that read offsets and starts (host pointers to
// num_rows + 1 and num_rows values), with the plan's other sizes.
void check_context_ranges(const ContextRanges& ranges, const int64_t* offsets,
                          const int64_t* starts);

// kvcanary::verify_context's choice of entries and tokens (ContextChecks),
// with the contiguous tensors it points into.
struct ContextChecksPlan {
  ContextChecks checks{};
  std::optional<Tensor> written;
  std::optional<Tensor> history_row_of;
};

// Checks verify_context's arguments beyond context_slots' without reading
// their data: dtypes, shapes, devices, every and turn.
ContextChecksPlan make_context_checks_plan(const Tensor& block_table, int64_t num_rows,
                                           const std::optional<Tensor>& written,
                                           const std::optional<Tensor>& history,
                                           const std::optional<Tensor>& history_known,
                                           const std::optional<Tensor>& history_rows, int64_t every,
                                           int64_t turn, bool deferred);

// check_bounds: the checks that read written and the history rows (host
// pointers): written ascending, and the history holding each nonempty row's
// positions.
void check_context_checks(const ContextRanges& ranges, const ContextChecks& checks);

}  // namespace kvcanary
