// How the CUDA ops find the entries their range checks refuse (check_bounds):
// reductions on the device and a host sync, which a CUDA graph cannot capture.
// So while the current stream is capturing they find nothing, and the kernels
// skip such entries without reading them (the canary's report them in its
// ring). The checks and their messages are plan/checks.h's.
#pragma once

#include "plan/checks.h"

namespace kvcanary {

extern const IndexSearch kCudaSearch;

}  // namespace kvcanary
