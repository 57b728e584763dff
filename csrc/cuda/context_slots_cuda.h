// The interface between the CUDA context_slots op (cuda/context_slots_cuda.cpp,
// plain C++) and its kernel (cuda/context_slots_cuda_kernel.cu, compiled by
// nvcc without the torch headers).
#pragma once

#include <cuda_runtime_api.h>

#include "core/context_slots.h"

namespace kvcanary {

// One thread per entry of `ranges` (device pointers), each finding its row by
// a binary search in the offsets.
cudaError_t launch_context_slots(const ContextRanges& ranges, cudaStream_t stream);

// verify_context's entries: each written and then chosen (select_entry), with
// its token in tokens (null: none); *waiting (zeroed here) counts those left
// for the deferred call.
cudaError_t launch_context_checks(const ContextRanges& ranges, const ContextChecks& checks,
                                  int64_t* tokens, int64_t* waiting, cudaStream_t stream);

}  // namespace kvcanary
