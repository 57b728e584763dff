// The CPU digest, written once for any of the fold's lane types (see
// fold_cpu_lanes.h). Included by each instruction-set translation unit after
// fold_cpu_lanes.h.
//
// A unit's words form one serial splitmix64 chain, but the units of a view
// are independent chains of the same layout: kChains = V::kLanes * kVectors
// of them, the (entry, unit) terms of one view taken in order, are hashed side
// by side by the fold's own lane code (LaneFold::fold_tokens, a lane's
// "token" being its unit), so that the multipliers stay busy and the 8 x 8
// transposes of whole blocks serve the digest too.
#pragma once

#include "digest_cpu.h"
#include "fold_cpu_lanes.h"

namespace kvcanary {
namespace {

template <class V, int kVectors>
struct LaneDigest {
  using Vec = typename V::Vec;
  using Fold = LaneFold<V, kVectors>;
  static constexpr int kChains = V::kLanes * kVectors;
  // Entries whose live ones are collected, then hashed view by view.
  static constexpr int kEntriesPerBatch = 64;

  // Whether each whole 16-byte chunk of the view's units lies in one run, so
  // that the fold's lanes can read it.
  static bool chunks_in_runs(const DigestView& view) {
    return view.unit.num_outer == 0 || view.unit.run_bytes % kReadAlign == 0;
  }

  // Lane i's two words of pairs[i], as the vectors lo and hi.
  static void load_pairs(const uint64_t (*pairs)[2], Vec* lo, Vec* hi) {
    const unsigned char* lanes[kChains];
    for (int i = 0; i < kChains; ++i) lanes[i] = reinterpret_cast<const unsigned char*>(pairs[i]);
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::load_chunks(lanes + v * V::kLanes, 0, &lo[v], &hi[v]);
  }

  // terms[i] = mix3(keys[i][0], keys[i][1], the unit fold of units[i]) for kChains
  // units of `view`; `chunks` is view.unit cut to its whole 16-byte chunks.
  static void hash_lanes(const DigestView& view, const SourceLayout& chunks, const unsigned char* const* units,
                         const uint64_t (*keys)[2], int64_t* terms) {
    Vec h[kVectors];
    TokenPrefetch none;  // the units of a term group are adjacent; nothing to request ahead
    Fold::fold_tokens(chunks, units, h, none);
    // The words past the whole chunks: 4, 8 or 12 bytes, the last one zero-padded.
    const int64_t first_word = chunks.read_bytes / 8;
    const int64_t tail = unit_words(view) - first_word;
    if (tail > 0) {
      uint64_t words[kChains][2] = {};
      for (int i = 0; i < kChains; ++i) {
        for (int64_t w = 0; w < tail; ++w) words[i][w] = unit_word(view, units[i], first_word + w);
      }
      Vec lo[kVectors], hi[kVectors];
      load_pairs(words, lo, hi);
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
        h[v] = tail == 2 ? fold_chunk(h[v], lo[v], hi[v]) : splitmix64(h[v] ^ lo[v]);
      }
    }
    Vec id[kVectors], position[kVectors];
    load_pairs(keys, id, position);
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) V::store(terms + v * V::kLanes, mix3(id[v], position[v], h[v]));
  }

  // hash_lanes for the first `lanes` (<= kChains) of the arrays, in as few
  // vectors as hold them: the end of a view's terms need not cost kChains chains.
  static void hash_some(int lanes, const DigestView& view, const SourceLayout& chunks,
                        const unsigned char* const* units, const uint64_t (*keys)[2], int64_t* terms) {
    const int vectors = (lanes + V::kLanes - 1) / V::kLanes;
    if (kVectors > 1 && vectors <= 1) return LaneDigest<V, 1>::hash_lanes(view, chunks, units, keys, terms);
    if (kVectors > 2 && vectors <= 2) return LaneDigest<V, 2>::hash_lanes(view, chunks, units, keys, terms);
    if (kVectors > 4 && vectors <= 4) return LaneDigest<V, 4>::hash_lanes(view, chunks, units, keys, terms);
    hash_lanes(view, chunks, units, keys, terms);
  }

  // One view's terms for the live entries `live[0..count)`, unit by unit (a
  // layout whose chunks cross runs: each word read on its own).
  static void add_terms_by_unit(const CpuDigestRange& r, const DigestView& view, const int64_t* live, int count) {
    for (int e = 0; e < count; ++e) {
      const int64_t i = live[e];
      for (int64_t k = 0; k < view.num_units; ++k) {
        const uint64_t h = unit_fold(view, unit_address(view, r.slots[i], k));
        r.sums[r.group(i)] += mix3<uint64_t>(view.first_unit_id + k, r.positions[i], h);
      }
    }
  }

  // One view's terms for the live entries `live[0..count)`, kChains at a time.
  static void add_terms(const CpuDigestRange& r, const DigestView& view, const int64_t* live, int count) {
    if (!chunks_in_runs(view)) return add_terms_by_unit(r, view, live, count);
    SourceLayout chunks = view.unit;
    chunks.read_bytes = view.unit.read_bytes / kReadAlign * kReadAlign;
    const unsigned char* units[kChains];
    uint64_t keys[kChains][2];
    int64_t groups[kChains];
    int64_t terms[kChains];
    const int64_t num_terms = count * view.num_units;
    for (int64_t first = 0; first < num_terms; first += kChains) {
      const int lanes = static_cast<int>(num_terms - first < kChains ? num_terms - first : kChains);
      // Lanes past the end hash the first lane's unit again (every read stays
      // inside the view) and add nothing.
      for (int lane = 0; lane < kChains; ++lane) {
        const int64_t t = first + (lane < lanes ? lane : 0);
        const int64_t i = live[t / view.num_units];
        const int64_t k = t % view.num_units;
        units[lane] = unit_address(view, r.slots[i], k);
        keys[lane][0] = view.first_unit_id + static_cast<uint64_t>(k);
        keys[lane][1] = static_cast<uint64_t>(r.positions[i]);
        groups[lane] = r.group(i);
      }
      if (lanes == kChains) {
        hash_lanes(view, chunks, units, keys, terms);
      } else {
        hash_some(lanes, view, chunks, units, keys, terms);
      }
      for (int lane = 0; lane < lanes; ++lane) r.sums[groups[lane]] += static_cast<uint64_t>(terms[lane]);
    }
  }

  static void run(const CpuDigestRange& r) {
    int64_t live[kEntriesPerBatch];
    for (int64_t first = r.begin; first < r.end; first += kEntriesPerBatch) {
      const int64_t end = r.end - first < kEntriesPerBatch ? r.end : first + kEntriesPerBatch;
      int count = 0;
      for (int64_t i = first; i < end; ++i) {
        if (r.live(i)) live[count++] = i;
      }
      for (int j = 0; j < r.num_views && count > 0; ++j) {
        if (r.views[j].num_units > 0) add_terms(r, r.views[j], live, count);
      }
    }
  }
};

}  // namespace
}  // namespace kvcanary
