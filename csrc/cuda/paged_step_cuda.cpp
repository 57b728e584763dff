// CUDA backend of kvcanary::paged_step: the shared argument checks, then the
// kernels' launches (cuda/paged_step_cuda_kernel.cu). The host reads no device
// value and never waits for the device, and the launches are the same for any
// device values (their grids follow num_reqs, num_tokens, the groups and the
// capacity), so the call can be captured in a CUDA graph. The kernels work in
// the op's scratch tensor, which the caller allocates once
// (cuda/paged_step_scratch.h): a call allocates nothing.
#include "cuda/paged_step_cuda.h"

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cuda/stream.h"
#include "libtorch/tensors.h"
#include "plan/checks.h"
#include "plan/paged_step_plan.h"

namespace kvcanary {
namespace {

// Phases 1 and 2 split the step for backends whose write to a slot changes
// its block's others; CUDA's caches are not such, so it takes the whole step.
void check_whole_step(int64_t phase) {
  KVCANARY_CHECK_VALUE(phase == kWholeStep, "paged_step phase ", phase,
                       " is for block-packed CPU backends; on CUDA call phase 0 (the whole "
                       "step, after the forward)");
}

// The record keys, (group * num_reqs + rank) * entries + entry, fit int64.
void check_key_range(int64_t num_groups, int64_t num_reqs, int64_t num_entries) {
  const int64_t most = std::numeric_limits<int64_t>::max();
  const bool fits = num_entries == 0 || num_groups * num_reqs + 1 <= most / num_entries;
  KVCANARY_CHECK_VALUE(fits, "paged_step on CUDA takes groups * num_reqs * groups * num_tokens ",
                       "below 2**63, got ", num_groups, " groups, ", num_reqs, " requests and ",
                       num_entries / num_groups, " tokens");
}

// The mailbox's address on the device: a CUDA tensor's own, or the device
// view of pinned host memory (which the device writes through unified
// addressing); pageable host memory is refused.
int64_t* mailbox_on_device(const Tensor& mailbox, const Tensor& records) {
  int64_t* host = mailbox.mutable_data_ptr<int64_t>();
  if (mailbox.device() == records.device()) {
    return host;
  }
  KVCANARY_CHECK_VALUE(mailbox.device().type() == DeviceType::CPU, "the canary's mailbox is on ",
                       device_of(mailbox), " but its records are on ", device_of(records),
                       "; pass pinned host memory (or the records' device)");
  void* device = nullptr;
  const cudaError_t error = cudaHostGetDevicePointer(&device, host, 0);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error the lookup left
  }
  KVCANARY_CHECK_VALUE(error == cudaSuccess && device != nullptr,
                       "the canary's mailbox is host memory that is not pinned; on CUDA pass "
                       "it pinned (torch.empty(4, dtype=torch.int64, pin_memory=True))");
  return static_cast<int64_t*>(device);
}

PagedStepLaunchArgs launch_args(const PagedStepPlan& plan, const PagedStepArgs& a,
                                int64_t* mailbox) {
  PagedStepLaunchArgs l{};
  PagedEngineLaunch& e = l.engine;
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  for (int64_t g = 0; g < num_groups; ++g) {
    e.groups[g] = plan.groups[g];
  }
  e.num_groups = num_groups;
  e.block_size = a.engine.block_size;
  e.padding_slot = a.engine.padding_slot;
  point_at_tables(a.engine.tables, plan.capacity, e);
  e.origins = a.engine.origins.mutable_data_ptr<int64_t>();
  e.mailbox = mailbox;
  PagedCallLaunch& c = l.call;
  c.rows = plan.rows;
  c.positions = plan.positions;
  c.positions_int32 = plan.positions_int32;
  c.input_ids = plan.input_ids;
  c.input_ids_int32 = plan.input_ids_int32;
  c.checks = plan.history;
  c.checks.written = nullptr;
  c.checks.num_written = 0;
  c.checks.deferred = false;
  c.checks.every = a.call.every;
  c.checks.turn = a.call.step % a.call.every;
  c.num_tokens = a.call.num_tokens;
  c.num_entries = num_groups * a.call.num_tokens;
  c.step = a.call.step;
  c.phase = a.call.phase;
  c.roots = plan.roots;
  return l;
}

// Sets what the kernels expect of the scratch before they run: no slot
// claimed (-1) or marked, the words zero, and the fold of no source (0).
void clear_scratch(const PagedStepScratch& s, int64_t capacity, bool no_sources,
                   cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(s.writers, 0xff, capacity * sizeof(int64_t), stream));
  check_cuda(cudaMemsetAsync(s.marked, 0, capacity, stream));
  check_cuda(cudaMemsetAsync(s.words, 0, kScratchWords * sizeof(int64_t), stream));
  if (no_sources) {
    check_cuda(cudaMemsetAsync(s.folds, 0, capacity * sizeof(int64_t), stream));
  }
}

void paged_step_cuda(const PagedStepArgs& args) {
  const PagedStepPlan plan = make_paged_step_plan(args);
  check_whole_step(args.call.phase);
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  KVCANARY_CHECK_VALUE(num_groups <= kMaxPagedGroups, "paged_step on CUDA takes at most ",
                       kMaxPagedGroups, " KV cache groups, got ", num_groups);
  const int64_t num_entries = num_groups * args.call.num_tokens;
  check_key_range(num_groups, args.call.num_reqs, num_entries);
  // The plan found every tensor but the mailbox on the records' device, a
  // CUDA one.
  const Tensor& records = args.engine.tables.records;
  const torch::stable::accelerator::DeviceGuard guard(records.get_device_index());
  const cudaStream_t stream = current_stream(records.get_device_index());
  PagedStepLaunchArgs launch =
      launch_args(plan, args, mailbox_on_device(args.engine.mailbox, records));
  const int64_t needed = paged_step_scratch_values(num_entries, args.call.num_reqs, plan.capacity);
  KVCANARY_CHECK_VALUE(args.engine.scratch.numel() >= needed, "paged_step's scratch holds ",
                       args.engine.scratch.numel(), " values; this call on CUDA needs ", needed,
                       " (", num_groups, " groups, ", args.call.num_tokens, " tokens, ",
                       args.call.num_reqs, " requests, ", plan.capacity,
                       " slots): size it with torch.ops.kvcanary.paged_step_scratch_size");
  launch.scratch = carve_paged_step_scratch(args.engine.scratch.mutable_data_ptr<int64_t>(),
                                            num_entries, args.call.num_reqs, plan.capacity);
  const int num_sources = static_cast<int>(plan.fold.sources.size());
  clear_scratch(launch.scratch, plan.capacity, num_sources == 0, stream);
  check_cuda(launch_paged_step(launch, plan.fold.sources.data(), num_sources, stream));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  m.impl("paged_step", TORCH_BOX(&paged_step_op<paged_step_cuda>));
}

}  // namespace kvcanary
