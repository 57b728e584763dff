// Host-side validation shared by every backend: turns the op's arguments into
// SourceLayouts, or raises a `kv-canary:` error that says what to change.
#pragma once

#include <utility>
#include <vector>

#include "core/fold_math.h"
#include "libtorch/tensors.h"

namespace kvcanary {

struct FoldPlan {
  std::vector<SourceLayout> sources;
  // Smallest source capacity (num_pages * page_size); -1 when there are no
  // sources, since then no slot reads anything.
  int64_t capacity = -1;
};

// Dims [first_dim, view.dim()) of `view` as (size, byte stride) pairs with
// size-1 dims dropped and contiguous neighbours merged, innermost last: a
// token's dims for the fold (first_dim 2), a unit's for the digest (3).
std::vector<std::pair<int64_t, int64_t>> coalesced_dims(const Tensor& view, int64_t first_dim);

// Checks the op's arguments (see the schema in ops.cpp) and lays out each
// source. Never copies a source.
FoldPlan make_fold_plan(const std::vector<Tensor>& sources, const Tensor& slots,
                        const std::vector<int64_t>& read_bytes);

}  // namespace kvcanary
