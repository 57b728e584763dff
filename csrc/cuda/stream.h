// What the CUDA launchers take from torch's CUDA side without linking it: the
// current stream of a device, and CUDA errors raised as C++ exceptions.
//
// This library loads only under a CUDA build of torch (torch_kvcanary/ops.py)
// but links nothing of libtorch_cuda, whose stable-ABI function that gives the
// current stream (aoti_torch_get_current_cuda_stream) is looked up once, at
// the first call, in the libtorch_cuda that torch loaded. The CUDA runtime is
// linked in statically; a stream is the driver's, so torch's streams serve it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvcanary {

// torch's current stream on CUDA device `device_index`.
cudaStream_t current_stream(int32_t device_index);

// Whether a CUDA graph is being captured on `stream`.
bool capturing(cudaStream_t stream);

// Throws std::runtime_error("kv-canary: CUDA error ...") unless `error` is
// cudaSuccess.
void check_cuda(cudaError_t error);

}  // namespace kvcanary
