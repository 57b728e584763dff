// The CPU digest, written once for any of the fold's lane types (see
// cpu/kernels/fold_cpu_lanes.h, which it includes). Included by each
// instruction-set translation unit after it has set its target; everything
// here has internal linkage (see cpu/kernels/fold_cpu.h).
//
// A unit's words form one serial splitmix64 chain; the entries of a range are
// independent of each other. So each lane takes an entry, kChains = V::kLanes
// * kVectors of them side by side, and walks its units one after the other
// as the fold walks a token, with the fold's own lane code
// (LaneFold::hash_tokens, its 8 x 8 transposes of whole blocks included): per
// unit, the unit fold, then the term. What a term adds to the unit fold is
// the same for every lane of a step (the unit's id) or for every unit of a
// lane (its position and group), so the per-term work is two splitmix64
// steps on vectors and one wrapping add:
//   mix3(id, position, h) = splitmix64(key ^ h),
//   key = splitmix64(splitmix64(id) ^ position),
// splitmix64(id) computed once per unit for all lanes, and a lane's terms
// summed in its lane until the lane's entry is done. Besides what the fold
// needs, a lane type provides
//   load(in)                 the lanes, in order, from in[0..kLanes)
//   splat(value)             every lane `value`
//   a + b                    lane-wise wrapping addition
#pragma once

#include "cpu/kernels/digest_cpu.h"
#include "cpu/kernels/fold_cpu_lanes.h"

namespace kvcanary {
namespace {

// Whether entry i adds terms: a slot in [0, capacity) and a group in range.
bool adds_terms(const CpuDigestRange& r, int64_t i) {
  return r.slots[i] >= 0 && r.slots[i] < r.capacity &&
         (r.groups == nullptr || (r.groups[i] >= 0 && r.groups[i] < r.num_groups));
}

int64_t group_of(const CpuDigestRange& r, int64_t i) {
  return r.groups == nullptr ? 0 : r.groups[i];
}

// A prefetcher paced once over the hashing of several hash_tokens calls (the
// units of a lane group): the calls' own pacing and finishing are skipped.
template <class Prefetcher>
struct PacedOverUnits {
  Prefetcher& prefetcher;
  void pace(int64_t) {}
  [[gnu::always_inline]] void step() { prefetcher.step(); }
  void finish() {}
};

template <class V, int kVectors>
struct LaneDigest {
  using Vec = typename V::Vec;
  using Fold = LaneFold<V, kVectors>;
  static constexpr int kChains = V::kLanes * kVectors;

  // Whether each whole 16-byte chunk of the view's units lies in one run, so
  // that the fold's lanes can read it.
  static bool chunks_in_runs(const DigestView& view) {
    return view.unit.num_outer == 0 || view.unit.run_bytes % kReadAlign == 0;
  }

  // A lane group: up to kChains entries that add terms, one per lane, and per
  // view being hashed the first byte of each one's token (unit 0).
  struct Group {
    int64_t slots[kChains];
    int64_t positions[kChains];
    int64_t groups[kChains];
    const unsigned char* tokens[kChains];
    int count = 0;

    // The next entries from `cursor` on (up to `end`) that add terms. Lanes
    // past count repeat lane 0 (every read stays inside the views) and add
    // nothing.
    void collect(const CpuDigestRange& r, int64_t& cursor, int64_t end) {
      count = 0;
      for (; cursor < end && count < kChains; ++cursor) {
        if (!adds_terms(r, cursor)) continue;
        slots[count] = r.slots[cursor];
        positions[count] = r.positions[cursor];
        groups[count] = group_of(r, cursor);
        ++count;
      }
      for (int e = count; e < kChains && count > 0; ++e) {
        slots[e] = slots[0];
        positions[e] = positions[0];
        groups[e] = groups[0];
      }
    }

    void locate(const DigestView& view) {
      for (int e = 0; e < kChains; ++e) {
        tokens[e] = view.unit.data + token_offset(view.unit, slots[e]);
      }
    }
  };

  // What the prefetch of a view's tokens requests: its units' bytes when they
  // follow each other in one run, else the bytes of unit 0.
  static SourceLayout prefetch_layout(const DigestView& view) {
    SourceLayout token = view.unit;
    if (view.unit.num_outer == 0 && view.unit_stride == view.unit.read_bytes) {
      token.read_bytes = view.num_units * view.unit.read_bytes;
    }
    token.num_outer = 0;
    token.read_bytes = token.read_bytes / kReadAlign * kReadAlign;
    return token;
  }

  // Plans the prefetch of the tokens of `group` in `view` (of range r).
  static void plan_prefetch(TokenPrefetcher& prefetch, const CpuDigestRange& r,
                            const DigestView& view, const Group& group) {
    const SourceLayout token = prefetch_layout(view);
    if (token.read_bytes > 0 && group.count > 0) {
      prefetch.start(TokensToRead<int64_t>{&token, group.slots, group.count, r.capacity});
    }
  }

  // sums[groups[lane]] += the view's terms of each lane's entry, unit by unit
  // (a layout whose chunks cross runs: each word read on its own).
  static void add_terms_by_unit(const CpuDigestRange& r, const DigestView& view,
                                const Group& group) {
    for (int e = 0; e < group.count; ++e) {
      for (int64_t k = 0; k < view.num_units; ++k) {
        const uint64_t h = unit_fold(view, group.tokens[e] + k * view.unit_stride);
        r.sums[group.groups[e]] += mix3<uint64_t>(view.first_unit_id + k, group.positions[e], h);
      }
    }
  }

  // The terms of a lane group, unit after unit: each unit's hash h (one per
  // lane) becomes the lanes' terms, added to their sums.
  struct Terms {
    const DigestView& view;
    Vec position[kVectors];
    Vec sum[kVectors];

    Terms(const DigestView& v, const Group& group) : view(v) {
      KVC_UNROLL for (int i = 0; i < kVectors; ++i) {
        position[i] = V::load(group.positions + i * V::kLanes);
        sum[i] = V::zero();
      }
    }

    void add(int64_t unit, const Vec* h) {
      const Vec id =
          V::splat(splitmix64<uint64_t>(view.first_unit_id + static_cast<uint64_t>(unit)));
      KVC_UNROLL for (int i = 0; i < kVectors; ++i) {
        const Vec key = splitmix64(id ^ position[i]);
        sum[i] = sum[i] + splitmix64(key ^ h[i]);
      }
    }
  };

  // The blocks of all of a view's units, one unit after the other, for
  // Fold::hash_blocks: the units' blocks are hashed in one software pipeline,
  // and each unit's hash becomes its terms as its last block is done.
  struct UnitBlocks {
    const SourceLayout& unit;  // the unit's layout, all whole blocks
    int64_t stride;
    int64_t per_unit;
    int64_t count;
    Terms& terms;
    int64_t load_unit = 0;  // where the next block to load is
    int64_t load_block = 0;
    int64_t unit_done = 0;  // the unit being hashed, and its blocks hashed
    int64_t blocks_done = 0;

    int64_t next_offset() {
      const int64_t offset =
          load_unit * stride + chunk_offset(unit, Fold::kBlockBytes * load_block);
      if (++load_block == per_unit) {
        load_block = 0;
        ++load_unit;
      }
      return offset;
    }
    void after_block(Vec* h) {
      if (++blocks_done < per_unit) return;
      terms.add(unit_done++, h);
      blocks_done = 0;
      KVC_UNROLL for (int i = 0; i < kVectors; ++i) h[i] = V::zero();
    }
  };

  // The lanes' sums of the view's terms of each lane's entry; `prefetch`
  // requests the tokens read next meanwhile, paced over all units.
  static void lane_sums(const DigestView& view, const Group& group, int64_t* sums,
                        TokenPrefetcher& prefetch) {
    Terms terms(view, group);
    hash_units(view, group, terms, prefetch);
    prefetch.finish();
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(sums + v * V::kLanes, terms.sum[v]);
  }

  // The view's units hashed into terms: as one sequence of blocks when each
  // unit is whole blocks that hash_tokens would read as blocks (AVX-512:
  // units of 64, 128, 256 bytes...), else one hash_tokens call each.
  static void hash_units(const DigestView& view, const Group& group, Terms& terms,
                         TokenPrefetcher& prefetch) {
    if constexpr (V::kBlockChunks > 1) {
      if (view.unit.read_bytes % Fold::kBlockBytes == 0 && Fold::takes_blocks(view.unit)) {
        const int64_t per_unit = view.unit.read_bytes / Fold::kBlockBytes;
        UnitBlocks blocks{view.unit, view.unit_stride, per_unit, per_unit * view.num_units, terms};
        prefetch.pace(view.num_units * Fold::hash_steps(view.unit));
        Vec h[kVectors];
        KVC_UNROLL for (int i = 0; i < kVectors; ++i) h[i] = V::zero();
        Fold::hash_blocks(group.tokens, h, prefetch, blocks);
        return;
      }
    }
    hash_unit_by_unit(view, group, terms, prefetch);
  }

  // The view's units hashed one hash_tokens call each (their chunks and the
  // words past them).
  static void hash_unit_by_unit(const DigestView& view, const Group& group, Terms& terms,
                                TokenPrefetcher& prefetch) {
    SourceLayout chunks = view.unit;
    chunks.read_bytes = view.unit.read_bytes / kReadAlign * kReadAlign;
    // The words past the whole chunks: 4, 8 or 12 bytes, the last one zero-padded.
    const int64_t first_tail_word = chunks.read_bytes / 8;
    const int64_t tail_words = unit_words(view) - first_tail_word;
    prefetch.pace(view.num_units * Fold::hash_steps(chunks));
    PacedOverUnits<TokenPrefetcher> paced{prefetch};
    for (int64_t k = 0; k < view.num_units; ++k) {
      const int64_t base = k * view.unit_stride;
      Vec h[kVectors];
      Fold::hash_tokens(chunks, group.tokens, h, paced, base);
      for (int64_t w = 0; w < tail_words; ++w) {
        int64_t words[kChains];
        for (int i = 0; i < kChains; ++i) {
          words[i] =
              static_cast<int64_t>(unit_word(view, group.tokens[i] + base, first_tail_word + w));
        }
        KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] =
            splitmix64(h[v] ^ V::load(words + v * V::kLanes));
      }
      terms.add(k, h);
    }
  }

  // lane_sums in as few vectors as hold the group (in_fewest_vectors): the
  // last group of a range need not cost kChains chains.
  static void lane_sums_of_some(const DigestView& view, const Group& group, int64_t* sums,
                                TokenPrefetcher& prefetch) {
    in_fewest_vectors<kVectors>((group.count + V::kLanes - 1) / V::kLanes, [&](auto vectors) {
      constexpr int kFewer = decltype(vectors)::value;
      if constexpr (kFewer == kVectors) {
        lane_sums(view, group, sums, prefetch);
      } else {
        LaneDigest<V, kFewer>::lane_sums(view, narrow<kFewer>(group), sums, prefetch);
      }
    });
  }

  // The first lanes of a group, as the group of a narrower digest.
  template <int kFewer>
  static typename LaneDigest<V, kFewer>::Group narrow(const Group& group) {
    typename LaneDigest<V, kFewer>::Group few;
    for (int e = 0; e < LaneDigest<V, kFewer>::kChains; ++e) {
      few.slots[e] = group.slots[e];
      few.positions[e] = group.positions[e];
      few.groups[e] = group.groups[e];
      few.tokens[e] = group.tokens[e];
    }
    few.count = group.count;
    return few;
  }

  // The view's terms of the group's entries, added to r.sums; `next` is what
  // is read after them (its tokens in `next_view`), prefetched meanwhile.
  static void add_terms(const CpuDigestRange& r, const DigestView& view, const Group& group,
                        const DigestView& next_view, const Group& next) {
    if (!chunks_in_runs(view)) return add_terms_by_unit(r, view, group);
    TokenPrefetcher prefetch;
    plan_prefetch(prefetch, r, next_view, next);
    int64_t sums[kChains];
    if (group.count == kChains) {
      lane_sums(view, group, sums, prefetch);
    } else {
      lane_sums_of_some(view, group, sums, prefetch);
    }
    add_to_sums(r.sums, group.groups, sums, group.count);
  }

  // sums[groups[i]] += lane_sums[i] for the first `lanes`, summed in
  // registers while the group stays the same (the lanes of a request,
  // usually all).
  static void add_to_sums(uint64_t* sums, const int64_t* groups, const int64_t* lane_sums,
                          int lanes) {
    uint64_t run = 0;
    int64_t group = groups[0];
    for (int lane = 0; lane < lanes; ++lane) {
      if (groups[lane] != group) {
        sums[group] += run;
        group = groups[lane];
        run = 0;
      }
      run += static_cast<uint64_t>(lane_sums[lane]);
    }
    sums[group] += run;
  }

  // The view after view j that has units (r.num_views: none).
  static int next_view(const CpuDigestRange& r, int j) {
    do {
      ++j;
    } while (j < r.num_views && r.views[j].num_units == 0);
    return j;
  }

  // The range's entries, lane group by lane group, view by view. What is read
  // after a group's last view is the next group's first, and after the
  // range's last group the first group of the entries the thread digests
  // next (r.next_begin..r.next_end), which is only prefetched here.
  static void run(const CpuDigestRange& r) {
    const int first_view = next_view(r, -1);
    if (first_view == r.num_views) return;
    Group groups[2];
    Group next_range;
    int64_t cursor = r.begin;
    groups[0].collect(r, cursor, r.end);
    for (int current = 0; groups[current].count > 0; current = 1 - current) {
      Group& group = groups[current];
      Group& after = groups[1 - current];
      after.collect(r, cursor, r.end);
      const Group* read_next = &after;
      if (after.count == 0) {
        int64_t next_cursor = r.next_begin;
        next_range.collect(r, next_cursor, r.next_end);
        read_next = &next_range;
      }
      for (int j = first_view; j < r.num_views; j = next_view(r, j)) {
        const int then = next_view(r, j);
        group.locate(r.views[j]);
        if (then < r.num_views) {
          add_terms(r, r.views[j], group, r.views[then], group);
        } else {
          add_terms(r, r.views[j], group, r.views[first_view], *read_next);
        }
      }
    }
  }
};

}  // namespace
}  // namespace kvcanary
