// Host-side validation shared by every backend: turns the op's arguments into
// SourceLayouts, or raises a `kv-canary:` error that says what to change.
#pragma once

#include <span>
#include <vector>

#include "core/fold_math.h"
#include "libtorch/tensors.h"

namespace kvcanary {

struct FoldPlan {
  // The layouts a call folds: `owned` when the call passed its sources as a
  // Tensor[], a bound table's rows (plan/bound_sources.h) otherwise. Moving a
  // plan keeps `sources` valid; copying one would not, so it is not copyable.
  std::vector<SourceLayout> owned;
  std::span<const SourceLayout> sources;
  // Smallest source capacity (num_pages * page_size); -1 when there are no
  // sources, since then no slot reads anything.
  int64_t capacity = -1;

  FoldPlan() = default;
  FoldPlan(FoldPlan&&) = default;
  FoldPlan& operator=(FoldPlan&&) = default;
  FoldPlan(const FoldPlan&) = delete;
  FoldPlan& operator=(const FoldPlan&) = delete;
};

// The sources of a call as the op received them: a Tensor[] with one
// read_bytes each, or (`table` set) a table made by bind_sources.
struct SourcesArg {
  const std::vector<Tensor>* views = nullptr;
  const std::vector<int64_t>* read_bytes = nullptr;
  const Tensor* table = nullptr;
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

// Checks `sources` and read_bytes (see fold's schema in ops.cpp) and lays out
// each source, all on `slots`' device or, without slots (bind_sources), on
// source 0's. Never copies a source.
FoldPlan lay_out_sources(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes,
                         const Tensor* slots);

// Checks the op's arguments (see the schema in ops.cpp) and lays out each
// source. Never copies a source.
FoldPlan make_fold_plan(const std::vector<Tensor>& sources, const Tensor& slots,
                        const std::vector<int64_t>& read_bytes);

// make_fold_plan of a Tensor[] call, or the plan of a bound table
// (plan/bound_sources.h) for the slots' device.
FoldPlan make_fold_plan(const SourcesArg& sources, const Tensor& slots);

// A backend's fold on either form of sources, and the op's two signatures
// (the schema in ops.cpp): a backend registers fold_op<its fold> and
// fold_bound_op<its fold>.
using FoldKernel = Tensor (*)(const SourcesArg& sources, const Tensor& slots, bool check_bounds);

template <FoldKernel fold>
Tensor fold_op(const std::vector<Tensor>& sources, const Tensor& slots,
               const std::vector<int64_t>& read_bytes, bool check_bounds) {
  return fold({&sources, &read_bytes}, slots, check_bounds);
}

template <FoldKernel fold>
Tensor fold_bound_op(const Tensor& sources_table, const Tensor& slots, bool check_bounds) {
  return fold({.table = &sources_table}, slots, check_bounds);
}

}  // namespace kvcanary
