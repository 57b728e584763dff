// The CPU fold's prefetching: which tokens a thread reads next (ReadOrder) and
// how their lines are requested while the current ones are hashed
// (TokenPrefetcher). Included by each instruction-set unit, through
// cpu/kernels/fold_cpu_lanes.h, after it has set its target; everything here
// has internal linkage (see cpu/kernels/fold_cpu.h).
//
// Why: the fold of a random slot waits on memory, and hardware prefetchers do
// not guess random addresses. Asking for the next tokens while the current
// ones are hashed overlaps the two.
#pragma once

#include "core/fold_math.h"
#include "cpu/kernels/fold_cpu.h"

namespace kvcanary {
namespace {

// Whether `slot` is folded; padding (negative) and out-of-range slots give 0
// and are never read.
bool is_folded(const CpuFoldWork& work, int64_t slot) { return slot >= 0 && slot < work.capacity; }

int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

// The tokens of `source` at `count` slots from `slots`; those outside [0,
// capacity) are not read.
template <typename index_t>
struct TokensToRead {
  const SourceLayout* source;
  const index_t* slots;
  int64_t count;
  int64_t capacity;

  bool reads(int64_t i) const { return slots[i] >= 0 && slots[i] < capacity; }
};

// The order in which a thread reads tokens, so that each fold can warm the
// next one's. A thread folds a task group by group (groups of `group_slots`)
// and each group source by source: after source s of a group comes source
// s + 1 of that group, and after its last source the first source of the next
// group, which after the task's last group is the first group of `next`, the
// span the thread folds after this task.
template <typename index_t>
class ReadOrder {
 public:
  ReadOrder(const CpuFoldWork& work, SlotSpan task, SlotSpan next, int64_t group_slots)
      : work_(work), task_(task), next_(next), group_slots_(group_slots) {}

  // What is read after source `source` of the group that starts at index `first`.
  TokensToRead<index_t> after(int64_t first, int source) const {
    const auto* slots = static_cast<const index_t*>(work_.slots);
    if (source + 1 < work_.num_sources) {
      return {&work_.sources[source + 1], slots + first, group_size(first, task_.end),
              work_.capacity};
    }
    const int64_t next_first = first + group_slots_;
    if (next_first < task_.end) {
      return {&work_.sources[0], slots + next_first, group_size(next_first, task_.end),
              work_.capacity};
    }
    return {&work_.sources[0], slots + next_.begin, group_size(next_.begin, next_.end),
            work_.capacity};
  }

 private:
  int64_t group_size(int64_t first, int64_t end) const {
    return smaller(end - first, group_slots_);
  }

  const CpuFoldWork& work_;
  SlotSpan task_;
  SlotSpan next_;
  int64_t group_slots_;
};

// Requests the lines of the tokens read next while the current ones are
// hashed, spread over the hashing's steps. Up to kAtOnceLines lines in all are
// requested at once (a short read gains most from an early start); more are
// requested in pieces of up to kPieceLines lines of one token, in token order,
// paced over the steps: a core keeps only so many misses in flight and drops
// the requests of a burst beyond them, and the lines of one token requested
// in order reach memory as one run.
//
// Every function that prefetches is always inlined: GCC counts a prefetch as
// having no effect and may drop calls of a function that only prefetches.
class TokenPrefetcher {
 public:
  // Plans the requests for `next`: the first kMaxLines lines of each token.
  template <typename index_t>
  [[gnu::always_inline]] void start(const TokensToRead<index_t>& next) {
    const SourceLayout& src = *next.source;
    num_lines_ = 0;
    for (int64_t byte = 0; byte < src.read_bytes && num_lines_ < kMaxLines; byte += kLineBytes) {
      line_offsets_[num_lines_++] = chunk_offset(src, byte);
    }
    const bool all_at_once = next.count * num_lines_ <= kAtOnceLines;
    num_tokens_ = 0;
    for (int64_t i = 0; i < next.count; ++i) {
      if (!next.reads(i)) continue;
      const unsigned char* token = src.data + token_offset(src, next.slots[i]);
      if (all_at_once) {
        request(token, 0, num_lines_);
      } else {
        tokens_[num_tokens_++] = token;
      }
    }
    const int pieces_per_token = (num_lines_ + kPieceLines - 1) / kPieceLines;
    num_pieces_ = num_tokens_ * pieces_per_token;
    token_ = 0;
    line_ = 0;
  }

  // Spreads the planned pieces evenly over the next `steps` calls of step().
  // Each step earns num_pieces_ credits and a piece costs `steps` of them, so
  // after k steps floor(k * num_pieces_ / steps) pieces have been requested.
  // Example: 16 tokens of 1 KiB (16 lines, one piece each) paced over the 64
  // chunk steps of a 1 KiB fold: steps 4, 8, ..., 64 request one piece each.
  void pace(int64_t steps) {
    steps_ = steps > 1 ? steps : 1;
    credit_ = 0;
  }

  [[gnu::always_inline]] void step() {
    credit_ += num_pieces_;
    while (credit_ >= steps_ && token_ < num_tokens_) {
      request_next_piece();
      credit_ -= steps_;
    }
  }

  // Requests what the steps have left (when num_pieces_ does not divide evenly).
  [[gnu::always_inline]] void finish() {
    while (token_ < num_tokens_) request_next_piece();
  }

 private:
  // 4 KiB of each token: the next group's tokens then take at most 256 KiB, a
  // fraction of L2.
  static constexpr int kMaxLines = 64;
  static constexpr int kAtOnceLines = 128;  // 8 KiB
  static constexpr int kPieceLines = 16;
  static constexpr int64_t kLineBytes = 64;
  static constexpr int kLocality = 3;  // __builtin_prefetch: into L1 and L2

  [[gnu::always_inline]] void request(const unsigned char* token, int first_line, int end_line) {
    for (int line = first_line; line < end_line; ++line) {
      __builtin_prefetch(token + line_offsets_[line], 0, kLocality);
    }
  }

  // Lines [line_, line_ + kPieceLines) of token token_; then the cursor moves
  // to the next piece, which starts the next token after a token's last one.
  [[gnu::always_inline]] void request_next_piece() {
    const int end = line_ + kPieceLines < num_lines_ ? line_ + kPieceLines : num_lines_;
    request(tokens_[token_], line_, end);
    if (end < num_lines_) {
      line_ = end;
    } else {
      line_ = 0;
      ++token_;
    }
  }

  const unsigned char* tokens_[kLaneGroupMultiple];
  int64_t line_offsets_[kMaxLines];
  int num_lines_ = 0;
  int num_tokens_ = 0;
  int num_pieces_ = 0;
  int token_ = 0;  // the cursor: the next piece is lines [line_, ...) of tokens_[token_]
  int line_ = 0;
  int64_t steps_ = 1;
  int64_t credit_ = 0;
};

// The lines of the fold's side work (FoldSideWork) for the lane group hashed
// next, requested while the current group is hashed, spread over its steps
// as TokenPrefetcher spreads tokens.
class SidePrefetcher {
 public:
  explicit SidePrefetcher(const FoldSideWork& side) : side_(side) {}

  // Plans the lines of entries `span` (at most a lane group), to be requested
  // over the next `steps` calls of step().
  [[gnu::always_inline]] void plan(SlotSpan span, int64_t steps) {
    count_ = span.begin < span.end ? side_.lines(side_.state, span, lines_) : 0;
    next_ = 0;
    steps_ = steps > 1 ? steps : 1;
    credit_ = 0;
  }

  // Requests the lines of entries `span` at once (the first group of a task).
  [[gnu::always_inline]] void request_now(SlotSpan span) {
    plan(span, 1);
    finish();
  }

  [[gnu::always_inline]] void step() {
    credit_ += count_;
    while (credit_ >= steps_ && next_ < count_) {
      __builtin_prefetch(lines_[next_++], 0, kLocality);
      credit_ -= steps_;
    }
  }

  // Requests what the steps have left.
  [[gnu::always_inline]] void finish() {
    while (next_ < count_) __builtin_prefetch(lines_[next_++], 0, kLocality);
  }

  // The side work of entries `span`, once their folds are out.
  void after(SlotSpan span) const {
    if (side_.after != nullptr) side_.after(side_.state, span);
  }

 private:
  static constexpr int kLocality = 3;

  const FoldSideWork& side_;
  const void* lines_[kSideLinesPerEntry * kLaneGroupMultiple];
  int count_ = 0;
  int next_ = 0;
  int64_t steps_ = 1;
  int64_t credit_ = 0;
};

// A fold without side work.
struct NoSide {
  void plan(SlotSpan, int64_t) {}
  void request_now(SlotSpan) {}
  void step() {}
  void finish() {}
  void after(SlotSpan) const {}
};

// A group's TokenPrefetcher and its side prefetcher, stepped together.
template <class Side>
struct GroupPrefetcher {
  TokenPrefetcher& tokens;
  Side& side;

  void pace(int64_t steps) { tokens.pace(steps); }
  [[gnu::always_inline]] void step() {
    tokens.step();
    side.step();
  }
  [[gnu::always_inline]] void finish() { tokens.finish(); }
};

// Hashing without prefetching: what is read next is not known (pairs).
struct NoPrefetch {
  void pace(int64_t) {}
  void step() {}
  void finish() {}
};

}  // namespace
}  // namespace kvcanary
