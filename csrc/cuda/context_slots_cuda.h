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

}  // namespace kvcanary
