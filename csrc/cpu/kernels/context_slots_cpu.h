// The CPU kernel of kvcanary::context_slots: entries [begin, end) written in
// order, the row found once by a search and then walked forward.
#pragma once

#include <cstdint>

#include "core/context_slots.h"

namespace kvcanary {

// Entries a thread takes at least: each costs a few loads.
constexpr int64_t kContextSlotsGrain = 16384;

inline void context_slots_range(const ContextRanges& c, int64_t begin, int64_t end) {
  int64_t r = row_of(c, begin);
  for (int64_t i = begin; i < end; ++i) {
    while (r + 1 < c.num_rows && c.offsets[r + 1] <= i) {
      ++r;
    }
    write_entry(c, i, r);
  }
}

// kvcanary::verify_context's entries [begin, end): each written, then kept
// where it is checked (select_entry); the number that wait for the deferred
// call.
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
