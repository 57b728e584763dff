// The CPU fold, written once for any lane type. Included by each
// instruction-set translation unit after it has set its target.
//
// The splitmix64 chain is serial within a slot, so speed comes from folding
// many slots at once: kVectors vectors of V::kLanes slots each run
// independent chains side by side. A lane type provides
//   Vec                      uint64 lanes with ^, logical >>, * by a constant
//   kLanes                   slots per Vec
//   zero()
//   load_chunks(tokens, offset, &lo, &hi)
//                            the 16-byte chunk at tokens[i] + offset of each
//                            lane i, split into its low and high words
//   store(out, vec)          the lanes, in order, to out[0..kLanes)
#pragma once

#include "fold_cpu.h"
#include "fold_math.h"

namespace kvcanary {
namespace {

template <class V, int kVectors>
struct LaneFold {
  using Vec = typename V::Vec;
  static constexpr int kSlots = V::kLanes * kVectors;

  // out[0..kSlots) for kSlots slots, all in range.
  static void fold_group(const CpuFoldRange& range, const int64_t* slots,
                         int64_t* out) {
    Vec acc[kVectors];
    for (int v = 0; v < kVectors; ++v) acc[v] = V::zero();
    const unsigned char* tokens[kSlots];
    for (int s = 0; s < range.num_sources; ++s) {
      const SourceLayout& src = range.sources[s];
      for (int i = 0; i < kSlots; ++i) {
        tokens[i] = src.data + token_offset(src, slots[i]);
      }
      Vec h[kVectors];
      for (int v = 0; v < kVectors; ++v) h[v] = V::zero();
      for (int64_t byte = 0; byte < src.read_bytes; byte += kReadAlign) {
        const int64_t offset = chunk_offset(src, byte);
        for (int v = 0; v < kVectors; ++v) {
          Vec lo, hi;
          V::load_chunks(tokens + v * V::kLanes, offset, &lo, &hi);
          h[v] = fold_chunk(h[v], lo, hi);
        }
      }
      for (int v = 0; v < kVectors; ++v) acc[v] = splitmix64(acc[v] ^ h[v]);
    }
    for (int v = 0; v < kVectors; ++v) V::store(out + v * V::kLanes, acc[v]);
  }

  template <typename index_t>
  static void fold_range(const CpuFoldRange& range) {
    const auto* slots = static_cast<const index_t*>(range.slots);
    const auto live = [&](int64_t slot) {
      return slot >= 0 && slot < range.capacity;
    };
    int64_t group[kSlots];
    int64_t folded[kSlots];
    for (int64_t first = range.begin; first < range.end; first += kSlots) {
      const int count = static_cast<int>(
          range.end - first < kSlots ? range.end - first : kSlots);
      // Padding, out-of-range and missing lanes fold a live slot of the
      // group instead (every read stays inside the sources) and give 0.
      int64_t stand_in = -1;
      for (int i = 0; i < count && stand_in < 0; ++i) {
        if (live(slots[first + i])) stand_in = slots[first + i];
      }
      if (stand_in < 0 || range.num_sources == 0) {
        for (int i = 0; i < count; ++i) range.out[first + i] = 0;
        continue;
      }
      for (int i = 0; i < kSlots; ++i) {
        const int64_t slot = i < count ? static_cast<int64_t>(slots[first + i]) : -1;
        group[i] = live(slot) ? slot : stand_in;
      }
      fold_group(range, group, folded);
      for (int i = 0; i < count; ++i) {
        range.out[first + i] = live(slots[first + i]) ? folded[i] : 0;
      }
    }
  }

  static void run(const CpuFoldRange& range) {
    if (range.slots_are_int32) {
      fold_range<int32_t>(range);
    } else {
      fold_range<int64_t>(range);
    }
  }
};

}  // namespace
}  // namespace kvcanary
