// Host-side validation of kvcanary::digest's arguments, shared by its CPU and
// CUDA kernels: DigestViews, or a `kv-canary:` error that says what to change.
#pragma once

#include <optional>
#include <vector>

#include "core/digest_math.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"

namespace kvcanary {

struct DigestPlan {
  std::vector<DigestView> views;
  // Smallest view capacity (num_pages * page_size); -1 when there are no
  // views, since then no slot reads anything.
  int64_t capacity = -1;
  int64_t num_groups = 1;
  // The entries, contiguous and int64, read in memory order; groups not given
  // (every entry in group 0): nullopt.
  Tensor slots;
  Tensor positions;
  std::optional<Tensor> groups;
};

// Points a kernel's view of the entries (a CPU thread's range, a CUDA
// launch's arguments: their members capacity, slots, positions, groups and
// num_groups) at the plan's.
template <typename Entries>
void point_at_entries(const DigestPlan& plan, Entries& out) {
  out.capacity = plan.capacity;
  out.slots = plan.slots.const_data_ptr<int64_t>();
  out.positions = plan.positions.const_data_ptr<int64_t>();
  out.groups = plan.groups.has_value() ? plan.groups->const_data_ptr<int64_t>() : nullptr;
  out.num_groups = plan.num_groups;
}

// Checks the op's arguments (see the schema in ops.cpp) and lays out each
// view. Never copies a view.
DigestPlan make_digest_plan(const std::vector<Tensor>& views, const Tensor& slots,
                            const Tensor& positions, const std::optional<Tensor>& groups,
                            const std::vector<int64_t>& unit_offsets, int64_t num_groups);

// check_bounds: IndexError for the first slot >= the views' capacity, then
// for the first group outside [0, num_groups) of an entry with a slot >= 0.
void check_digest_entries_in_range(const DigestPlan& plan, const IndexSearch& search);

}  // namespace kvcanary
