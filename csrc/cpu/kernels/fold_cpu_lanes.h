// The CPU fold, written once for any lane type. Included by each
// instruction-set unit after it has set its target; everything here has
// internal linkage (see cpu/kernels/fold_cpu.h).
//
// The splitmix64 chain is serial within a slot, so speed comes from folding
// many slots at once: kVectors vectors of V::kLanes slots each (a lane group
// of kSlots slots) run independent chains side by side. A lane type provides
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
//
// The calls, from the top (each one calls those below it):
//   fold_task          a task: its whole lane groups, then its tail
//   fold_tail          the tail, in as few vectors as hold it
//   fold_groups        consecutive lane groups of a span of slots, each with
//                      its side work (fold_cpu.h: FoldSideWork)
//   fold_by_pairs      a short span, its lanes taking (source, slot) pairs
//   fold_group         one lane group over every source
//   hash_tokens        one source's bytes of each lane's token
//   hash_token_blocks  the same, in blocks of several chunks (AVX-512)
//   hash_blocks        the software pipeline of the blocks
// The prefetch plan (cpu/kernels/fold_cpu_prefetch.h) is made in fold_groups and
// fold_group, and its requests (the tokens read next, and the side work's
// lines of the group folded next) are issued step by step in hash_tokens.
#pragma once

#include <type_traits>

#include "core/fold_math.h"
#include "cpu/kernels/fold_cpu.h"
#include "cpu/kernels/fold_cpu_prefetch.h"

// The per-vector loops must be unrolled for the vectors to stay in registers.
#if defined(__clang__)
#define KVC_UNROLL _Pragma("unroll")
#else
#define KVC_UNROLL _Pragma("GCC unroll 16")
#endif

namespace kvcanary {
namespace {

// Calls run(std::integral_constant<int, n>{}) with n the fewest of 1, 2 and 4
// vectors, below kMost, that hold `vectors`, else kMost: a few lanes should
// not cost the hashing of kMost vectors, and up to four vectors hash in about
// the time of one (their chains' latency bounds them, not the vector ports).
template <int kMost, class Run>
void in_fewest_vectors(int64_t vectors, Run&& run) {
  if constexpr (kMost > 1) {
    if (vectors <= 1) return run(std::integral_constant<int, 1>{});
  }
  if constexpr (kMost > 2) {
    if (vectors <= 2) return run(std::integral_constant<int, 2>{});
  }
  if constexpr (kMost > 4) {
    if (vectors <= 4) return run(std::integral_constant<int, 4>{});
  }
  run(std::integral_constant<int, kMost>{});
}

template <class V, int kVectors>
struct LaneFold {
  using Vec = typename V::Vec;
  static constexpr int kSlots = V::kLanes * kVectors;
  static_assert(kLaneGroupMultiple % kSlots == 0, "tasks must hold whole lane groups");
  static constexpr int kBlockWords = 2 * V::kBlockChunks;
  static constexpr int64_t kBlockBytes = V::kBlockChunks * kReadAlign;
  // A tail over several sources read at least this far is folded by (source,
  // slot) pairs: shorter chains gain less from running side by side than the
  // pairs' bookkeeping costs.
  static constexpr int64_t kPairsMinBytes = 128;

  // Folds `task` of `work`, then (through the prefetch plan) warms `next`;
  // the work's side work (FoldSideWork), if any, goes along group by group.
  static void fold_task(const CpuFoldWork& work, SlotSpan task, SlotSpan next) {
    if (work.side.lines == nullptr) {
      NoSide side;
      fold_task_with(work, task, next, side);
    } else {
      SidePrefetcher side(work.side);
      fold_task_with(work, task, next, side);
    }
  }

  template <class Side>
  static void fold_task_with(const CpuFoldWork& work, SlotSpan task, SlotSpan next, Side& side) {
    side.request_now(first_group(task));
    if (work.slots_are_int32) {
      fold_task_indexed<int32_t>(work, task, next, side);
    } else {
      fold_task_indexed<int64_t>(work, task, next, side);
    }
  }

  template <typename index_t, class Side>
  static void fold_task_indexed(const CpuFoldWork& work, SlotSpan task, SlotSpan next, Side& side) {
    const SlotSpan whole{task.begin, task.begin + (task.end - task.begin) / kSlots * kSlots};
    const SlotSpan tail{whole.end, task.end};
    const bool has_tail = tail.begin < tail.end;
    if (whole.begin < whole.end) {
      fold_groups<index_t>(work, whole, has_tail ? tail : next, side);
    }
    if (has_tail) {
      fold_tail<index_t>(work, tail, next, side);
    }
  }

  // The first group of kSlots slots of `span` (shorter when the span is).
  static SlotSpan first_group(SlotSpan span) {
    return {span.begin, span.begin + smaller(span.end - span.begin, kSlots)};
  }

  // The end of a task, or all of a small one (fewer slots than a group), in
  // as few vectors as hold it (in_fewest_vectors). When the sources share a
  // token layout, the lanes take (source, slot) pairs.
  template <typename index_t, class Side>
  static void fold_tail(const CpuFoldWork& work, SlotSpan tail, SlotSpan next, Side& side) {
    const bool by_pairs = takes_pairs(work);
    const int64_t lanes = (tail.end - tail.begin) * (by_pairs ? work.num_sources : 1);
    in_fewest_vectors<kVectors>((lanes + V::kLanes - 1) / V::kLanes, [&](auto vectors) {
      LaneFold<V, decltype(vectors)::value>::template fold_span<index_t>(work, tail, next, by_pairs,
                                                                         side);
    });
  }

  template <typename index_t, class Side>
  static void fold_span(const CpuFoldWork& work, SlotSpan span, SlotSpan next, bool by_pairs,
                        Side& side) {
    if (by_pairs) {
      fold_by_pairs<index_t>(work, span);
      side.finish();
      side.after(span);
    } else {
      fold_groups<index_t>(work, span, next, side);
    }
  }

  // The groups of kSlots slots of `span`, in order (the last one may be
  // short); `next` is what the thread folds after the span. A group's padding,
  // out-of-range and missing lanes fold a folded slot of the group instead
  // (every read stays inside the sources) and give 0; a group with nothing to
  // fold reads nothing. While a group is hashed, the side lines of the group
  // after it are requested; its side work runs once its folds are out.
  template <typename index_t, class Side>
  static void fold_groups(const CpuFoldWork& work, SlotSpan span, SlotSpan next, Side& side) {
    const auto* slots = static_cast<const index_t*>(work.slots);
    const ReadOrder<index_t> order(work, span, next, kSlots);
    int64_t steps = 0;  // a group's hashing steps, over which its side requests are paced
    for (int s = 0; s < work.num_sources; ++s) steps += hash_steps(work.sources[s]);
    int64_t group[kSlots];
    int64_t folded[kSlots];
    for (int64_t first = span.begin; first < span.end; first += kSlots) {
      const int count = static_cast<int>(smaller(span.end - first, kSlots));
      side.plan(first_group(first + kSlots < span.end ? SlotSpan{first + kSlots, span.end} : next),
                steps);
      fold_group_or_zeros(work, slots, order, first, count, group, folded, side);
      side.finish();
      side.after(SlotSpan{first, first + count});
    }
  }

  // out[first..first + count) = the folds of the group of `count` slots at
  // index `first` (see fold_groups).
  template <typename index_t, class Side>
  static void fold_group_or_zeros(const CpuFoldWork& work, const index_t* slots,
                                  const ReadOrder<index_t>& order, int64_t first, int count,
                                  int64_t* group, int64_t* folded, Side& side) {
    const int64_t stand_in = stand_in_of(work, slots + first, count);
    if (stand_in < 0 || work.num_sources == 0) {
      for (int i = 0; i < count; ++i) work.out[first + i] = 0;
      return;
    }
    bool all_folded = count == kSlots;
    for (int i = 0; i < kSlots; ++i) {
      const bool read = i < count && is_folded(work, slots[first + i]);
      group[i] = read ? static_cast<int64_t>(slots[first + i]) : stand_in;
      all_folded = all_folded && read;
    }
    if (all_folded) {
      fold_group(work, group, order, first, work.out + first, side);
      return;
    }
    fold_group(work, group, order, first, folded, side);
    for (int i = 0; i < count; ++i) {
      work.out[first + i] = is_folded(work, slots[first + i]) ? folded[i] : 0;
    }
  }

  // The slot read in place of the padding, out-of-range and missing ones of
  // `count` slots, so that every read stays inside the sources: the first
  // folded one; -1 when none is.
  template <typename index_t>
  static int64_t stand_in_of(const CpuFoldWork& work, const index_t* slots, int count) {
    for (int i = 0; i < count; ++i) {
      if (is_folded(work, slots[i])) return slots[i];
    }
    return -1;
  }

  // out[0..kSlots) = the fold of the kSlots slots of `group` (all folded, the
  // group that starts at index `first`) over every source. While one source is
  // hashed, the tokens read after it (`order`) are prefetched, so that the
  // requests run one source's work ahead.
  template <typename index_t, class Side>
  static void fold_group(const CpuFoldWork& work, const int64_t* group,
                         const ReadOrder<index_t>& order, int64_t first, int64_t* out, Side& side) {
    Vec acc[kVectors];
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) acc[v] = V::zero();
    const unsigned char* tokens[kSlots];
    TokenPrefetcher prefetcher;
    GroupPrefetcher<Side> requests{prefetcher, side};
    for (int s = 0; s < work.num_sources; ++s) {
      const SourceLayout& src = work.sources[s];
      for (int i = 0; i < kSlots; ++i) {
        tokens[i] = src.data + token_offset(src, group[i]);
      }
      prefetcher.start(order.after(first, s));
      Vec h[kVectors];
      hash_tokens(src, tokens, h, requests);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) acc[v] = splitmix64(acc[v] ^ h[v]);
    }
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(out + v * V::kLanes, acc[v]);
  }

  // Whether hash_tokens reads `src` in blocks (its runs hold whole blocks).
  static bool takes_blocks(const SourceLayout& src) {
    return V::kBlockChunks > 1 && (src.num_outer == 0 || src.run_bytes % kBlockBytes == 0);
  }

  // The steps hash_tokens takes over `src` (a word of a block, or a chunk).
  static int64_t hash_steps(const SourceLayout& src) {
    const int64_t num_blocks = takes_blocks(src) ? src.read_bytes / kBlockBytes : 0;
    return num_blocks * kBlockWords + (src.read_bytes - num_blocks * kBlockBytes) / kReadAlign;
  }

  // h[v] = the hash of the read_bytes of `src` of each lane of vector v, lane
  // i reading tokens[i] + base (every token laid out as `src` says). The
  // prefetcher is paced over the hashing's steps.
  template <class Prefetcher>
  static void hash_tokens(const SourceLayout& src, const unsigned char* const* tokens, Vec* h,
                          Prefetcher& prefetcher, int64_t base = 0) {
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] = V::zero();
    prefetcher.pace(hash_steps(src));
    int64_t byte = 0;
    if constexpr (V::kBlockChunks > 1) {
      if (takes_blocks(src)) byte = hash_token_blocks(src, tokens, h, prefetcher, base);
    }
    for (; byte < src.read_bytes; byte += kReadAlign) {
      prefetcher.step();
      const int64_t offset = base + chunk_offset(src, byte);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
        Vec lo, hi;
        V::load_chunks(tokens + v * V::kLanes, offset, &lo, &hi);
        h[v] = fold_chunk(h[v], lo, hi);
      }
    }
    prefetcher.finish();
  }

  // The whole blocks of `src` for kSlots lanes; returns the bytes hashed.
  template <class Prefetcher>
  static int64_t hash_token_blocks(const SourceLayout& src, const unsigned char* const* tokens,
                                   Vec* h, Prefetcher& prefetcher, int64_t base) {
    TokenBlocks blocks{src, base, src.read_bytes / kBlockBytes};
    hash_blocks(tokens, h, prefetcher, blocks);
    return blocks.count * kBlockBytes;
  }

  // The whole blocks of a token laid out as `src`, lane i's at tokens[i] +
  // base: what hash_tokens reads in blocks. A sequence of blocks for
  // hash_blocks gives, in order, the offset of each block to load
  // (next_offset), and is told when each block's words are hashed into h
  // (after_block).
  struct TokenBlocks {
    const SourceLayout& src;
    int64_t base;
    int64_t count;
    int64_t loaded = 0;

    int64_t next_offset() { return base + chunk_offset(src, kBlockBytes * loaded++); }
    void after_block(Vec*) {}
  };

  // Hashes the blocks of `blocks` into h (kSlots lanes, lane i's block at
  // tokens[i] + its offset). Software-pipelined: while the words of one block
  // are hashed (word by word across the vectors, independent chains side by
  // side), the next block is loaded and transposed into the other half of a
  // small staging buffer, one vector per step, so loads overlap the hash
  // instead of alternating with it.
  template <class Prefetcher, class Blocks>
  static void hash_blocks(const unsigned char* const* tokens, Vec* h, Prefetcher& prefetcher,
                          Blocks& blocks) {
    static_assert(kBlockWords % kVectors == 0, "one vector is loaded per word step");
    constexpr int kWordsPerLoad = kBlockWords / kVectors;
    const int64_t num_blocks = blocks.count;
    if (num_blocks == 0) return;
    Vec stage[2][kVectors][kBlockWords];
    const int64_t first = blocks.next_offset();
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
      V::load_block(tokens + v * V::kLanes, first, stage[0][v]);
    }
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int current = static_cast<int>(block % 2);
      const int other = 1 - current;
      const bool load_next = block + 1 < num_blocks;
      const int64_t next = load_next ? blocks.next_offset() : 0;
      KVC_UNROLL for (int w = 0; w < kBlockWords; ++w) {
        KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
          h[v] = splitmix64(h[v] ^ stage[current][v][w]);
        }
        prefetcher.step();
        if (load_next && w % kWordsPerLoad == 0) {
          const int v = w / kWordsPerLoad;  // the vector whose next block is loaded at this step
          V::load_block(tokens + v * V::kLanes, next, stage[other][v]);
        }
      }
      blocks.after_block(h);
    }
  }

  // Whether the sources all read the same bytes of their tokens (read_bytes
  // and the runs inside a token alike), so that a vector may hash a different
  // source in each lane.
  static bool same_token_layout(const CpuFoldWork& work) {
    const SourceLayout& first = work.sources[0];
    for (int s = 1; s < work.num_sources; ++s) {
      const SourceLayout& src = work.sources[s];
      if (src.read_bytes != first.read_bytes || src.num_outer != first.num_outer ||
          (src.num_outer > 0 && src.run_bytes != first.run_bytes)) {
        return false;
      }
      for (int d = 0; d < src.num_outer; ++d) {
        if (src.outer_size[d] != first.outer_size[d] ||
            src.outer_stride[d] != first.outer_stride[d]) {
          return false;
        }
      }
    }
    return true;
  }

  // Whether a tail is folded by (source, slot) pairs (fold_by_pairs).
  static bool takes_pairs(const CpuFoldWork& work) {
    return work.num_sources > 1 && work.sources[0].read_bytes >= kPairsMinBytes &&
           same_token_layout(work);
  }

  // Fewer slots than a lane group (kLaneGroupMultiple) over sources of one
  // token layout: lanes take (source, slot) pairs, so that the sources' chains
  // run side by side instead of one after another (a decode step: a few
  // slots, a K and a V source per layer). The pairs go source by source (all
  // slots of source 0, then of source 1, ...), so each slot's hashes combine
  // in source order. Nothing is prefetched: the pairs are all there is.
  template <typename index_t>
  static void fold_by_pairs(const CpuFoldWork& work, SlotSpan span) {
    const auto* slots = static_cast<const index_t*>(work.slots) + span.begin;
    const int count = static_cast<int>(span.end - span.begin);
    const int64_t stand_in = stand_in_of(work, slots, count);
    uint64_t acc[kLaneGroupMultiple] = {};
    const unsigned char* tokens[kSlots];
    int64_t lane_hashes[kSlots];
    NoPrefetch no_prefetch;
    int source = 0;  // the next pair is (source, slot)
    int slot = 0;
    while (stand_in >= 0 && source < work.num_sources) {
      const int first_source = source;
      const int first_slot = slot;
      int pairs = 0;
      for (; pairs < kSlots && source < work.num_sources; ++pairs) {
        const SourceLayout& src = work.sources[source];
        const int64_t read = is_folded(work, slots[slot]) ? slots[slot] : stand_in;
        tokens[pairs] = src.data + token_offset(src, read);
        ++slot;
        if (slot == count) {
          slot = 0;
          ++source;
        }
      }
      for (int lane = pairs; lane < kSlots; ++lane) tokens[lane] = tokens[0];
      Vec h[kVectors];
      // Every source has the first one's token layout (takes_pairs).
      hash_tokens(work.sources[first_source], tokens, h, no_prefetch);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(lane_hashes + v * V::kLanes, h[v]);
      int i = first_slot;
      for (int lane = 0; lane < pairs; ++lane) {
        acc[i] = splitmix64(acc[i] ^ static_cast<uint64_t>(lane_hashes[lane]));
        ++i;
        if (i == count) i = 0;
      }
    }
    for (int i = 0; i < count; ++i) {
      work.out[span.begin + i] = is_folded(work, slots[i]) ? static_cast<int64_t>(acc[i]) : 0;
    }
  }
};

}  // namespace
}  // namespace kvcanary
