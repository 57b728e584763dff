// The host's plan of a paged serving step (kvcanary::step_plan, ops.cpp):
// per request, the range sets the step verifies, records and refolds, packed
// for context_slots and verify_context. Torch-free; O(sets * rows) plus the
// index sets' entries.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvcanary {

// The step's sets, in order; each KV cache group's context (a range set)
// follows kStepSets. torch_kvcanary/paged_step.py's StepSet names them for
// Python (tests/test_op_library.py holds the two equal).
enum StepSet : int64_t {
  kWritten = 0,        // the positions the step writes
  kTail = 1,           // rest of the last block before the step, not written
  kBlocksWritten = 2,  // every position of the blocks the step writes into
  kRecordOrder = 3,    // the written tokens' indices in record order (index set)
  kStepSets = 4,
};

inline int64_t num_step_sets(int64_t num_groups) { return kStepSets + num_groups; }

inline bool is_index_set(int64_t set) { return set == kRecordOrder; }

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

// Where each set starts in the packed plan and how many entries it has: range
// sets first, in set order, each as its context_slots arguments (offsets,
// rows + 1 values from 0, then starts, rows values); then the index sets'
// values, in set order.
struct StepLayout {
  std::vector<int64_t> bases;
  std::vector<int64_t> counts;
  int64_t size = 0;
};

inline StepLayout step_layout(const StepRanges& r, int64_t num_rows, int64_t num_sets) {
  StepLayout layout{std::vector<int64_t>(num_sets), std::vector<int64_t>(num_sets), 0};
  for (int64_t s = 0; s < num_sets; ++s) {
    int64_t count = 0;
    for (int64_t i = 0; i < num_rows; ++i) {
      count += r.ends[s * num_rows + i] - r.starts[s * num_rows + i];
    }
    layout.counts[s] = count;
  }
  for (const bool index_sets : {false, true}) {
    for (int64_t s = 0; s < num_sets; ++s) {
      if (is_index_set(s) == index_sets) {
        layout.bases[s] = layout.size;
        layout.size += index_sets ? layout.counts[s] : 2 * num_rows + 1;
      }
    }
  }
  return layout;
}

inline void write_step_plan(const StepRanges& r, const StepLayout& layout, int64_t num_rows,
                            int64_t* plan) {
  const int64_t num_sets = static_cast<int64_t>(layout.bases.size());
  for (int64_t s = 0; s < num_sets; ++s) {
    const int64_t* starts = r.starts.data() + s * num_rows;
    const int64_t* ends = r.ends.data() + s * num_rows;
    int64_t* out = plan + layout.bases[s];
    if (is_index_set(s)) {
      for (int64_t i = 0; i < num_rows; ++i) {
        for (int64_t v = starts[i]; v < ends[i]; ++v) {
          *out++ = v;
        }
      }
      continue;
    }
    out[0] = 0;
    for (int64_t i = 0; i < num_rows; ++i) {
      out[i + 1] = out[i] + (ends[i] - starts[i]);
      out[num_rows + 1 + i] = starts[i];
    }
  }
}

}  // namespace kvcanary
