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
//   kBlockChunks, load_block(tokens, offset, words)
//                            optional (kBlockChunks > 1): kBlockChunks
//                            contiguous chunks of each lane at once, as
//                            2 * kBlockChunks vectors of words, in order
//   store(out, vec)          the lanes, in order, to out[0..kLanes)
#pragma once

#include "fold_cpu.h"
#include "fold_math.h"

// The per-vector loops must be unrolled for the vectors to stay in registers.
#if defined(__clang__)
#define KVC_UNROLL _Pragma("unroll")
#else
#define KVC_UNROLL _Pragma("GCC unroll 16")
#endif

namespace kvcanary {
namespace {

template <class V, int kVectors>
struct LaneFold {
  using Vec = typename V::Vec;
  static constexpr int kSlots = V::kLanes * kVectors;
  static_assert(kLaneGroupMultiple % kSlots == 0, "tasks must hold whole lane groups");
  static constexpr int kBlockWords = 2 * V::kBlockChunks;
  static constexpr int64_t kBlockBytes = V::kBlockChunks * kReadAlign;
  // Lines this many blocks ahead are requested into L2 while a block is
  // hashed: about one memory latency at the hash's pace.
  static constexpr int64_t kPrefetchBlocks = 2;
  static constexpr int kPrefetchToL2 = 1;  // __builtin_prefetch locality: prefetcht2
  // Tokens up to this long are prefetched whole (prefetches_whole).
  static constexpr int64_t kWholePrefetchBytes = 512;
  static constexpr int64_t kLineBytes = 64;
  // Sources read at least this far fold a short batch by (source, slot) pairs
  // (fold_pairs): shorter chains gain less from running side by side than the
  // pairs' bookkeeping costs (AVX-512, 16 slots of 64 sources: 32 bytes 6.8 us
  // by slots against 12.5 by pairs, 128 bytes 28.1 against 26.5, 256 bytes
  // 50.9 against 40.5; one slot of 256 bytes: 44 against 3 us).
  static constexpr int64_t kPairsMinBytes = 128;

  // Whether fold_group reads `src` in blocks (its runs hold whole blocks).
  static bool takes_block_path(const SourceLayout& src) {
    return V::kBlockChunks > 1 && (src.num_outer == 0 || src.run_bytes % kBlockBytes == 0);
  }

  // Whether prefetch_tokens requests the tokens of `src`: whole, when they are
  // short (the in-row prefetch of fold_blocks starts too late for them) and
  // not at most two blocks, which fold_blocks loads at once anyway.
  // In-process on AVX-512: 256 and 512-byte rows 30% faster, PARTIAL 5%;
  // 64-byte and 1 KiB rows were 10% and 7% slower with it, 4 KiB unchanged.
  static bool prefetches_whole(const SourceLayout& src) {
    const bool loaded_at_once = takes_block_path(src) && src.read_bytes % kBlockBytes == 0 &&
                                src.read_bytes <= 2 * kBlockBytes;
    return !loaded_at_once && src.read_bytes <= kWholePrefetchBytes;
  }

  // The whole blocks of one source for kSlots lanes; returns the bytes folded.
  // Software-pipelined: while the words of one block are hashed (word by word
  // across the vectors, independent chains side by side), the next block is
  // loaded and transposed into the other half of a small staging buffer, one
  // vector per step, so loads overlap the hash instead of alternating with it.
  static int64_t fold_blocks(const SourceLayout& src, const unsigned char* const* tokens,
                             Vec* h) {
    static_assert(kBlockWords % kVectors == 0, "one vector is loaded per word step");
    constexpr int kWordsPerLoad = kBlockWords / kVectors;
    const int64_t num_blocks = src.read_bytes / kBlockBytes;
    if (num_blocks == 0) return 0;
    Vec stage[2][kVectors][kBlockWords];
    const int64_t first = chunk_offset(src, 0);
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
      V::load_block(tokens + v * V::kLanes, first, stage[0][v]);
    }
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int cur = static_cast<int>(block & 1);
      const bool load_next = block + 1 < num_blocks;
      const int64_t next = load_next ? chunk_offset(src, (block + 1) * kBlockBytes) : 0;
      const bool prefetch = block + kPrefetchBlocks < num_blocks;
      const int64_t ahead = prefetch ? chunk_offset(src, (block + kPrefetchBlocks) * kBlockBytes) : 0;
      KVC_UNROLL for (int w = 0; w < kBlockWords; ++w) {
        KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] = splitmix64(h[v] ^ stage[cur][v][w]);
        if (w % kWordsPerLoad == 0) {
          const unsigned char* const* lanes = tokens + (w / kWordsPerLoad) * V::kLanes;
          if (prefetch) {
            for (int i = 0; i < V::kLanes; ++i) __builtin_prefetch(lanes[i] + ahead, 0, kPrefetchToL2);
          }
          if (load_next) V::load_block(lanes, next, stage[cur ^ 1][w / kWordsPerLoad]);
        }
      }
    }
    return num_blocks * kBlockBytes;
  }

  // h of each lane over the read_bytes of `src`, lane i reading tokens[i]
  // (every token laid out as `src` says).
  static void fold_tokens(const SourceLayout& src, const unsigned char* const* tokens,
                          Vec* h) {
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] = V::zero();
    int64_t byte = 0;
    if constexpr (V::kBlockChunks > 1) {
      if (takes_block_path(src)) byte = fold_blocks(src, tokens, h);
    }
    for (; byte < src.read_bytes; byte += kReadAlign) {
      const int64_t offset = chunk_offset(src, byte);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
        Vec lo, hi;
        V::load_chunks(tokens + v * V::kLanes, offset, &lo, &hi);
        h[v] = fold_chunk(h[v], lo, hi);
      }
    }
  }

  // Starts loading the tokens of `src` for `count` slots into L2 (skipping
  // slots out of range), when prefetches_whole(src). Always inlined: GCC
  // counts a prefetch as no effect at all, so it drops every call of a
  // function that only prefetches (it did here, until 2026-11-30).
  template <typename index_t>
  [[gnu::always_inline]] static void prefetch_tokens(const CpuFoldRange& range,
                                                     const SourceLayout& src,
                                                     const index_t* slots, int64_t count) {
    if (!prefetches_whole(src)) return;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0 || slot >= range.capacity) continue;
      const unsigned char* token = src.data + token_offset(src, slot);
      __builtin_prefetch(token, 0, kPrefetchToL2);  // apart: rows of one line pay for the loop
      for (int64_t byte = kLineBytes; byte < src.read_bytes; byte += kLineBytes) {
        __builtin_prefetch(token + chunk_offset(src, byte), 0, kPrefetchToL2);
      }
    }
  }

  // out[0..kSlots) for kSlots slots, all in range. While one source is
  // folded, the next one's tokens are prefetched: this group's, or after the
  // last source the first source's of the next group (`next`, `next_count`
  // slots), so that the prefetches run one source's work ahead.
  template <typename index_t>
  static void fold_group(const CpuFoldRange& range, const int64_t* slots, int64_t* out,
                         const index_t* next, int64_t next_count) {
    Vec acc[kVectors];
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) acc[v] = V::zero();
    const unsigned char* tokens[kSlots];
    for (int s = 0; s < range.num_sources; ++s) {
      const SourceLayout& src = range.sources[s];
      for (int i = 0; i < kSlots; ++i) {
        tokens[i] = src.data + token_offset(src, slots[i]);
      }
      if (s + 1 < range.num_sources) {
        prefetch_tokens(range, range.sources[s + 1], slots, kSlots);
      } else {
        prefetch_tokens(range, range.sources[0], next, next_count);
      }
      Vec h[kVectors];
      fold_tokens(src, tokens, h);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) acc[v] = splitmix64(acc[v] ^ h[v]);
    }
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(out + v * V::kLanes, acc[v]);
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
      int64_t stand_in = -1;
      bool all_live = count == kSlots;
      for (int i = 0; i < count; ++i) {
        group[i] = slots[first + i];
        if (!live(group[i])) {
          all_live = false;
        } else if (stand_in < 0) {
          stand_in = group[i];
        }
      }
      if (stand_in < 0 || range.num_sources == 0) {
        for (int i = 0; i < count; ++i) range.out[first + i] = 0;
        continue;
      }
      const index_t* next = slots + first + count;
      const int64_t next_count = range.end - first - count < kSlots ? range.end - first - count : kSlots;
      if (all_live) {
        fold_group(range, group, range.out + first, next, next_count);
        continue;
      }
      // Padding, out-of-range and missing lanes fold a live slot of the
      // group instead (every read stays inside the sources) and give 0.
      for (int i = 0; i < kSlots; ++i) {
        if (i >= count || !live(group[i])) group[i] = stand_in;
      }
      fold_group(range, group, folded, next, next_count);
      for (int i = 0; i < count; ++i) {
        range.out[first + i] = live(slots[first + i]) ? folded[i] : 0;
      }
    }
  }

  // Whether every source reads the same bytes of its token (read_bytes and the
  // runs inside a token alike), so that a vector may fold a different source
  // in each lane.
  static bool same_token_layout(const CpuFoldRange& range) {
    const SourceLayout& first = range.sources[0];
    for (int s = 1; s < range.num_sources; ++s) {
      const SourceLayout& src = range.sources[s];
      if (src.read_bytes != first.read_bytes || src.num_outer != first.num_outer ||
          (src.num_outer > 0 && src.run_bytes != first.run_bytes)) {
        return false;
      }
      for (int d = 0; d < src.num_outer; ++d) {
        if (src.outer_size[d] != first.outer_size[d] || src.outer_stride[d] != first.outer_stride[d]) {
          return false;
        }
      }
    }
    return true;
  }

  // Fewer slots than a lane group (kLaneGroupMultiple) over sources of one
  // token layout: lanes take (source, slot) pairs, so that the sources' chains
  // run side by side instead of one after another (a decode step: a few
  // slots, a K and a V source per layer). Pairs go source by source, so each
  // slot's fingerprints combine in source order.
  template <typename index_t>
  static void fold_pairs(const CpuFoldRange& range) {
    const auto* slots = static_cast<const index_t*>(range.slots) + range.begin;
    const int count = static_cast<int>(range.end - range.begin);
    const auto live = [&](int64_t slot) { return slot >= 0 && slot < range.capacity; };
    int64_t stand_in = -1;  // read instead of padding and out-of-range slots
    for (int i = 0; i < count && stand_in < 0; ++i) {
      if (live(slots[i])) stand_in = slots[i];
    }
    uint64_t acc[kLaneGroupMultiple] = {};
    const unsigned char* tokens[kSlots];
    int64_t h_lanes[kSlots];
    int source = 0, slot = 0;  // the next pair
    while (stand_in >= 0 && source < range.num_sources) {
      const int first_source = source, first_slot = slot;
      int pairs = 0;
      for (; pairs < kSlots && source < range.num_sources; ++pairs) {
        const SourceLayout& src = range.sources[source];
        tokens[pairs] = src.data + token_offset(src, live(slots[slot]) ? slots[slot] : stand_in);
        if (++slot == count) slot = 0, ++source;
      }
      for (int lane = pairs; lane < kSlots; ++lane) tokens[lane] = tokens[0];
      Vec h[kVectors];
      fold_tokens(range.sources[first_source], tokens, h);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(h_lanes + v * V::kLanes, h[v]);
      for (int lane = 0, i = first_slot; lane < pairs; ++lane) {
        acc[i] = splitmix64(acc[i] ^ static_cast<uint64_t>(h_lanes[lane]));
        if (++i == count) i = 0;
      }
    }
    for (int i = 0; i < count; ++i) {
      range.out[range.begin + i] = live(slots[i]) ? static_cast<int64_t>(acc[i]) : 0;
    }
  }

  // Folds what is left after whole groups, by pairs or by slots.
  template <typename index_t>
  static void fold_rest(const CpuFoldRange& rest, bool by_pairs) {
    if (by_pairs) {
      fold_pairs<index_t>(rest);
    } else {
      fold_range<index_t>(rest);
    }
  }

  // Whole groups of kSlots, and what is left (the end of a batch, or all of a
  // small one) in as few vectors as hold it: a few slots should not cost the
  // hashing of kSlots lanes, and up to four vectors fold in about the time of
  // one (their chains' latency bounds them, not the vector ports). When the
  // sources share a token layout, the rest's lanes take (source, slot) pairs.
  template <typename index_t>
  static void fold_batch(const CpuFoldRange& range) {
    CpuFoldRange whole = range;
    whole.end = range.begin + (range.end - range.begin) / kSlots * kSlots;
    if (whole.end > whole.begin) fold_range<index_t>(whole);
    CpuFoldRange rest = range;
    rest.begin = whole.end;
    if (rest.begin == rest.end) return;
    const bool by_pairs = range.num_sources > 1 && range.sources[0].read_bytes >= kPairsMinBytes &&
                          same_token_layout(range);
    const int64_t lanes = (rest.end - rest.begin) * (by_pairs ? range.num_sources : 1);
    const int64_t vectors = (lanes + V::kLanes - 1) / V::kLanes;
    if (vectors <= 1) return LaneFold<V, 1>::template fold_rest<index_t>(rest, by_pairs);
    if (vectors <= 2) return LaneFold<V, 2>::template fold_rest<index_t>(rest, by_pairs);
    if (vectors <= 4) return LaneFold<V, 4>::template fold_rest<index_t>(rest, by_pairs);
    fold_rest<index_t>(rest, by_pairs);
  }

  static void run(const CpuFoldRange& range) {
    if (range.slots_are_int32) {
      fold_batch<int32_t>(range);
    } else {
      fold_batch<int64_t>(range);
    }
  }
};

}  // namespace
}  // namespace kvcanary
