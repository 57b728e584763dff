// The interface between the CUDA canary ops (cuda/canary_cuda.cpp, plain C++)
// and their kernels (cuda/canary_cuda_kernel.cu, compiled by nvcc without
// torch).
#pragma once

#include <cuda_runtime_api.h>

#include "core/canary_records.h"
#include "cuda/fold_cuda.h"

namespace kvcanary {

// The arguments of the record and verify kernels: the canary's tables (Table
// is int64_t for record, which writes the records and owner tags, and const
// int64_t for verify, which reads them), and:
template <typename Table>
struct CanaryLaunchArgs : CanaryTablePointers<Table> {
  // The fold of each entry's slot: the last group of sources (earlier groups,
  // when there are more than kSourcesPerLaunch, were folded into fold.out and
  // fold.continue_chain is set). fold.slots is inputs.slots.
  FoldLaunchArgs fold;
  EntryInputs inputs;
  int64_t padding_slot;  // verify only; -1: none
  bool* flagged;         // verify only: one per entry
};

using RecordLaunchArgs = CanaryLaunchArgs<int64_t>;
using VerifyLaunchArgs = CanaryLaunchArgs<const int64_t>;
static_assert(sizeof(RecordLaunchArgs) <= kMaxLaunchArgBytes,
              "a launch's arguments must fit the limit");

// record: one thread per entry writes its slot's token, position, fold and
// owner; the chain of a run of entries that chain through each other
// (prev_slots[i] == slots[i - 1]) is written in order by the run's first
// thread, so runs (requests) proceed in parallel.
cudaError_t launch_record(const RecordLaunchArgs& args, cudaStream_t stream);

// refold: one thread per entry writes folds[i] into the fold field of the
// record of its slot, where 0 <= slot < capacity.
cudaError_t launch_refold(const EntryInputs& entries, const int64_t* folds, int64_t* records,
                          int64_t capacity, cudaStream_t stream);
cudaError_t launch_verify(const VerifyLaunchArgs& args, cudaStream_t stream);

}  // namespace kvcanary
