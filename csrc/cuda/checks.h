// The CUDA ops' own checks. The range checks (check_bounds) find the entries
// they refuse with a search on the device (cuda/range_search.h) and a host
// sync, which a CUDA graph cannot capture: so while the current stream is
// capturing kCudaSearch finds nothing, and the kernels skip such entries
// without reading them (the canary's report them in its ring). The checks and their messages are
// plan/checks.h's.
#pragma once

#include <cstdint>

#include "plan/checks.h"

namespace kvcanary {

extern const IndexSearch kCudaSearch;

// fold, record, verify: at most kMaxSlotsPerCall entries per call.
void check_slots_per_call(int64_t num_slots);

}  // namespace kvcanary
