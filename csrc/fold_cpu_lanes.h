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

// Whether `slot` is folded; padding (negative) and out-of-range slots give 0.
bool live(const CpuFoldRange& range, int64_t slot) { return slot >= 0 && slot < range.capacity; }

// Requests the tokens of the work after the current fold (the next source of
// a group, or the first source of the next group) while the current one is
// folded. Up to kAtOnceLines lines in all are requested at once (a short
// next work gains more from an early start); more a piece of up to
// kPieceLines lines at a time, token by token, paced over the steps of the
// fold: a core keeps only so many misses in flight and drops the requests of
// a burst beyond them, and a token's lines requested in order reach memory as
// one run. Random 1 KiB rows folded 1.8x slower with all requested at once,
// 1.45x slower with the same line of every token in turn, and 4 KiB rows 1.3x
// slower in whole-token pieces (docs/benchmarks.md).
class TokenPrefetch {
 public:
  // Plans the tokens of `src` for `count` slots (at most kLaneGroupMultiple),
  // skipping those `range` does not fold: their first kMaxLines lines.
  template <typename index_t>
  void plan(const CpuFoldRange& range, const SourceLayout& src, const index_t* slots, int64_t count) {
    num_lines_ = 0;
    for (int64_t byte = 0; byte < src.read_bytes && num_lines_ < kMaxLines; byte += kLineBytes) {
      line_offsets_[num_lines_++] = chunk_offset(src, byte);
    }
    const bool at_once = count * num_lines_ <= kAtOnceLines;
    num_tokens_ = 0;
    for (int64_t i = 0; i < count; ++i) {
      if (!live(range, slots[i])) continue;
      const unsigned char* token = src.data + token_offset(src, slots[i]);
      if (at_once) {
        request(token, 0, num_lines_);
      } else {
        tokens_[num_tokens_++] = token;
      }
    }
    num_pieces_ = num_tokens_ * ((num_lines_ + kPieceLines - 1) / kPieceLines);
    token_ = 0;
    line_ = 0;
  }

  // Spreads the pieces planned over `steps` calls of step().
  void pace(int64_t steps) {
    steps_ = steps > 1 ? steps : 1;
    credit_ = 0;
  }

  // Always inlined, like everything that prefetches here: GCC counts a
  // prefetch as no effect at all and may drop calls of a function that only
  // prefetches (it did here until 2026-11-30).
  [[gnu::always_inline]] void step() {
    credit_ += num_pieces_;
    for (; credit_ >= steps_ && token_ < num_tokens_; credit_ -= steps_) request_piece();
  }

  [[gnu::always_inline]] void finish() {
    while (token_ < num_tokens_) request_piece();
  }

 private:
  // 4 KiB of each token: a group's next tokens then take at most 256 KiB,
  // a fraction of L2.
  static constexpr int kMaxLines = 64;
  static constexpr int kAtOnceLines = 128;  // 8 KiB
  static constexpr int kPieceLines = 16;
  static constexpr int64_t kLineBytes = 64;
  static constexpr int kLocality = 3;  // __builtin_prefetch: into L1 and L2

  [[gnu::always_inline]] void request(const unsigned char* token, int first, int end) {
    for (int line = first; line < end; ++line) {
      __builtin_prefetch(token + line_offsets_[line], 0, kLocality);
    }
  }

  // The piece at [line_, line_ + kPieceLines) of token_, then the cursor moves on.
  [[gnu::always_inline]] void request_piece() {
    if (num_lines_ <= kPieceLines) return request(tokens_[token_++], 0, num_lines_);  // whole tokens
    const int end = line_ + kPieceLines < num_lines_ ? line_ + kPieceLines : num_lines_;
    request(tokens_[token_], line_, end);
    line_ = end < num_lines_ ? end : 0;
    token_ += end == num_lines_;
  }

  const unsigned char* tokens_[kLaneGroupMultiple];
  int64_t line_offsets_[kMaxLines];
  int num_lines_ = 0;
  int num_tokens_ = 0;
  int num_pieces_ = 0;  // paces the requests
  int token_ = 0;
  int line_ = 0;
  int64_t steps_ = 1;
  int64_t credit_ = 0;
};

template <class V, int kVectors>
struct LaneFold {
  using Vec = typename V::Vec;
  static constexpr int kSlots = V::kLanes * kVectors;
  static_assert(kLaneGroupMultiple % kSlots == 0, "tasks must hold whole lane groups");
  static constexpr int kBlockWords = 2 * V::kBlockChunks;
  static constexpr int64_t kBlockBytes = V::kBlockChunks * kReadAlign;
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

  // The whole blocks of one source for kSlots lanes; returns the bytes folded.
  // Software-pipelined: while the words of one block are hashed (word by word
  // across the vectors, independent chains side by side), the next block is
  // loaded and transposed into the other half of a small staging buffer, one
  // vector per step, so loads overlap the hash instead of alternating with it.
  static int64_t fold_blocks(const SourceLayout& src, const unsigned char* const* tokens,
                             Vec* h, TokenPrefetch& prefetch) {
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
      KVC_UNROLL for (int w = 0; w < kBlockWords; ++w) {
        KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] = splitmix64(h[v] ^ stage[cur][v][w]);
        prefetch.step();
        if (load_next && w % kWordsPerLoad == 0) {
          V::load_block(tokens + (w / kWordsPerLoad) * V::kLanes, next, stage[cur ^ 1][w / kWordsPerLoad]);
        }
      }
    }
    return num_blocks * kBlockBytes;
  }

  // h of each lane over the read_bytes of `src`, lane i reading tokens[i]
  // (every token laid out as `src` says), while `prefetch` requests the next
  // work's tokens a few lines per step.
  static void fold_tokens(const SourceLayout& src, const unsigned char* const* tokens,
                          Vec* h, TokenPrefetch& prefetch) {
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] = V::zero();
    const bool by_blocks = takes_block_path(src);
    const int64_t block_bytes = by_blocks ? src.read_bytes / kBlockBytes * kBlockBytes : 0;
    prefetch.pace(block_bytes / kBlockBytes * kBlockWords + (src.read_bytes - block_bytes) / kReadAlign);
    int64_t byte = 0;
    if constexpr (V::kBlockChunks > 1) {
      if (by_blocks) byte = fold_blocks(src, tokens, h, prefetch);
    }
    for (; byte < src.read_bytes; byte += kReadAlign) {
      prefetch.step();
      const int64_t offset = chunk_offset(src, byte);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
        Vec lo, hi;
        V::load_chunks(tokens + v * V::kLanes, offset, &lo, &hi);
        h[v] = fold_chunk(h[v], lo, hi);
      }
    }
    prefetch.finish();
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
    TokenPrefetch prefetch;
    for (int s = 0; s < range.num_sources; ++s) {
      const SourceLayout& src = range.sources[s];
      for (int i = 0; i < kSlots; ++i) {
        tokens[i] = src.data + token_offset(src, slots[i]);
      }
      if (s + 1 < range.num_sources) {
        prefetch.plan(range, range.sources[s + 1], slots, kSlots);
      } else {
        prefetch.plan(range, range.sources[0], next, next_count);
      }
      Vec h[kVectors];
      fold_tokens(src, tokens, h, prefetch);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) acc[v] = splitmix64(acc[v] ^ h[v]);
    }
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(out + v * V::kLanes, acc[v]);
  }

  template <typename index_t>
  static void fold_range(const CpuFoldRange& range) {
    const auto* slots = static_cast<const index_t*>(range.slots);
    int64_t group[kSlots];
    int64_t folded[kSlots];
    for (int64_t first = range.begin; first < range.end; first += kSlots) {
      const int count = static_cast<int>(
          range.end - first < kSlots ? range.end - first : kSlots);
      int64_t stand_in = -1;
      bool all_live = count == kSlots;
      for (int i = 0; i < count; ++i) {
        group[i] = slots[first + i];
        if (!live(range, group[i])) {
          all_live = false;
        } else if (stand_in < 0) {
          stand_in = group[i];
        }
      }
      if (stand_in < 0 || range.num_sources == 0) {
        for (int i = 0; i < count; ++i) range.out[first + i] = 0;
        continue;
      }
      // The next group: this range's, or after its last group the first of
      // the range this thread folds next.
      const bool last = first + count == range.end;
      const int64_t next_first = last ? range.next_begin : first + count;
      const int64_t next_end = last ? range.next_end : range.end;
      const index_t* next = slots + next_first;
      const int64_t next_count = next_end - next_first < kSlots ? next_end - next_first : kSlots;
      if (all_live) {
        fold_group(range, group, range.out + first, next, next_count);
        continue;
      }
      // Padding, out-of-range and missing lanes fold a live slot of the
      // group instead (every read stays inside the sources) and give 0.
      for (int i = 0; i < kSlots; ++i) {
        if (i >= count || !live(range, group[i])) group[i] = stand_in;
      }
      fold_group(range, group, folded, next, next_count);
      for (int i = 0; i < count; ++i) {
        range.out[first + i] = live(range, slots[first + i]) ? folded[i] : 0;
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
    int64_t stand_in = -1;  // read instead of padding and out-of-range slots
    for (int i = 0; i < count && stand_in < 0; ++i) {
      if (live(range, slots[i])) stand_in = slots[i];
    }
    uint64_t acc[kLaneGroupMultiple] = {};
    const unsigned char* tokens[kSlots];
    int64_t h_lanes[kSlots];
    TokenPrefetch none;  // pairs are not prefetched
    int source = 0, slot = 0;  // the next pair
    while (stand_in >= 0 && source < range.num_sources) {
      const int first_source = source, first_slot = slot;
      int pairs = 0;
      for (; pairs < kSlots && source < range.num_sources; ++pairs) {
        const SourceLayout& src = range.sources[source];
        tokens[pairs] = src.data + token_offset(src, live(range, slots[slot]) ? slots[slot] : stand_in);
        if (++slot == count) slot = 0, ++source;
      }
      for (int lane = pairs; lane < kSlots; ++lane) tokens[lane] = tokens[0];
      Vec h[kVectors];
      fold_tokens(range.sources[first_source], tokens, h, none);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(h_lanes + v * V::kLanes, h[v]);
      for (int lane = 0, i = first_slot; lane < pairs; ++lane) {
        acc[i] = splitmix64(acc[i] ^ static_cast<uint64_t>(h_lanes[lane]));
        if (++i == count) i = 0;
      }
    }
    for (int i = 0; i < count; ++i) {
      range.out[range.begin + i] = live(range, slots[i]) ? static_cast<int64_t>(acc[i]) : 0;
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
    CpuFoldRange rest = range;
    rest.begin = whole.end;
    if (rest.begin < rest.end) {
      whole.next_begin = rest.begin;
      whole.next_end = rest.end;
    }
    if (whole.end > whole.begin) fold_range<index_t>(whole);
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
