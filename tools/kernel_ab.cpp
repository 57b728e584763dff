// In-process A/B timing of two builds of the CPU fold kernel: the machine's
// memory speed drifts by tens of percent within minutes, so two builds are
// compared by calling them in turn, round after round, in one process, on the
// same pool and slots. Built and run by tools/kernel_ab.sh, which compiles one
// instruction-set translation unit of each build with its entry point renamed
// to fold_range_a and fold_range_b.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fold_cpu.h"

namespace kvcanary {
void fold_range_a(const CpuFoldRange& range);
void fold_range_b(const CpuFoldRange& range);
}  // namespace kvcanary

namespace {

using kvcanary::CpuFoldRange;
using Kernel = void (*)(const CpuFoldRange&);

struct Options {
  int64_t row_bytes = 1024;
  int64_t pool_mib = 64;
  int threads = 2;
  int rounds = 30;
  bool random_order = true;
};

[[noreturn]] void usage(const char* problem) {
  std::fprintf(stderr, "kernel_ab: %s\n", problem);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  if (argc % 2 == 0) usage("every option takes a value");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--row-bytes") o.row_bytes = std::atoll(value.c_str());
    else if (flag == "--pool-mib") o.pool_mib = std::atoll(value.c_str());
    else if (flag == "--threads") o.threads = std::atoi(value.c_str());
    else if (flag == "--rounds") o.rounds = std::atoi(value.c_str());
    else if (flag == "--order" && (value == "random" || value == "sequential")) o.random_order = value == "random";
    else usage("options: --row-bytes N --pool-mib N --threads N --rounds N --order random|sequential");
  }
  if (o.row_bytes <= 0 || o.row_bytes % kvcanary::kReadAlign != 0 || o.pool_mib <= 0 ||
      (o.pool_mib << 20) < o.row_bytes || o.threads < 1 || o.rounds < 1) {
    usage("--row-bytes must be a positive multiple of 16 no larger than the pool; the other numbers positive");
  }
  return o;
}

// Folds all slots on `threads` threads in tasks of task_slots() slots, each
// thread claiming its next task before running the current one, as
// fold_cpu.cpp does with torch's threads (these are started per call, for both
// builds alike).
void fold_all(Kernel kernel, const CpuFoldRange& whole, int64_t n, int threads) {
  const int64_t task = kvcanary::task_slots(whole.sources[0].read_bytes);
  const int64_t num_tasks = (n + task - 1) / task;
  const auto first_slot = [&](int64_t t) { return std::min(n, t * task); };
  std::atomic<int64_t> next{threads};
  const auto worker = [&](int64_t t) {
    while (t < num_tasks) {
      const int64_t after = next++;
      CpuFoldRange range = whole;
      range.begin = first_slot(t);
      range.end = first_slot(t + 1);
      range.next_begin = first_slot(after);
      range.next_end = first_slot(after + 1);
      kernel(range);
      t = after;
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(worker, w);
  worker(0);
  for (std::thread& t : pool) t.join();
}

// Whether this CPU runs the path the script compiled (KERNEL_AB_ISA).
bool cpu_runs_isa() {
  const std::string isa = KERNEL_AB_ISA;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return __builtin_cpu_supports("avx2");
#endif
  return isa == "scalar";
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!cpu_runs_isa()) usage("this CPU cannot run the path given by --isa");
  const int64_t pool_bytes = o.pool_mib << 20;
  const int64_t n = pool_bytes / o.row_bytes;
  std::vector<uint64_t> pool(pool_bytes / 8);
  std::mt19937_64 rng(0);
  for (uint64_t& word : pool) word = rng();
  std::vector<int64_t> slots(n);
  std::iota(slots.begin(), slots.end(), 0);
  if (o.random_order) std::shuffle(slots.begin(), slots.end(), rng);

  kvcanary::SourceLayout src{};
  src.data = reinterpret_cast<const unsigned char*>(pool.data());
  src.page_size = 1;
  src.page_stride = src.slot_stride = src.read_bytes = src.run_bytes = o.row_bytes;
  CpuFoldRange whole{};
  whole.sources = &src;
  whole.num_sources = 1;
  whole.capacity = n;
  whole.slots = slots.data();

  const Kernel kernels[2] = {kvcanary::fold_range_a, kvcanary::fold_range_b};
  std::vector<int64_t> out[2] = {std::vector<int64_t>(n), std::vector<int64_t>(n)};
  std::vector<double> us[2];
  for (int round = -1; round < o.rounds; ++round) {  // round -1 warms up, untimed
    for (int k = 0; k < 2; ++k) {
      const int which = (round + 2 + k) % 2;  // alternate which build goes first
      CpuFoldRange range = whole;
      range.out = out[which].data();
      const auto start = std::chrono::steady_clock::now();
      fold_all(kernels[which], range, n, o.threads);
      const double elapsed = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      if (round >= 0) us[which].push_back(elapsed);
    }
  }
  const bool same = out[0] == out[1];
  std::printf("%lld slots of %lld bytes, %s order, %d threads, medians of %d calls: A %.1f us, B %.1f us, A/B %.2f; fingerprints %s\n",
              static_cast<long long>(n), static_cast<long long>(o.row_bytes), o.random_order ? "random" : "sequential",
              o.threads, o.rounds, median(us[0]), median(us[1]), median(us[0]) / median(us[1]), same ? "agree" : "DIFFER");
  return same ? 0 : 1;
}
