// Host-side validation of kvcanary::context_slots's arguments, shared by its
// CPU and CUDA kernels: the ranges' layout, or a `kv-canary:` error that says
// what to change.
#pragma once

#include <cstdint>

#include "core/context_slots.h"
#include "plan/tensors.h"

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

// check_bounds: the checks that read offsets and starts (host pointers to
// num_rows + 1 and num_rows values), with the plan's other sizes.
void check_context_ranges(const ContextRanges& ranges, const int64_t* offsets,
                          const int64_t* starts);

}  // namespace kvcanary
