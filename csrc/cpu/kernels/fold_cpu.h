// The CPU fold's instruction-set paths. Each lives in its own translation unit
// (cpu/isa/scalar.cpp, cpu/isa/avx2.cpp, cpu/isa/avx512.cpp), which also holds
// the digest's path (cpu/kernels/digest_cpu.h); cpu/cpu_path.cpp picks one at
// run time. Those units compile every function they see for their instruction
// set, and the linker keeps one copy of each inline function or template
// instantiation with external linkage, from whichever unit it likes: so this
// header, which they include, holds only data, constants and declarations,
// and everything they define is static or in an anonymous namespace, but for
// their two entry points, fold_task_<isa> and digest_range_<isa>
// (tests/test_build.py checks it).
#pragma once

#include <cstdint>

#include "core/fold_math.h"

namespace kvcanary {

// Indices [begin, end) into the work's slots.
struct SlotSpan {
  int64_t begin;
  int64_t end;
};

// Lines a kernel built on the fold reads per entry besides the sources, at
// most (verify: its slot's record and owner tag, its previous slot's record).
constexpr int kSideLinesPerEntry = 3;

// What a kernel built on the fold (kvcanary::verify) does beside it, lane
// group by lane group, on the thread that folds the group:
// lines(state, span, out) writes to out the addresses of the lines it will
// read for entries `span` (at most kSideLinesPerEntry each) and returns how
// many (they are requested while the group before is hashed); after(state,
// span), when not null, runs once out[span] holds the span's folds, while
// those lines are in cache. A work whose `lines` is null has no side work.
struct FoldSideWork {
  int (*lines)(const void* state, SlotSpan span, const void** out) = nullptr;
  void (*after)(const void* state, SlotSpan span) = nullptr;
  const void* state = nullptr;
};

// What a call folds: out[i] = the fold of slots[i] over the sources, for the
// indices i it is given.
struct CpuFoldWork {
  const SourceLayout* sources;
  int num_sources;
  int64_t capacity;  // smallest source capacity; slots outside [0, capacity) give 0
  const void* slots;
  bool slots_are_int32;
  int64_t* out;
  FoldSideWork side;
};

// Every path folds slots in lane groups whose size divides this; tasks handed
// to threads are multiples of it, so no group is split between two tasks.
constexpr int64_t kLaneGroupMultiple = 64;

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Each path folds `task` of `work`. `next` is the span the calling thread
// folds after it (empty when none): its first tokens are prefetched while the
// task's last group is folded.
void fold_task_scalar(const CpuFoldWork& work, SlotSpan task, SlotSpan next);
#if defined(__x86_64__)
void fold_task_avx2(const CpuFoldWork& work, SlotSpan task, SlotSpan next);
void fold_task_avx512(const CpuFoldWork& work, SlotSpan task, SlotSpan next);
#endif

}  // namespace kvcanary
