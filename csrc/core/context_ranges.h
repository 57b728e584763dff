// The entries of a paged step's context ranges (kvcanary::paged_step; its
// contract is in ops.cpp): entry i of row r is position starts[r] + (i -
// offsets[r]), read through row r of a paged block table, and which of them
// the step checks, against which token. Torch-free, shared by the CPU and CUDA
// kernels.
#pragma once

#include <cstdint>

#include "core/fold_math.h"
#include "core/indices.h"

namespace kvcanary {

// A paged block table (a host or device pointer): row r's block j at
// block_table[r * row_stride + j * block_stride].
struct BlockTable {
  const void* block_table;  // [>= rows, max_blocks], int32 when table_int32
  bool table_int32;
  int64_t row_stride;  // in elements
  int64_t block_stride;
  int64_t max_blocks;
};

// One call's inputs (host or device pointers: the block table, num_rows rows
// of it read) and outputs.
struct ContextRanges : BlockTable {
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
  const int64_t block = load_index(c.block_table, c.table_int32,
                                   r * c.row_stride + p / c.block_size * c.block_stride);
  return block < 0 ? -1 : block * c.block_size + p % c.block_size;
}

// The row of entry i: the last r with offsets[r] <= i (a binary search over
// nondecreasing offsets), or -1 when there is none.
KVC_HOST_DEVICE int64_t row_of(const ContextRanges& c, int64_t i) {
  return lower_bound_of(c.offsets, c.num_rows, i + 1) - 1;
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

// Which of a step's context entries kvcanary::paged_step checks, and the
// token each is checked against (its contract is in ops.cpp).
struct ContextChecks {
  const int64_t* written;  // the slots the step writes, ascending; null: none
  int64_t num_written;
  bool deferred;  // check only the entries at a written slot (after the step)
  int64_t every;  // > 1: a rotating sample of blocks (in_turn)
  int64_t turn;   // in [0, every)
  // The token history, history[h, p] of history row h, int32 when
  // history_int32, read where `known` (null: everywhere) holds true; null:
  // tokens are not checked. Strides in elements.
  const void* history;
  bool history_int32;
  int64_t history_rows;
  int64_t history_len;
  int64_t history_row_stride;
  int64_t history_position_stride;
  const bool* known;
  int64_t known_row_stride;
  int64_t known_position_stride;
  // Each range row's history row, int32 when history_row_of_int32; null: row r
  // is history row r.
  const void* history_row_of;
  bool history_row_of_int32;
};

// Whether `slot` is among the step's written slots (a binary search).
KVC_HOST_DEVICE bool is_written(const ContextChecks& k, int64_t slot) {
  const int64_t at = lower_bound_of(k.written, k.num_written, slot);
  return at < k.num_written && k.written[at] == slot;
}

// Whether position p of a range whose last position is `last` is checked this
// step: every position when every <= 1; else those of a block whose index is
// the turn's (block % every == turn) and those of the block of `last`, the
// one its request wrote last.
KVC_HOST_DEVICE bool position_in_turn(const ContextChecks& k, int64_t block_size, int64_t p,
                                      int64_t last) {
  if (k.every <= 1) {
    return true;
  }
  const int64_t block = p / block_size;
  return block % k.every == k.turn || block == last / block_size;
}

// position_in_turn for position p of row r (inside its range).
KVC_HOST_DEVICE bool in_turn(const ContextRanges& c, const ContextChecks& k, int64_t r, int64_t p) {
  const int64_t last = c.starts[r] + (c.offsets[r + 1] - c.offsets[r]) - 1;
  return position_in_turn(k, c.block_size, p, last);
}

// The history row of range row r; -1 when outside the history.
KVC_HOST_DEVICE int64_t history_row(const ContextChecks& k, int64_t r) {
  const int64_t h =
      k.history_row_of == nullptr ? r : load_index(k.history_row_of, k.history_row_of_int32, r);
  return h >= 0 && h < k.history_rows ? h : -1;
}

// The token at position p of history row h (-1 for none); -1 where the
// history holds none: no history, h or p outside it, or not known there.
KVC_HOST_DEVICE int64_t history_token(const ContextChecks& k, int64_t h, int64_t p) {
  if (k.history == nullptr || h < 0 || p < 0 || p >= k.history_len) {
    return -1;
  }
  if (k.known != nullptr && !k.known[h * k.known_row_stride + p * k.known_position_stride]) {
    return -1;
  }
  return load_index(k.history, k.history_int32,
                    h * k.history_row_stride + p * k.history_position_stride);
}

// Entry i of row r (written by write_entry) kept where it is checked, its slot
// set to -1 elsewhere, and its expected token in tokens[i] (when tokens is not
// null). True where the entry waits for the deferred call: not deferred, and
// at a slot the step writes.
KVC_HOST_DEVICE bool select_entry(const ContextRanges& c, const ContextChecks& k, int64_t i,
                                  int64_t r, int64_t* tokens) {
  const int64_t slot = c.slots[i];
  const bool written = slot >= 0 && k.written != nullptr && is_written(k, slot);
  const bool checked =
      slot >= 0 && (k.deferred ? written : !written && in_turn(c, k, r, c.positions[i]));
  if (!checked) {
    c.slots[i] = -1;
  }
  if (tokens != nullptr) {
    tokens[i] = checked ? history_token(k, history_row(k, r), c.positions[i]) : -1;
  }
  return written && !k.deferred;
}

}  // namespace kvcanary
