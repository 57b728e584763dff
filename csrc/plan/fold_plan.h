// Host-side validation shared by every backend: turns the op's arguments into
// SourceLayouts, or raises a `kv-canary:` error that says what to change.
#pragma once

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

// How the plans' messages name a view ("source 0", "digest view 1") and what
// a slot of it holds ("token", "unit").
struct ViewName {
  const char* kind;
  int64_t index;
  const char* item;
};

// The paged layout of `view` ([num_pages, page_size, ...]) whose slots hold
// items of its dims [first_item_dim, view.dim()): its data pointer, page and
// slot strides, and an item's dims as its contiguous run (run_bytes) and the
// outer dims around it; read_bytes is left to the caller. Checks that the
// innermost dim is contiguous and that at most kMaxOuterDims others remain.
SourceLayout paged_layout(const Tensor& view, int64_t first_item_dim, const ViewName& name);

// Checks the op's arguments (see the schema in ops.cpp) and lays out each
// source. Never copies a source.
FoldPlan make_fold_plan(const std::vector<Tensor>& sources, const Tensor& slots,
                        const std::vector<int64_t>& read_bytes);

}  // namespace kvcanary
