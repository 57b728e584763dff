// CUDA backend of kvcanary::context_slots: argument checks and the launch (the
// kernel is in cuda/context_slots_cuda_kernel.cu).
#include "cuda/context_slots_cuda.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <tuple>

#include "cuda/checks.h"
#include "cuda/stream.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"
#include "plan/context_slots_plan.h"

namespace kvcanary {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> context_slots_cuda(
    const Tensor& block_table, const Tensor& offsets, const Tensor& starts, int64_t block_size,
    int64_t num_entries, int64_t cut_slot, bool check_bounds) {
  ContextSlotsPlan plan =
      make_context_slots_plan(block_table, offsets, starts, block_size, num_entries, cut_slot);
  // The plan found every tensor on block_table's device, a CUDA one.
  const torch::stable::accelerator::DeviceGuard guard(block_table.get_device_index());
  const cudaStream_t stream = current_stream(block_table.get_device_index());
  ContextRanges& c = plan.ranges;
  // The checks read offsets and starts on the host, which a CUDA graph cannot
  // capture: while one is captured the kernel's safe results stand instead.
  if (check_bounds) {
    check_context_ranges_on_host(c, block_table.get_device_index());
  }
  ContextSlotsOutputs out = new_context_slots_outputs(c, block_table.device());
  check_cuda(launch_context_slots(c, stream));
  return {out.slots, out.positions, out.prev_slots, out.rows};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  m.impl("context_slots", TORCH_BOX(&context_slots_cuda));
}

}  // namespace kvcanary
