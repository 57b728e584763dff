// kvcanary::paged_step (its contract is in ops.cpp): a paged serving step's
// canary work for all its KV cache groups in one call, read from the engine's
// own step buffers. What every backend shares: the phases, the mailbox and
// origin layouts, and each row's and group's values. Torch-free.
#pragma once

#include <cstdint>

#include "core/context_ranges.h"
#include "core/indices.h"

namespace kvcanary {

// Where a call stands in the step. A backend whose write to a slot changes
// its block's other slots (blocks_packed) verifies those blocks before the
// forward rewrites them, so it calls twice; any other calls once, after.
enum PagedStepPhase : int64_t {
  kWholeStep = 0,      // after the forward: record, then verify the context
  kBeforeForward = 1,  // verify the context the forward does not write, and the tails
  kAfterForward = 2,   // record, refold the blocks written, verify the context written
  kNumPhases = 3,
};

// The mailbox: a few int64 words each call writes last, which the host reads
// without a copy (pinned host memory on CUDA, plain memory on the CPU).
enum MailboxWord : int {
  kMailStep = 0,        // the step of the last call that finished
  kMailPhase = 1,       // and its phase
  kMailViolations = 2,  // the violations counter after it
  kMailRingStart = 3,   // the ring's write index when the step's first call began
  kMailboxWords = 4,
};

// Each ring row's origin, at the ring row's index: the step, KV cache group
// and row (request) of the entry that wrote it. Only paged_step writes them.
enum OriginField : int {
  kOriginStep = 0,
  kOriginGroup = 1,
  kOriginRow = 2,
  kOriginFields = 3,
};

// One KV cache group's view of the step: its block table (row r for request
// r) and slot mapping (token t's slot), and what it attends to.
struct PagedGroup : BlockTable {
  const void* slot_mapping;  // >= num_tokens entries, contiguous
  bool slot_mapping_int32;
  int64_t sliding_window;  // > 0: a sliding window of that many tokens
  int64_t chunk_size;      // > 0: chunked local attention
};

// The step's shared buffers, as the engine keeps them: query_start_loc
// (request r runs tokens [q[r], q[r + 1])), seq_lens (its tokens once the
// step is done), each token's position and input id.
struct PagedStepRows {
  const void* query_start_loc;  // >= num_reqs + 1
  bool query_start_loc_int32;
  const void* seq_lens;  // >= num_reqs
  bool seq_lens_int32;
  int64_t num_reqs;
};

KVC_HOST_DEVICE int64_t scheduled_of(const PagedStepRows& s, int64_t r) {
  return load_index(s.query_start_loc, s.query_start_loc_int32, r + 1) -
         load_index(s.query_start_loc, s.query_start_loc_int32, r);
}

// The tokens request r has in the cache before the step.
KVC_HOST_DEVICE int64_t computed_of(const PagedStepRows& s, int64_t r) {
  return load_index(s.seq_lens, s.seq_lens_int32, r) - scheduled_of(s, r);
}

// The first position a group attends to with `computed` tokens in the cache:
// vLLM frees the blocks wholly below it and may reuse them (its
// SlidingWindowManager and ChunkedLocalAttentionManager); 0 for full
// attention.
KVC_HOST_DEVICE int64_t first_attended(const PagedGroup& g, int64_t computed) {
  if (g.sliding_window > 0) {
    const int64_t first = computed - g.sliding_window + 1;
    return first > 0 ? first : 0;
  }
  if (g.chunk_size > 0) {
    return computed / g.chunk_size * g.chunk_size;
  }
  return 0;
}

// The slot of position p of row r in the group's block table; -1 where p is
// negative, past the table, or the table holds a negative block there.
KVC_HOST_DEVICE int64_t group_slot(const PagedGroup& g, int64_t block_size, int64_t r, int64_t p) {
  if (p < 0 || p / block_size >= g.max_blocks) {
    return -1;
  }
  const int64_t block =
      load_index(g.block_table, g.table_int32, r * g.row_stride + p / block_size * g.block_stride);
  return block < 0 ? -1 : block * block_size + p % block_size;
}

// The group's block table as the walk over a context range reads it (the
// ranges, the cut slot and the outputs left for the caller to set).
KVC_HOST_DEVICE ContextRanges group_ranges(const PagedGroup& g, int64_t block_size) {
  ContextRanges c{};
  static_cast<BlockTable&>(c) = g;
  c.block_size = block_size;
  c.cut_slot = -1;
  return c;
}

}  // namespace kvcanary
