// Reading the ops' index inputs (slots, positions, block tables, token
// histories: int32 or int64). Torch-free, shared by the CPU and CUDA kernels.
#pragma once

#include <cstdint>

#include "core/fold_math.h"

namespace kvcanary {

// Element `at` (in elements, any strides already applied) of an index
// tensor's data, int32 when is_int32, else int64.
KVC_HOST_DEVICE int64_t load_index(const void* data, bool is_int32, int64_t at) {
  return is_int32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[at])
                  : static_cast<const int64_t*>(data)[at];
}

}  // namespace kvcanary
