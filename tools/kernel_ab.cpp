// In-process A/B timing of two builds of the CPU fold kernel: the machine's
// memory speed drifts by tens of percent within minutes, so two builds are
// compared by calling them in turn, round after round, in one process, on the
// same pool and slots. Built and run by tools/kernel_ab.sh; each build is
// reached through its side (tools/kernel_ab_side.cpp), fold_all_a or fold_all_b.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/fold_math.h"
#include "cpu/kernels/fold_cpu_isa.h"  // this tree's (B's)

extern "C" {
void fold_all_a(const unsigned char* pool, int64_t row_bytes, const int64_t* slots, int64_t n,
                int threads, int64_t* out);
void fold_all_b(const unsigned char* pool, int64_t row_bytes, const int64_t* slots, int64_t n,
                int threads, int64_t* out);
}

namespace {

using FoldAll = decltype(&fold_all_a);

struct Options {
  int64_t row_bytes = 1024;
  int64_t pool_mib = 64;
  int threads = 2;
  int rounds = 30;
  bool random_order = true;
};

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr, "kernel_ab: %s\n", problem.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  if (argc % 2 == 0) usage("every option takes a value");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--row-bytes")
      o.row_bytes = std::atoll(value.c_str());
    else if (flag == "--pool-mib")
      o.pool_mib = std::atoll(value.c_str());
    else if (flag == "--threads")
      o.threads = std::atoi(value.c_str());
    else if (flag == "--rounds")
      o.rounds = std::atoi(value.c_str());
    else if (flag == "--order" && (value == "random" || value == "sequential"))
      o.random_order = value == "random";
    else
      usage("options: --row-bytes N --pool-mib N --threads N --rounds N --order random|sequential");
  }
  if (o.row_bytes <= 0 || o.row_bytes % kvcanary::kReadAlign != 0 || o.pool_mib <= 0 ||
      (o.pool_mib << 20) < o.row_bytes || o.threads < 1 || o.rounds < 1) {
    usage("--row-bytes must be a positive multiple of " + std::to_string(kvcanary::kReadAlign) +
          " no larger than the pool; the other numbers positive");
  }
  return o;
}

// Whether this CPU runs the path the script compiled (KERNEL_AB_ISA).
bool cpu_runs_isa() {
  for (int isa = 0; isa < 3; ++isa) {
    if (std::string(KERNEL_AB_ISA) == kvcanary::kCpuIsaNames[isa]) {
      return kvcanary::cpu_runs(static_cast<kvcanary::CpuIsa>(isa));
    }
  }
  return false;
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

  const auto* rows = reinterpret_cast<const unsigned char*>(pool.data());
  const FoldAll sides[2] = {fold_all_a, fold_all_b};
  std::vector<int64_t> out[2] = {std::vector<int64_t>(n), std::vector<int64_t>(n)};
  std::vector<double> us[2];
  for (int round = -1; round < o.rounds; ++round) {  // round -1 warms up, untimed
    for (int k = 0; k < 2; ++k) {
      const int which = (round + 2 + k) % 2;  // alternate which build goes first
      const auto start = std::chrono::steady_clock::now();
      sides[which](rows, o.row_bytes, slots.data(), n, o.threads, out[which].data());
      const double elapsed =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      if (round >= 0) us[which].push_back(elapsed);
    }
  }
  const bool same = out[0] == out[1];
  std::printf(
      "%lld slots of %lld bytes, %s order, %d threads, medians of %d calls: A %.1f us, B %.1f us, "
      "A/B %.2f; fingerprints %s\n",
      static_cast<long long>(n), static_cast<long long>(o.row_bytes),
      o.random_order ? "random" : "sequential", o.threads, o.rounds, median(us[0]), median(us[1]),
      median(us[0]) / median(us[1]), same ? "agree" : "DIFFER");
  return same ? 0 : 1;
}
