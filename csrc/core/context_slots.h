// The slots of a step's context ranges (kvcanary::context_slots; its contract
// is in ops.cpp): entry i of row r is position starts[r] + (i - offsets[r]),
// read through row r of a paged block table. Torch-free, shared by the CPU and
// CUDA kernels.
#pragma once

#include <cstdint>

#include "core/fold_math.h"

namespace kvcanary {

// One call's inputs (host or device pointers) and outputs.
struct ContextRanges {
  const void* block_table;  // [>= num_rows, max_blocks], int32 when table_int32
  bool table_int32;
  int64_t row_stride;  // in elements
  int64_t block_stride;
  int64_t max_blocks;
  const int64_t* offsets;  // num_rows + 1
  const int64_t* starts;   // num_rows
  int64_t num_rows;
  int64_t block_size;
  int64_t cut_slot;  // < 0: none
  int64_t num_entries;
  int64_t* slots;  // num_entries each
  int64_t* positions;
  int64_t* prev_slots;
  int64_t* rows;
};

// The slot of position p of row r (r < num_rows); -1 where p is negative, its
// block index is past the table, or the table holds a negative block there.
KVC_HOST_DEVICE int64_t table_slot(const ContextRanges& c, int64_t r, int64_t p) {
  if (p < 0 || p / c.block_size >= c.max_blocks) {
    return -1;
  }
  const int64_t at = r * c.row_stride + p / c.block_size * c.block_stride;
  const int64_t block = c.table_int32
                            ? static_cast<int64_t>(static_cast<const int32_t*>(c.block_table)[at])
                            : static_cast<const int64_t*>(c.block_table)[at];
  return block < 0 ? -1 : block * c.block_size + p % c.block_size;
}

// The row of entry i: the last r with offsets[r] <= i (a binary search over
// nondecreasing offsets), or -1 when there is none.
KVC_HOST_DEVICE int64_t row_of(const ContextRanges& c, int64_t i) {
  int64_t lo = 0;
  int64_t hi = c.num_rows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (c.offsets[mid] <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

// Writes entry i of row r (-1: none). An entry outside its row's range (which
// only offsets refused by no check give) gets -1 everywhere; one whose slot is
// -1 gets prev_slot -1.
KVC_HOST_DEVICE void write_entry(const ContextRanges& c, int64_t i, int64_t r) {
  int64_t position = -1;
  int64_t slot = -1;
  int64_t prev = -1;
  if (r >= 0 && i >= c.offsets[r] && i < c.offsets[r + 1]) {
    const int64_t j = i - c.offsets[r];
    position = c.starts[r] + j;
    slot = table_slot(c, r, position);
    if (slot >= 0 && position > 0) {
      prev = j == 0 && c.cut_slot >= 0 ? c.cut_slot : table_slot(c, r, position - 1);
    }
  } else {
    r = -1;
  }
  c.slots[i] = slot;
  c.positions[i] = position;
  c.prev_slots[i] = prev;
  c.rows[i] = r;
}

}  // namespace kvcanary
