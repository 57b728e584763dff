// Host-side validation of kvcanary::paged_step, shared by its CPU and CUDA
// kernels: every argument checked before anything is written, so a refused
// call changes nothing.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/context_ranges.h"
#include "core/paged_step.h"
#include "libtorch/tensors.h"
#include "plan/canary_plan.h"
#include "plan/fold_plan.h"

namespace kvcanary {

// The op's arguments (the schema in ops.cpp) in two parts. The engine's
// constants, which PagedStep binds once: the canary's sources and tables, each
// KV cache group's block table, slot mapping and attention window, the block
// size and padding slot, and the call's mailbox and scratch.
struct PagedEngineArgs {
  const Tensor& sources_table;
  const std::vector<Tensor>& block_tables;
  const std::vector<Tensor>& slot_mappings;
  const std::vector<int64_t>& sliding_windows;
  const std::vector<int64_t>& chunk_sizes;
  CanaryTables tables;
  const Tensor& origins;  // int64 [ring_capacity, kOriginFields]
  const Tensor& mailbox;  // int64 [kMailboxWords]
  const Tensor& scratch;  // int64 [>= what the backend needs]
  int64_t block_size;
  int64_t padding_slot;
};

// What each step passes: the engine's step buffers and the step's values.
struct PagedCallArgs {
  const Tensor& query_start_loc;
  const Tensor& seq_lens;
  const Tensor& positions;
  const std::optional<Tensor>& input_ids;
  const std::optional<Tensor>& history;
  const std::optional<Tensor>& history_known;
  const std::optional<Tensor>& history_rows;
  int64_t num_reqs;
  int64_t num_tokens;
  int64_t phase;
  int64_t step;
  int64_t every;
  const std::optional<Tensor>& roots;  // int64, one per request: position 0's link
};

struct PagedStepArgs {
  PagedEngineArgs engine;
  PagedCallArgs call;
};

// A checked call: the sources, the canary's capacity, the groups and the
// step's buffers as raw pointers (into the arguments, which are contiguous
// where the kernels need them to be).
struct PagedStepPlan {
  FoldPlan fold;
  int64_t capacity = 0;
  std::vector<PagedGroup> groups;
  PagedStepRows rows{};
  const void* positions = nullptr;  // >= num_tokens
  bool positions_int32 = false;
  const void* input_ids = nullptr;  // >= num_tokens; null: no tokens
  bool input_ids_int32 = false;
  // The token history (history, history_known, history_rows), with
  // written, deferred, every and turn left for each call to set.
  ContextChecks history{};
  const int64_t* roots = nullptr;  // >= num_reqs, request r's root; null: none
};

// A backend's paged_step on the bundled arguments, and the op's signature (the
// schema in ops.cpp), written once: a backend registers
// paged_step_op<its kernel>.
using PagedStepKernel = void (*)(const PagedStepArgs& args);

template <PagedStepKernel kernel>
void paged_step_op(const Tensor& sources_table, const std::vector<Tensor>& block_tables,
                   const std::vector<Tensor>& slot_mappings,
                   const std::vector<int64_t>& sliding_windows,
                   const std::vector<int64_t>& chunk_sizes, const Tensor& query_start_loc,
                   const Tensor& seq_lens, const Tensor& positions,
                   const std::optional<Tensor>& input_ids, const std::optional<Tensor>& history,
                   const std::optional<Tensor>& history_known,
                   const std::optional<Tensor>& history_rows, Tensor& records, Tensor& owner_tags,
                   Tensor& counters, Tensor& ring, Tensor& origins, Tensor& mailbox,
                   Tensor& scratch, int64_t num_reqs, int64_t num_tokens, int64_t block_size,
                   int64_t phase, int64_t step, int64_t every, int64_t padding_slot,
                   const std::optional<Tensor>& roots) {
  kernel({{sources_table,
           block_tables,
           slot_mappings,
           sliding_windows,
           chunk_sizes,
           {records, owner_tags, counters, ring},
           origins,
           mailbox,
           scratch,
           block_size,
           padding_slot},
          {query_start_loc, seq_lens, positions, input_ids, history, history_known, history_rows,
           num_reqs, num_tokens, phase, step, every, roots}});
}

// Checks what the contract says of the arguments without reading their data:
// dtypes, shapes, sizes, devices, the canary's tables, and that the buffers the
// kernels index in place are contiguous.
PagedStepPlan make_paged_step_plan(const PagedStepArgs& args);

// The checks that read query_start_loc and seq_lens (host pointers): each
// request's tokens in order within num_tokens, its context not negative and
// within every group's block table.
void check_paged_step_rows(const PagedStepPlan& plan, const PagedStepArgs& args);

}  // namespace kvcanary
