// How the CPU kernels' entries are cut into tasks and shared among threads.
// Portable code only (cpu/parallel_tasks.h, tools/kernel_ab_side.cpp): the
// instruction-set units never include it, so its inline code is never
// compiled for a wider instruction set.
#pragma once

#include <atomic>
#include <cstdint>

#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {

// The reads of a task handed to a thread, about: small batches stay on one
// thread.
constexpr int64_t kTaskReadBytes = int64_t{1} << 18;

// Slots per task of the fold: about kTaskReadBytes of reads, in whole lane
// groups.
inline int64_t task_slots(int64_t read_bytes_per_slot) {
  const int64_t slots = kTaskReadBytes / (read_bytes_per_slot + 1);
  const int64_t groups = (slots + kLaneGroupMultiple - 1) / kLaneGroupMultiple;
  return (groups > 1 ? groups : 1) * kLaneGroupMultiple;
}

// Runs one thread's share of the tasks of `task` slots that cut [0, n): tasks
// [first, end) to start with, then each one it claims from `next`, calling
// fold(task, next_task) with the span it will fold after the current one
// (empty when none), whose first tokens the fold prefetches. So a thread
// claims its next task before it folds the current one.
template <typename F>
void run_tasks(int64_t first, int64_t end, std::atomic<int64_t>& next, int64_t n, int64_t task,
               const F& fold) {
  const int64_t num_tasks = (n + task - 1) / task;
  const auto span = [&](int64_t t) {
    return SlotSpan{t * task < n ? t * task : n, (t + 1) * task < n ? (t + 1) * task : n};
  };
  for (int64_t t = first; t < num_tasks;) {
    const int64_t after = t + 1 < end ? t + 1 : next++;
    fold(span(t), span(after));
    t = after;
  }
}

}  // namespace kvcanary
