// The CPU fold as a building block of the other CPU kernels (record, verify):
// they fold their slots with it and then apply their own bookkeeping.
#pragma once

#include <cstdint>

#include "cpu/kernels/fold_cpu.h"
#include "libtorch/tensors.h"
#include "plan/fold_plan.h"

namespace kvcanary {

// out[i] = the fold of flat_slots[i] (contiguous int32 or int64) over the
// plan's sources, on torch's threads; slots outside [0, plan.capacity) give 0.
// `side` is the caller's work beside the fold (cpu/kernels/fold_cpu.h).
void fold_slots_cpu(const FoldPlan& plan, const Tensor& flat_slots, int64_t* out,
                    const FoldSideWork& side = {});

// The same over num_slots values at `slots` (int32 when slots_int32), which a
// kernel has planned in host memory.
void fold_slot_values_cpu(const FoldPlan& plan, const void* slots, bool slots_int32,
                          int64_t num_slots, int64_t* out, const FoldSideWork& side = {});

}  // namespace kvcanary
