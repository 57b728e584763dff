// Host-side validation of kvcanary::digest's arguments, shared by its CPU and
// CUDA kernels: DigestViews, or a `kv-canary:` error that says what to change.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "core/digest_math.h"

namespace kvcanary {

struct DigestPlan {
  std::vector<DigestView> views;
  // Smallest view capacity (num_pages * page_size); -1 when there are no
  // views, since then no slot reads anything.
  int64_t capacity = -1;
};

// Checks the op's arguments (see the schema in ops.cpp) and lays out each
// view. Never copies a view.
DigestPlan make_digest_plan(at::TensorList views, const at::Tensor& slots,
                            const at::Tensor& positions, const std::optional<at::Tensor>& groups,
                            at::IntArrayRef unit_offsets, int64_t num_groups);

// Raises IndexError naming the group of `groups` (a host array of n) that is
// outside [0, num_groups).
void check_groups_in_range(const int64_t* groups, int64_t n, int64_t num_groups);

[[noreturn]] void fail_group_out_of_range(int64_t group, int64_t num_groups);

}  // namespace kvcanary
