// CUDA kernels of kvcanary::record and kvcanary::verify: each folds its
// entries' slots with the fold's warp code, then applies or checks the records
// in the same launch.
#include "cuda/canary_cuda.h"
#include "cuda/fold_cuda_warp.cuh"
#include "cuda/ring_cuda.cuh"

namespace kvcanary {
namespace {

// Appends a violation row (cuda/ring_cuda.cuh).
template <typename Table>
__device__ void append_row(const CanaryLaunchArgs<Table>& a, const int64_t* row) {
  const int64_t index = claim_ring_row(a.counters, a.ring_capacity);
  if (index >= 0) {
    write_ring_row(a.ring, index, row);
  }
}

// Whether entry i is recorded: a slot and previous slot in range.
__device__ __forceinline__ bool recordable(const RecordLaunchArgs& a, int64_t i) {
  const int64_t s = entry_slot(a.inputs, i);
  return s >= 0 && s < a.capacity && entry_prev_slot(a.inputs, i) < a.capacity;
}

// Whether recorded entry i chains through entry i - 1 of the same call.
__device__ __forceinline__ bool continues_run(const RecordLaunchArgs& a, int64_t i) {
  if (i == 0) {
    return false;
  }
  const int64_t p = entry_prev_slot(a.inputs, i);
  return p >= 0 && p == entry_slot(a.inputs, i - 1) && recordable(a, i - 1);
}

// The first entry of a run writes the chain of every entry of the run.
__device__ void write_run_chain(const RecordLaunchArgs& a, int64_t first) {
  int64_t chain = entry_link(a.records, a.inputs, first, entry_prev_slot(a.inputs, first));
  a.records[entry_slot(a.inputs, first) * kRecordFields + kChain] = chain;
  for (int64_t j = first + 1; j < a.inputs.num_entries && recordable(a, j) && continues_run(a, j);
       ++j) {
    chain = static_cast<int64_t>(mix3<uint64_t>(
        static_cast<uint64_t>(chain), static_cast<uint64_t>(entry_token(a.inputs, j - 1)),
        static_cast<uint64_t>(entry_position(a.inputs, j - 1))));
    a.records[entry_slot(a.inputs, j) * kRecordFields + kChain] = chain;
  }
}

// Adds the warp's count of `flag` to a counter (lane 0 adds it).
__device__ __forceinline__ void count_warp(int64_t* counter, bool flag) {
  const int count = __popc(__ballot_sync(kFullMask, flag));
  if (threadIdx.x % kWarpSize == 0 && count > 0) {
    atomicAdd(as_counter(counter), static_cast<unsigned long long>(count));
  }
}

// One thread's entry: its index, whether it is in the batch, its slot (-1
// past the batch) and the fold of that slot (0 where not live).
struct ThreadEntry {
  int64_t i;
  bool in_batch;
  int64_t slot;
  int64_t fold;
};

// Thread 0 counts the call, and each thread folds its entry's slot (every
// lane of a warp must take part). Returns false for a warp wholly past the
// batch.
template <typename Table>
__device__ __forceinline__ bool start_entry(const CanaryLaunchArgs<Table>& a, Counter calls,
                                            ulonglong2* tile, ThreadEntry& e) {
  const int lane = threadIdx.x % kWarpSize;
  e.i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (e.i == 0) {
    atomicAdd(as_counter(a.counters + calls), 1ull);
  }
  if (e.i - lane >= a.inputs.num_entries) {
    return false;
  }
  e.in_batch = e.i < a.inputs.num_entries;
  e.slot = e.in_batch ? entry_slot(a.inputs, e.i) : -1;
  const bool live = e.slot >= 0 && e.slot < a.capacity;
  const uint64_t start = live && a.fold.continue_chain ? static_cast<uint64_t>(a.fold.out[e.i]) : 0;
  e.fold = static_cast<int64_t>(
      fold_lane_slot(a.fold.sources, a.fold.num_sources, e.slot, live, tile, start));
  return true;
}

// What every canary kernel starts with (start_entry, over the block's fold
// tiles), then apply(i, in_batch, slot, fold) for each thread of a warp that
// reaches into the batch.
template <typename Table, typename Apply>
__device__ __forceinline__ void for_each_entry(const CanaryLaunchArgs<Table>& a, Counter calls,
                                               Apply apply) {
  __shared__ ulonglong2 tiles[kWarpsPerBlock][kWarpSize * kRowPitch];
  ThreadEntry e;
  if (start_entry(a, calls, tiles[threadIdx.x / kWarpSize], e)) {
    apply(e.i, e.in_batch, e.slot, e.fold);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock) record_kernel(const RecordLaunchArgs a) {
  for_each_entry(a, kRecordCalls, [&](int64_t i, bool in_batch, int64_t s, int64_t fold) {
    const bool recorded = in_batch && recordable(a, i);
    if (recorded) {
      int64_t* record = a.records + s * kRecordFields;
      record[kToken] = entry_token(a.inputs, i);
      record[kPosition] = entry_position(a.inputs, i);
      record[kFold] = fold;
      a.owner_tags[s] = a.inputs.tags != nullptr ? entry_tag(a.inputs, i) : -1;
      if (!continues_run(a, i)) {
        write_run_chain(a, i);
      }
    } else if (s >= 0) {
      int64_t row[kViolationFields];
      out_of_range_row(row, kKindRecord, a.inputs, i);
      append_row(a, row);
    }
    count_warp(a.counters + kSlotsRecorded, recorded);
  });
}

__global__ void __launch_bounds__(kThreadsPerBlock) verify_kernel(const VerifyLaunchArgs a) {
  for_each_entry(a, kVerifyCalls, [&](int64_t i, bool in_batch, int64_t s, int64_t fold) {
    const bool checked = s >= 0 && s != a.padding_slot;
    bool flagged = false;
    if (checked) {
      int64_t row[kViolationFields];
      if (s >= a.capacity || entry_prev_slot(a.inputs, i) >= a.capacity) {
        out_of_range_row(row, kKindVerify, a.inputs, i);
        flagged = true;
      } else {
        const VerifyOutcome outcome =
            verify_entry(a.records, a.owner_tags, a.inputs, i, s, fold, a.padding_slot);
        flagged = outcome.reasons != 0;
        verify_row(row, a.records, a.inputs, i, s, outcome);
      }
      if (flagged) {
        append_row(a, row);
      }
    }
    if (in_batch) {
      a.flagged[i] = flagged;
    }
    count_warp(a.counters + kSlotsVerified, checked);
  });
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    refold_kernel(const EntryInputs entries, const int64_t* folds, int64_t* records,
                  int64_t capacity) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (i < entries.num_entries) {
    const int64_t s = entry_slot(entries, i);
    if (s >= 0 && s < capacity) {
      records[s * kRecordFields + kFold] = folds[i];
    }
  }
}

}  // namespace

// One block even for an empty batch: the call is still counted.
cudaError_t launch_record(const RecordLaunchArgs& args, cudaStream_t stream) {
  record_kernel<<<grid_blocks(args.inputs.num_entries, kThreadsPerBlock), kThreadsPerBlock, 0,
                  stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_verify(const VerifyLaunchArgs& args, cudaStream_t stream) {
  verify_kernel<<<grid_blocks(args.inputs.num_entries, kThreadsPerBlock), kThreadsPerBlock, 0,
                  stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_refold(const EntryInputs& entries, const int64_t* folds, int64_t* records,
                          int64_t capacity, cudaStream_t stream) {
  if (entries.num_entries == 0) {
    return cudaSuccess;
  }
  refold_kernel<<<grid_blocks(entries.num_entries, kThreadsPerBlock), kThreadsPerBlock, 0,
                  stream>>>(entries, folds, records, capacity);
  return cudaGetLastError();
}

}  // namespace kvcanary
