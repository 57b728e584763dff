#include "cpu/cpu_path.h"

#include <torch/csrc/stable/library.h>

#include <cstdlib>
#include <iterator>
#include <string>

#include "cpu/kernels/fold_cpu_isa.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

constexpr const char* kIsaVariable = "KVCANARY_CPU_ISA";

// Indexed by CpuIsa; only the portable path off x86-64.
constexpr CpuPath kCpuPaths[] = {
    {CpuIsa::kScalar, fold_task_scalar, digest_range_scalar},
#if defined(__x86_64__)
    {CpuIsa::kAvx2, fold_task_avx2, digest_range_avx2},
    {CpuIsa::kAvx512, fold_task_avx512, digest_range_avx512},
#endif
};

constexpr bool indexed_by_isa() {
  for (int i = 0; i < static_cast<int>(std::size(kCpuPaths)); ++i) {
    if (static_cast<int>(kCpuPaths[i].isa) != i) return false;
  }
  return true;
}
static_assert(indexed_by_isa(), "kCpuPaths must be indexed by CpuIsa");

const char* name_of(CpuIsa isa) { return kCpuIsaNames[static_cast<int>(isa)]; }

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_runs(isa)) {
      return isa;
    }
  }
  return CpuIsa::kScalar;
}

// The choice made on first use: the path, or the value of $KVCANARY_CPU_ISA
// that was refused.
struct IsaChoice {
  CpuIsa best;
  CpuIsa isa;
  std::string refused;
};

IsaChoice choose_isa() {
  const CpuIsa best = best_cpu_isa();
  IsaChoice choice{best, best, {}};
  const char* forced = std::getenv(kIsaVariable);
  if (forced == nullptr || *forced == '\0') {
    return choice;
  }
  for (int isa = 0; isa <= static_cast<int>(choice.best); ++isa) {
    if (std::string(forced) == kCpuIsaNames[isa]) {
      choice.isa = static_cast<CpuIsa>(isa);
      return choice;
    }
  }
  choice.refused = forced;
  return choice;
}

std::string cpu_isa() { return name_of(cpu_path().isa); }

}  // namespace

const CpuPath& cpu_path() {
  static const IsaChoice choice = choose_isa();
  KVCANARY_CHECK_VALUE(choice.refused.empty(), kIsaVariable, "=", choice.refused,
                       " is not a path this CPU can run; use one of scalar..", name_of(choice.best),
                       " or unset it");
  return kCpuPaths[static_cast<int>(choice.isa)];
}

// No tensor arguments: CompositeExplicitAutograd serves every call.
STABLE_TORCH_LIBRARY_IMPL(kvcanary, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&cpu_isa));
}

}  // namespace kvcanary
