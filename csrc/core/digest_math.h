// The digest's addressing and unit fold (docs/spec.md, "The digest"), shared by the host
// (CPU kernel) and device (CUDA kernel) code. splitmix64, mix3 and the
// byte-offset arithmetic are the fold's (core/fold_math.h).
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#include "core/fold_math.h"

namespace kvcanary {

// A digest view [num_pages, page_size, units, *unit_shape] after validation.
// `unit` lays out unit 0 of each slot as the fold lays out a token: its bytes
// are the first unit.read_bytes bytes, in logical row-major order, of
//   unit.data + token_offset(unit, s) + k * unit_stride   (unit k of slot s).
struct DigestView {
  SourceLayout unit;  // read_bytes = the unit's byte count, a multiple of 4
  int64_t num_units;
  int64_t unit_stride;     // bytes
  uint64_t first_unit_id;  // unit_offsets[j]: the global id of unit 0
  // Bytes per aligned load of a unit's words (8, 4 or 1): the data pointer,
  // every stride of a dim longer than 1 and, when the unit has several runs,
  // the run length are multiples of it, so each load is aligned and lies in
  // one contiguous run.
  int32_t piece_bytes;
  // Whether every 16-byte chunk of the unit's whole chunks lies in one run
  // and is 16-byte aligned: the CUDA kernel then reads them with 128-bit loads.
  bool aligned_chunks;
};

KVC_HOST_DEVICE int64_t unit_words(const DigestView& view) {
  return (view.unit.read_bytes + 7) / 8;
}

template <typename T>
KVC_HOST_DEVICE T load_as(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
#endif
}

// Word `w` of the unit starting at `unit` (little-endian; the bytes past the
// unit's end, at most 4, read as zero), in loads of view.piece_bytes.
KVC_HOST_DEVICE uint64_t unit_word(const DigestView& view, const unsigned char* unit, int64_t w) {
  const int64_t first = w * 8;
  const int64_t left = view.unit.read_bytes - first;
  const int64_t size = left < 8 ? left : 8;
  if (view.piece_bytes == 8 && size == 8) {
    return load_as<uint64_t>(unit + chunk_offset(view.unit, first));
  }
  const int64_t piece = view.piece_bytes >= 4 ? 4 : 1;
  uint64_t word = 0;
  for (int64_t b = 0; b < size; b += piece) {
    const unsigned char* p = unit + chunk_offset(view.unit, first + b);
    const uint64_t bits = piece == 4 ? load_as<uint32_t>(p) : *p;
    word |= bits << (8 * b);
  }
  return word;
}

// The unit fold of the unit at `unit`, one word at a time.
KVC_HOST_DEVICE uint64_t unit_fold(const DigestView& view, const unsigned char* unit) {
  uint64_t h = 0;
  const int64_t words = unit_words(view);
  for (int64_t w = 0; w < words; ++w) {
    h = splitmix64(h ^ unit_word(view, unit, w));
  }
  return h;
}

KVC_HOST_DEVICE const unsigned char* unit_address(const DigestView& view, int64_t slot, int64_t k) {
  return view.unit.data + token_offset(view.unit, slot) + k * view.unit_stride;
}

}  // namespace kvcanary
