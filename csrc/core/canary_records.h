// SGLang's canary records (contract: docs/spec.md, "The canary records"): the
// four int64 fields kept per slot, the hash chain through a request's slots,
// the fail-reason bits and the violation row. Torch-free, shared by the CPU
// and CUDA kernels of kvcanary::record and kvcanary::verify.
#pragma once

#include <cstdint>

#include "core/fold_math.h"
#include "core/indices.h"

namespace kvcanary {

// Fields of one slot's record, in SGLang's canary-buffer order.
enum RecordField : int { kToken = 0, kPosition = 1, kChain = 2, kFold = 3, kRecordFields = 4 };

// Fields of one violation row.
enum ViolationField : int {
  kRowKind = 0,
  kRowSlot = 1,
  kRowPosition = 2,
  kRowStoredToken = 3,
  kRowExpectedToken = 4,
  kRowStoredChain = 5,
  kRowExpectedAux = 6,
  kRowReasons = 7,
  kViolationFields = 8,
};

// Which call flagged a row.
enum ViolationKind : int64_t { kKindRecord = 0, kKindVerify = 1 };

// Fail-reason bits: SGLang's values (bits 3 and 4 are its write-input asserts,
// unused here), then this package's.
enum FailReason : int64_t {
  kChainMismatch = 1 << 0,
  kPositionMismatch = 1 << 1,
  kFoldMismatch = 1 << 2,
  kTokenMismatch = 1 << 5,
  kOwnerMismatch = 1 << 6,
  // A slot or previous slot past the capacity, found by a kernel that was not
  // asked to raise (CUDA-graph capture, torch.compile): the entry is skipped.
  kSlotOutOfRange = 1 << 7,
  // A request's first position whose chain is not the root its call gives
  // (the request's identity): the chain check of such an entry, reported
  // apart so that KV of another identity reads as such.
  kIdentityMismatch = 1 << 8,
};

// The canary's device counters, one int64 each. kRingWrite is the ring's
// write index since the last poll; the others only grow.
enum Counter : int {
  kRecordCalls = 0,
  kVerifyCalls = 1,
  kSlotsRecorded = 2,
  kSlotsVerified = 3,
  kViolations = 4,
  kRingWrite = 5,
  kRingOverflow = 6,
  kNumCounters = 7,
};

// Names of the counters, in Counter order (Python reads them through the
// kvcanary::canary_counters op, so this is their one home).
constexpr const char* kCounterNames[kNumCounters] = {
    "record_calls", "verify_calls", "slots_recorded", "slots_verified",
    "violations",   "ring_write",   "ring_overflow"};

// The canary's tables as a kernel sees them, on the CPU and in a CUDA launch's
// arguments: Int is int64_t where the kernel writes the records and owner
// tags (record), const int64_t where it only reads them (verify).
template <typename Int>
struct CanaryTablePointers {
  Int* records;       // [capacity, kRecordFields]
  Int* owner_tags;    // [capacity]
  int64_t* counters;  // [kNumCounters]
  int64_t* ring;      // [ring_capacity, kViolationFields]
  int64_t ring_capacity;
  int64_t capacity;
};

// splitmix64(0xC0FFEE1234567890): the link of a request's first position.
constexpr uint64_t kChainAnchor = 0xDE7FAE23A9A1B716ull;

// The link a slot's successor stores as its chain.
KVC_HOST_DEVICE int64_t link_of(const int64_t* record) {
  return static_cast<int64_t>(mix3<uint64_t>(static_cast<uint64_t>(record[kChain]),
                                             static_cast<uint64_t>(record[kToken]),
                                             static_cast<uint64_t>(record[kPosition])));
}

// link(p) over a records table [capacity, kRecordFields]; p < 0 is a first
// position. The caller has checked p < capacity.
KVC_HOST_DEVICE int64_t link_at(const int64_t* records, int64_t p) {
  return p < 0 ? static_cast<int64_t>(kChainAnchor) : link_of(records + p * kRecordFields);
}

// The per-entry inputs of a record or verify call; a null pointer is an input
// not given (positions and tokens read as -1, prev_slots as -1, tags as
// "not checked", roots as "the anchor"). All are contiguous, int32 or int64
// as flagged, except tags (int64, one value for all entries when
// tags_broadcast) and roots (int64, one per entry: the link of an entry with
// no previous slot).
struct EntryInputs {
  const void* slots;
  const void* positions;
  const void* tokens;
  const void* prev_slots;
  bool slots_int32, positions_int32, tokens_int32, prev_slots_int32;
  const int64_t* tags;
  bool tags_broadcast;
  int64_t num_entries;
  const int64_t* roots;
};

// Entry i of a per-entry input; -1 where the input is not given.
KVC_HOST_DEVICE int64_t entry_input(const void* data, bool is_int32, int64_t i) {
  return data == nullptr ? -1 : load_index(data, is_int32, i);
}

KVC_HOST_DEVICE int64_t entry_slot(const EntryInputs& in, int64_t i) {
  return entry_input(in.slots, in.slots_int32, i);
}
KVC_HOST_DEVICE int64_t entry_position(const EntryInputs& in, int64_t i) {
  return entry_input(in.positions, in.positions_int32, i);
}
KVC_HOST_DEVICE int64_t entry_token(const EntryInputs& in, int64_t i) {
  return entry_input(in.tokens, in.tokens_int32, i);
}
KVC_HOST_DEVICE int64_t entry_prev_slot(const EntryInputs& in, int64_t i) {
  return entry_input(in.prev_slots, in.prev_slots_int32, i);
}
KVC_HOST_DEVICE int64_t entry_tag(const EntryInputs& in, int64_t i) {
  return in.tags[in.tags_broadcast ? 0 : i];
}

// Whether entry i, whose previous slot is p, is linked to its root: a first
// position (p < 0) of a call that gives roots.
KVC_HOST_DEVICE bool entry_rooted(const EntryInputs& in, int64_t p) {
  return p < 0 && in.roots != nullptr;
}

// link(p) of entry i: its root where it is rooted, else link_at. The caller
// has checked p < capacity.
KVC_HOST_DEVICE int64_t entry_link(const int64_t* records, const EntryInputs& in, int64_t i,
                                   int64_t p) {
  return entry_rooted(in, p) ? in.roots[i] : link_at(records, p);
}

// The checks of one verify entry at slot s (0 <= s < capacity, not padding;
// padding_slot is -1 when the canary has none):
// the reason bits, and the expected chain (the stored one where the chain is
// not checked, as SGLang reports it).
struct VerifyOutcome {
  int64_t reasons;
  int64_t expected_chain;
};

KVC_HOST_DEVICE VerifyOutcome verify_entry(const int64_t* records, const int64_t* owner_tags,
                                           const EntryInputs& in, int64_t i, int64_t s,
                                           int64_t fold_now, int64_t padding_slot) {
  const int64_t* record = records + s * kRecordFields;
  VerifyOutcome out{0, record[kChain]};
  if (in.prev_slots != nullptr) {
    const int64_t p = entry_prev_slot(in, i);
    if (padding_slot < 0 || p != padding_slot) {  // a chain through padding is unreachable
      out.expected_chain = entry_link(records, in, i, p);
      if (record[kChain] != out.expected_chain) {
        out.reasons |= entry_rooted(in, p) ? kIdentityMismatch : kChainMismatch;
      }
    }
  }
  if (in.positions != nullptr && record[kPosition] != entry_position(in, i)) {
    out.reasons |= kPositionMismatch;
  }
  if (record[kFold] != fold_now) out.reasons |= kFoldMismatch;
  if (in.tokens != nullptr) {
    const int64_t token = entry_token(in, i);
    if (token != -1 && record[kToken] != token) out.reasons |= kTokenMismatch;
  }
  if (in.tags != nullptr && owner_tags[s] != entry_tag(in, i)) out.reasons |= kOwnerMismatch;
  return out;
}

// The violation row of a verify entry.
KVC_HOST_DEVICE void verify_row(int64_t* row, const int64_t* records, const EntryInputs& in,
                                int64_t i, int64_t s, const VerifyOutcome& outcome) {
  const int64_t* record = records + s * kRecordFields;
  row[kRowKind] = kKindVerify;
  row[kRowSlot] = s;
  row[kRowPosition] = record[kPosition];
  row[kRowStoredToken] = record[kToken];
  row[kRowExpectedToken] = entry_token(in, i);
  row[kRowStoredChain] = record[kChain];
  row[kRowExpectedAux] = outcome.expected_chain;
  row[kRowReasons] = outcome.reasons;
}

// The row of an entry skipped because its slot or previous slot is past the
// capacity (nothing of the table is read).
KVC_HOST_DEVICE void out_of_range_row(int64_t* row, int64_t kind, const EntryInputs& in,
                                      int64_t i) {
  row[kRowKind] = kind;
  row[kRowSlot] = entry_slot(in, i);
  row[kRowPosition] = entry_position(in, i);
  row[kRowStoredToken] = -1;
  row[kRowExpectedToken] = entry_token(in, i);
  row[kRowStoredChain] = 0;
  row[kRowExpectedAux] = entry_prev_slot(in, i);
  row[kRowReasons] = kSlotOutOfRange;
}

}  // namespace kvcanary
