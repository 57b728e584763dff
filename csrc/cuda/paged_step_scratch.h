// The working memory of the CUDA kernels of kvcanary::paged_step: its layout,
// and its size, which the host query paged_step_scratch_size (ops.cpp)
// answers so that a caller allocates the op's scratch argument once, and a
// step allocates nothing. Plain C++ without CUDA's headers, so that the CPU
// library answers the query too.
#pragma once

#include <cstdint>

namespace kvcanary {

// The most KV cache groups one CUDA call takes: the groups travel by value in
// the launches' arguments (no device table to copy, so the launches can be
// captured in a CUDA graph).
constexpr int kMaxPagedGroups = 8;

// The scratch of one call, carved from the op's scratch tensor: `entries` =
// groups * num_tokens record entries, entry e being token e % num_tokens of
// group e / num_tokens.
struct PagedStepScratch {
  int64_t* entry_slots;   // [entries] the entry's slot; -1: none
  int64_t* entry_prevs;   // [entries] the slot of its position - 1
  int64_t* entry_keys;    // [entries] its place in record order; -1: not recorded
  int64_t* entry_chains;  // [entries] the chain it records
  int64_t* entry_deps;    // [entries] of a run's first entry: the entry it chains after, or -1
  int64_t* deps;          // [2 * entries] the dependent first entries, then them sorted
  int64_t* row_ranks;     // [num_reqs] each request's place in record order
  int64_t* writers;       // [capacity] the key of the last entry recording the slot; -1: none
  int64_t* folds;         // [capacity] the fold of each marked slot
  unsigned char* marked;  // [capacity] the slots the call folds
  int64_t* words;         // [kScratchWords]
};

// The scratch's single words.
enum ScratchWord : int {
  kWordRingStart = 0,  // counters[kRingWrite] before the call appended anything
  kWordVerified = 1,   // nonzero: the context had an entry (verify is counted)
  kWordDeps = 2,       // how many runs wait on another request's run
  kWordRecorded = 3,   // nonzero: the step wrote a token (record is counted)
  kScratchWords = 4,
};

// The int64 values of the scratch for `num_entries` entries, `num_reqs`
// requests and `capacity` slots.
inline int64_t paged_step_scratch_values(int64_t num_entries, int64_t num_reqs, int64_t capacity) {
  return 7 * num_entries + num_reqs + 2 * capacity + (capacity + 7) / 8 + kScratchWords;
}

// Points the scratch's arrays into `base` (paged_step_scratch_values values).
inline PagedStepScratch carve_paged_step_scratch(int64_t* base, int64_t num_entries,
                                                 int64_t num_reqs, int64_t capacity) {
  PagedStepScratch s{};
  s.entry_slots = base;
  s.entry_prevs = s.entry_slots + num_entries;
  s.entry_keys = s.entry_prevs + num_entries;
  s.entry_chains = s.entry_keys + num_entries;
  s.entry_deps = s.entry_chains + num_entries;
  s.deps = s.entry_deps + num_entries;
  s.row_ranks = s.deps + 2 * num_entries;
  s.writers = s.row_ranks + num_reqs;
  s.folds = s.writers + capacity;
  int64_t* marked = s.folds + capacity;
  s.marked = reinterpret_cast<unsigned char*>(marked);
  s.words = marked + (capacity + 7) / 8;
  return s;
}

}  // namespace kvcanary
