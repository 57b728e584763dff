// One side of tools/kernel_ab: folds a pool of rows with one build's kernel,
// headers and task split. tools/kernel_ab.sh compiles it once per build (a
// revision's own copy of this file for a revision), with that build's csrc on
// the include path, its namespace renamed (-Dkvcanary=kvcanary_a or _b, so the
// two builds share no symbol) and
//   KERNEL_AB_ENTRY   the extern "C" name of this side's entry point
//   KERNEL_AB_PATH    the instruction-set path it calls: scalar, avx2, avx512
#include <atomic>
#include <thread>
#include <vector>

#include "cpu/kernels/fold_cpu.h"
#include "cpu/kernels/fold_cpu_tasks.h"

#define KERNEL_AB_CONCAT(a, b) a##b
#define KERNEL_AB_TASK(path) KERNEL_AB_CONCAT(fold_task_, path)

namespace {

using kvcanary::CpuFoldWork;
using kvcanary::SlotSpan;

// Runs the kernel over all slots on `threads` threads in tasks of task_slots()
// slots, claimed as cpu/parallel_tasks.h's threads claim them (run_tasks; these
// threads are started per call, on both sides alike).
void fold_all(const CpuFoldWork& work, int64_t n, int threads) {
  const int64_t task = kvcanary::task_slots(work.sources[0].read_bytes);
  std::atomic<int64_t> next{threads};
  const auto fold = [&](SlotSpan span, SlotSpan next_span) {
    kvcanary::KERNEL_AB_TASK(KERNEL_AB_PATH)(work, span, next_span);
  };
  const auto worker = [&](int w) { kvcanary::run_tasks(w, w + 1, next, n, task, fold); };
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(worker, w);
  worker(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace

// out[i] = the fold of row slots[i] of `pool` (rows of row_bytes, all read).
extern "C" void KERNEL_AB_ENTRY(const unsigned char* pool, int64_t row_bytes, const int64_t* slots,
                                int64_t n, int threads, int64_t* out) {
  kvcanary::SourceLayout src{};
  src.data = pool;
  src.page_size = 1;
  src.page_stride = src.slot_stride = src.read_bytes = src.run_bytes = row_bytes;
  CpuFoldWork work{};
  work.sources = &src;
  work.num_sources = 1;
  work.capacity = n;
  work.slots = slots;
  work.out = out;
  fold_all(work, n, threads);
}
