// The CPU loops of kvcanary::paged_step (ops.cpp), torch-free: per request,
// the range sets the step verifies, records and refolds (O(sets * rows)), and
// the walk over a group's context entries.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/context_ranges.h"

namespace kvcanary {

// The step's sets, in order; each KV cache group's context (a range set)
// follows kStepSets.
enum StepSet : int64_t {
  kWritten = 0,        // the positions the step writes
  kTail = 1,           // rest of the last block before the step, not written
  kBlocksWritten = 2,  // every position of the blocks the step writes into
  kRecordOrder = 3,    // the written tokens' indices in record order
  kStepSets = 4,
};

inline int64_t num_step_sets(int64_t num_groups) { return kStepSets + num_groups; }

struct StepInputs {
  const int64_t* computed;   // [rows] tokens in the cache before the step
  const int64_t* scheduled;  // [rows] tokens the step runs
  const int64_t* firsts;     // [groups, rows] the first position each group attends to
  int64_t num_rows;
  int64_t num_groups;
  int64_t block_size;
  bool blocks_packed;
};

// Every set's range per row, [start, end), set-major: value [set * rows + row].
struct StepRanges {
  std::vector<int64_t> starts;
  std::vector<int64_t> ends;
};

inline int64_t ceil_to_block(int64_t x, int64_t block_size) {
  return (x + block_size - 1) / block_size * block_size;
}

// The rows in the order their written tokens are recorded: by first written
// position, stable, so that a request that reads a block another request of
// the step writes is recorded after it (torch_kvcanary/integrations/vllm).
inline std::vector<int64_t> record_order(const StepInputs& in) {
  std::vector<int64_t> order(in.num_rows);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return in.computed[a] < in.computed[b]; });
  return order;
}

inline StepRanges step_ranges(const StepInputs& in) {
  const int64_t rows = in.num_rows;
  const int64_t bs = in.block_size;
  const int64_t sets = num_step_sets(in.num_groups);
  StepRanges r{std::vector<int64_t>(sets * rows, 0), std::vector<int64_t>(sets * rows, 0)};
  auto set_range = [&](int64_t set, int64_t row, int64_t start, int64_t end) {
    r.starts[set * rows + row] = start;
    r.ends[set * rows + row] = end;
  };
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t computed = in.computed[i];
    const int64_t written_end = computed + in.scheduled[i];
    set_range(kWritten, i, computed, written_end);
    if (in.blocks_packed) {
      const int64_t tail_end = ceil_to_block(computed, bs);
      set_range(kTail, i, std::min(written_end, tail_end), tail_end);
      if (in.scheduled[i] > 0) {
        set_range(kBlocksWritten, i, computed / bs * bs, ceil_to_block(written_end, bs));
      }
    }
  }
  const std::vector<int64_t> order = record_order(in);
  std::vector<int64_t> tokens_before(rows);
  for (int64_t i = 0, before = 0; i < rows; ++i) {
    tokens_before[i] = before;
    before += in.scheduled[i];
  }
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t row = order[k];
    set_range(kRecordOrder, k, tokens_before[row], tokens_before[row] + in.scheduled[row]);
  }
  for (int64_t g = 0; g < in.num_groups; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      set_range(kStepSets + g, i, in.firsts[g * rows + i], in.computed[i]);
    }
  }
  return r;
}

// Context entries a thread takes at least: each costs a few loads.
constexpr int64_t kContextEntriesGrain = 16384;

// A group's context entries [begin, end), the row found once by a search and
// then walked forward: each written (write_entry), then kept where it is
// checked (select_entry); the number that wait for the deferred call.
inline int64_t context_checks_range(const ContextRanges& c, const ContextChecks& k, int64_t* tokens,
                                    int64_t begin, int64_t end) {
  int64_t waiting = 0;
  int64_t r = row_of(c, begin);
  for (int64_t i = begin; i < end; ++i) {
    while (r + 1 < c.num_rows && c.offsets[r + 1] <= i) {
      ++r;
    }
    write_entry(c, i, r);
    waiting += select_entry(c, k, i, r, tokens) ? 1 : 0;
  }
  return waiting;
}

}  // namespace kvcanary
