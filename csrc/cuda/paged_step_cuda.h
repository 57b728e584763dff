// The interface between the CUDA op kvcanary::paged_step (cuda/paged_step_cuda.cpp,
// plain C++) and its kernels (cuda/paged_step_cuda_kernel.cu, compiled by nvcc
// without torch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/canary_records.h"
#include "core/context_ranges.h"
#include "core/fold_math.h"
#include "core/paged_step.h"
#include "cuda/launch_limits.h"
#include "cuda/paged_step_scratch.h"

namespace kvcanary {

// What the kernels read of the engine's constants (PagedEngineArgs): the
// canary's tables, the KV cache groups, the block size and the padding slot.
struct PagedEngineLaunch : CanaryTablePointers<int64_t> {
  PagedGroup groups[kMaxPagedGroups];
  int64_t num_groups;
  int64_t block_size;
  int64_t padding_slot;
  int64_t* origins;
  int64_t* mailbox;  // device-visible address of the mailbox
};

// What the kernels read of one call (PagedCallArgs): the step's buffers and
// values.
struct PagedCallLaunch {
  PagedStepRows rows;
  const void* positions;
  bool positions_int32;
  const void* input_ids;  // null: no tokens
  bool input_ids_int32;
  ContextChecks checks;  // the history, every and turn; nothing written
  int64_t num_tokens;
  int64_t num_entries;  // num_groups * num_tokens
  int64_t step;
  int64_t phase;
  const int64_t* roots;  // >= num_reqs, request r's root; null: none
};

struct PagedStepLaunchArgs {
  PagedEngineLaunch engine;
  PagedCallLaunch call;
  PagedStepScratch scratch;  // carved from the engine's scratch for this call's sizes
};
static_assert(sizeof(PagedStepLaunchArgs) <= kMaxLaunchArgBytes,
              "a launch's arguments must fit the limit");

// Phase 0 of paged_step: records every group's written tokens, then verifies
// every group's context, then writes the mailbox; a fixed sequence of
// launches on `stream` (their number depends on num_sources alone).
cudaError_t launch_paged_step(const PagedStepLaunchArgs& args, const SourceLayout* sources,
                              int num_sources, cudaStream_t stream);

}  // namespace kvcanary
