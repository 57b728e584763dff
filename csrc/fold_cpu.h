// The CPU fold's instruction-set paths. Each lives in its own translation unit
// (fold_cpu_scalar.cpp, fold_cpu_avx2.cpp, fold_cpu_avx512.cpp) that includes
// no torch header, so nothing compiled there for a wider instruction set can
// be shared with portable code; fold_cpu.cpp picks one at run time.
#pragma once

#include <atomic>
#include <cstdint>

#include "fold_math.h"

namespace kvcanary {

// out[i] for slots[i], begin <= i < end.
struct CpuFoldRange {
  const SourceLayout* sources;
  int num_sources;
  int64_t capacity;  // smallest source capacity; slots outside give 0
  const void* slots;
  bool slots_are_int32;
  int64_t begin;
  int64_t end;
  // The slots the same thread folds next, [next_begin, next_end) (empty when
  // none): the first of them are prefetched while the last group is folded.
  int64_t next_begin;
  int64_t next_end;
  int64_t* out;

  // Whether `slot` is folded; padding (negative) and out-of-range slots give 0.
  bool live(int64_t slot) const { return slot >= 0 && slot < capacity; }
};

// Every path folds slots in lane groups whose size divides this; tasks handed
// to threads are multiples of it, so no group is split between two tasks.
constexpr int64_t kLaneGroupMultiple = 64;

// Slots per task handed to a thread: about 256 KiB of reads (small batches
// stay on one thread), in whole lane groups.
inline int64_t task_slots(int64_t read_bytes_per_slot) {
  const int64_t slots = (int64_t{1} << 18) / (read_bytes_per_slot + 1);
  const int64_t groups = (slots + kLaneGroupMultiple - 1) / kLaneGroupMultiple;
  return (groups > 1 ? groups : 1) * kLaneGroupMultiple;
}

// Runs one thread's share of the tasks of `task` slots that cut [0, n): tasks
// [first, end) to start with, then each one it claims from `next`, calling
// fold(begin, end, next_begin, next_end) with the task it will run after the
// current one (empty when none), whose first slots the fold prefetches. A
// thread claims that task before running the current one.
template <typename F>
void run_tasks(int64_t first, int64_t end, std::atomic<int64_t>& next, int64_t n, int64_t task,
               const F& fold) {
  const int64_t num_tasks = (n + task - 1) / task;
  const auto first_slot = [&](int64_t t) { return t * task < n ? t * task : n; };
  for (int64_t t = first; t < num_tasks;) {
    const int64_t after = t + 1 < end ? t + 1 : next++;
    fold(first_slot(t), first_slot(t + 1), first_slot(after), first_slot(after + 1));
    t = after;
  }
}

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The path the CPU kernels take: the best one this CPU has, or the lesser one
// $KVCANARY_CPU_ISA names.
CpuIsa selected_cpu_isa();

void fold_range_scalar(const CpuFoldRange& range);
#if defined(__x86_64__)
void fold_range_avx2(const CpuFoldRange& range);
void fold_range_avx512(const CpuFoldRange& range);
#endif

}  // namespace kvcanary
