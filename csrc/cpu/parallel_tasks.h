// The CPU kernels' thread driver: a call's entries cut into tasks (see
// cpu/kernels/fold_cpu_tasks.h) and shared among torch's threads.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cpu/kernels/fold_cpu_tasks.h"

namespace kvcanary {

// Runs the tasks of `task` entries that cut [0, n) on torch's threads. Each
// thread calls on_thread(run_my_tasks) once, and run_my_tasks(work) calls
// work(task, next) for each task the thread takes, `next` being the span it
// takes after this one (empty when none; run_tasks: a thread knows its next
// task before it works on the current one). What a thread keeps for itself
// (the digest's sums) lives in its on_thread call.
//
// Threads start with one task each and then claim tasks from a shared counter
// instead of taking an even share up front: the kernels wait on memory, and
// on a shared machine an even split makes every call as slow as its slowest
// thread. When one thread would do, the calling thread runs [0, n) as one
// task.
template <typename OnThread>
void parallel_tasks(int64_t n, int64_t task, const OnThread& on_thread) {
  const int64_t num_tasks = (n + task - 1) / task;
  const int64_t workers =
      std::min<int64_t>(num_tasks, static_cast<int64_t>(torch::stable::get_num_threads()));
  if (workers <= 1) {
    on_thread([&](const auto& work) { work(SlotSpan{0, n}, SlotSpan{n, n}); });
    return;
  }
  std::atomic<int64_t> next{workers};
  torch::stable::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // Tasks [begin, end) are this thread's to start with (one, unless
    // parallel_for runs inline), then whatever it claims.
    on_thread([&](const auto& work) { run_tasks(begin, end, next, n, task, work); });
  });
}

}  // namespace kvcanary
