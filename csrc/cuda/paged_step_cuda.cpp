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
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  for (int64_t g = 0; g < num_groups; ++g) {
    l.groups[g] = plan.groups[g];
  }
  l.num_groups = num_groups;
  l.rows = plan.rows;
  l.positions = plan.positions;
  l.positions_int32 = plan.positions_int32;
  l.input_ids = plan.input_ids;
  l.input_ids_int32 = plan.input_ids_int32;
  l.checks = plan.history;
  l.checks.written = nullptr;
  l.checks.num_written = 0;
  l.checks.deferred = false;
  l.checks.every = a.every;
  l.checks.turn = a.step % a.every;
  l.num_tokens = a.num_tokens;
  l.num_entries = num_groups * a.num_tokens;
  l.block_size = a.block_size;
  l.padding_slot = a.padding_slot;
  l.step = a.step;
  l.phase = a.phase;
  l.capacity = plan.capacity;
  l.records = a.tables.records.mutable_data_ptr<int64_t>();
  l.owner_tags = a.tables.owner_tags.mutable_data_ptr<int64_t>();
  l.counters = a.tables.counters.mutable_data_ptr<int64_t>();
  l.ring = a.tables.ring.mutable_data_ptr<int64_t>();
  l.ring_capacity = a.tables.ring.size(0);
  l.origins = a.origins.mutable_data_ptr<int64_t>();
  l.mailbox = mailbox;
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
  check_whole_step(args.phase);
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  KVCANARY_CHECK_VALUE(num_groups <= kMaxPagedGroups, "paged_step on CUDA takes at most ",
                       kMaxPagedGroups, " KV cache groups, got ", num_groups);
  const int64_t num_entries = num_groups * args.num_tokens;
  check_key_range(num_groups, args.num_reqs, num_entries);
  // The plan found every tensor but the mailbox on the records' device, a
  // CUDA one.
  const Tensor& records = args.tables.records;
  const torch::stable::accelerator::DeviceGuard guard(records.get_device_index());
  const cudaStream_t stream = current_stream(records.get_device_index());
  PagedStepLaunchArgs launch = launch_args(plan, args, mailbox_on_device(args.mailbox, records));
  const int64_t needed = paged_step_scratch_values(num_entries, args.num_reqs, plan.capacity);
  KVCANARY_CHECK_VALUE(args.scratch.numel() >= needed, "paged_step's scratch holds ",
                       args.scratch.numel(), " values; this call on CUDA needs ", needed, " (",
                       num_groups, " groups, ", args.num_tokens, " tokens, ", args.num_reqs,
                       " requests, ", plan.capacity,
                       " slots): size it with torch.ops.kvcanary.paged_step_scratch_size");
  launch.scratch = carve_paged_step_scratch(args.scratch.mutable_data_ptr<int64_t>(), num_entries,
                                            args.num_reqs, plan.capacity);
  const int num_sources = static_cast<int>(plan.fold.sources.size());
  clear_scratch(launch.scratch, plan.capacity, num_sources == 0, stream);
  check_cuda(launch_paged_step(launch, plan.fold.sources.data(), num_sources, stream));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CUDA, m) {
  m.impl("paged_step", TORCH_BOX(&paged_step_op<paged_step_cuda>));
}

}  // namespace kvcanary
