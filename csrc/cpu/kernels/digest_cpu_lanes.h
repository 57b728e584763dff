// The CPU digest, written once for any of the fold's lane types (see
// cpu/kernels/fold_cpu_lanes.h, which it includes). Included by each
// instruction-set translation unit after it has set its target; everything
// here has internal linkage (see cpu/kernels/fold_cpu.h).
//
// A unit's words form one serial splitmix64 chain, but the units of a view
// are independent chains of the same layout: kChains = V::kLanes * kVectors
// of them, the (entry, unit) terms of one view taken in order, are hashed side
// by side by the fold's own lane code (LaneFold::hash_tokens, a lane's
// "token" being its unit), so that the multipliers stay busy and the 8 x 8
// transposes of whole blocks serve the digest too. Besides what the fold
// needs, a lane type provides
//   load(in)                 the lanes, in order, from in[0..kLanes)
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

template <class V, int kVectors>
struct LaneDigest {
  using Vec = typename V::Vec;
  using Fold = LaneFold<V, kVectors>;
  static constexpr int kChains = V::kLanes * kVectors;
  static constexpr int kEntriesPerBatch = static_cast<int>(kDigestBatchEntries);
  // How far ahead of the lanes being hashed their tokens are requested, in
  // bytes of reads (whole groups of lanes, at least one).
  static constexpr int64_t kPrefetchBytes = 32 << 10;

  // Whether each whole 16-byte chunk of the view's units lies in one run, so
  // that the fold's lanes can read it.
  static bool chunks_in_runs(const DigestView& view) {
    return view.unit.num_outer == 0 || view.unit.run_bytes % kReadAlign == 0;
  }

  // terms[i] = mix3(ids[i], positions[i], the unit fold of units[i]) for kChains
  // units of `view`; `chunks` is view.unit cut to its whole 16-byte chunks.
  // `prefetch` requests the next lanes' tokens meanwhile.
  static void hash_lanes(const DigestView& view, const SourceLayout& chunks,
                         const unsigned char* const* units, const int64_t* ids,
                         const int64_t* positions, int64_t* terms, TokenPrefetcher& prefetch) {
    Vec h[kVectors];
    Fold::hash_tokens(chunks, units, h, prefetch);
    // The words past the whole chunks: 4, 8 or 12 bytes, the last one zero-padded.
    const int64_t first_word = chunks.read_bytes / 8;
    const int64_t tail = unit_words(view) - first_word;
    for (int64_t w = 0; w < tail; ++w) {
      int64_t words[kChains];
      for (int i = 0; i < kChains; ++i)
        words[i] = static_cast<int64_t>(unit_word(view, units[i], first_word + w));
      KVC_UNROLL for (int v = 0; v < kVectors; ++v) h[v] =
          splitmix64(h[v] ^ V::load(words + v * V::kLanes));
    }
    KVC_UNROLL for (int v = 0; v < kVectors; ++v) {
      const Vec id = V::load(ids + v * V::kLanes);
      const Vec position = V::load(positions + v * V::kLanes);
      V::store(terms + v * V::kLanes, mix3(id, position, h[v]));
    }
  }

  // hash_lanes for the first `lanes` (<= kChains) of the arrays, in as few
  // vectors as hold them: the end of a view's terms need not cost kChains chains.
  static void hash_some(int lanes, const DigestView& view, const SourceLayout& chunks,
                        const unsigned char* const* units, const int64_t* ids,
                        const int64_t* positions, int64_t* terms, TokenPrefetcher& prefetch) {
    const int vectors = (lanes + V::kLanes - 1) / V::kLanes;
    if (kVectors > 1 && vectors <= 1)
      return LaneDigest<V, 1>::hash_lanes(view, chunks, units, ids, positions, terms, prefetch);
    if (kVectors > 2 && vectors <= 2)
      return LaneDigest<V, 2>::hash_lanes(view, chunks, units, ids, positions, terms, prefetch);
    if (kVectors > 4 && vectors <= 4)
      return LaneDigest<V, 4>::hash_lanes(view, chunks, units, ids, positions, terms, prefetch);
    hash_lanes(view, chunks, units, ids, positions, terms, prefetch);
  }

  // The live entries of a batch: their indices, and per view being hashed the
  // first byte of each one's token (unit 0).
  struct Batch {
    int64_t entries[kEntriesPerBatch];
    int64_t slots[kEntriesPerBatch];
    const unsigned char* tokens[kEntriesPerBatch];
    int count = 0;

    void locate(const DigestView& view) {
      for (int e = 0; e < count; ++e)
        tokens[e] = view.unit.data + token_offset(view.unit, slots[e]);
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

  // Plans the prefetch of the tokens of the batch's entries [first, end) in `view`.
  static void plan_prefetch(TokenPrefetcher& prefetch, const DigestView& view, const Batch& batch,
                            int64_t first, int64_t end) {
    CpuFoldWork all_read{};
    all_read.capacity = INT64_MAX;  // the batch's entries are all read
    const SourceLayout token = prefetch_layout(view);
    const int64_t count = end < batch.count ? end - first : batch.count - first;
    if (token.read_bytes > 0 && count > 0) {
      prefetch.start(all_read, TokensToRead<int64_t>{&token, batch.slots + first, count});
    }
  }

  // One view's terms for the batch's entries, unit by unit (a layout whose
  // chunks cross runs: each word read on its own).
  static void add_terms_by_unit(const CpuDigestRange& r, const DigestView& view,
                                const Batch& batch) {
    for (int e = 0; e < batch.count; ++e) {
      const int64_t i = batch.entries[e];
      for (int64_t k = 0; k < view.num_units; ++k) {
        const uint64_t h = unit_fold(view, batch.tokens[e] + k * view.unit_stride);
        r.sums[group_of(r, i)] += mix3<uint64_t>(view.first_unit_id + k, r.positions[i], h);
      }
    }
  }

  // One view's terms for the batch's entries, kChains at a time, lanes taking
  // (entry, unit) in order; `next` is the view hashed after this one (null:
  // none), whose first tokens are prefetched during the last lanes.
  static void add_terms(const CpuDigestRange& r, const DigestView& view, const DigestView* next,
                        const Batch& batch) {
    if (!chunks_in_runs(view)) return add_terms_by_unit(r, view, batch);
    SourceLayout chunks = view.unit;
    chunks.read_bytes = view.unit.read_bytes / kReadAlign * kReadAlign;
    const unsigned char* units[kChains];
    int64_t ids[kChains];
    int64_t positions[kChains];
    int64_t groups[kChains];
    int64_t terms[kChains];
    const int64_t num_units = view.num_units;
    const int64_t num_terms = batch.count * num_units;
    const int64_t group_bytes = kChains * view.unit.read_bytes;
    const int64_t groups_ahead = group_bytes >= kPrefetchBytes ? 1 : kPrefetchBytes / group_bytes;
    for (int64_t first = 0; first < num_terms; first += kChains) {
      const int lanes = static_cast<int>(num_terms - first < kChains ? num_terms - first : kChains);
      int64_t e = first / num_units;
      int64_t k = first - e * num_units;
      for (int lane = 0; lane < lanes; ++lane) {
        const int64_t i = batch.entries[e];
        units[lane] = batch.tokens[e] + k * view.unit_stride;
        ids[lane] = static_cast<int64_t>(view.first_unit_id + static_cast<uint64_t>(k));
        positions[lane] = r.positions[i];
        groups[lane] = group_of(r, i);
        if (++k == num_units) k = 0, ++e;
      }
      // Lanes past the end hash the first lane's unit again (every read stays
      // inside the view) and add nothing.
      for (int lane = lanes; lane < kChains; ++lane) {
        units[lane] = units[0];
        ids[lane] = ids[0];
        positions[lane] = positions[0];
      }
      // The tokens of the lanes `groups_ahead` groups ahead, in this view or the next.
      TokenPrefetcher prefetch;
      const int64_t ahead = first + groups_ahead * kChains;
      if (ahead < num_terms) {
        plan_prefetch(prefetch, view, batch, ahead / num_units,
                      (ahead + kChains - 1) / num_units + 1);
      } else if (next != nullptr) {
        const int64_t there = ahead - num_terms;
        plan_prefetch(prefetch, *next, batch, there / next->num_units,
                      (there + kChains - 1) / next->num_units + 1);
      }
      if (lanes == kChains) {
        hash_lanes(view, chunks, units, ids, positions, terms, prefetch);
      } else {
        hash_some(lanes, view, chunks, units, ids, positions, terms, prefetch);
      }
      add_to_sums(r.sums, groups, terms, lanes);
    }
  }

  // sums[groups[i]] += terms[i] for the first `lanes`, summed in registers
  // while the group stays the same (the lanes of a request, usually all).
  static void add_to_sums(uint64_t* sums, const int64_t* groups, const int64_t* terms, int lanes) {
    uint64_t run = 0;
    int64_t group = groups[0];
    for (int lane = 0; lane < lanes; ++lane) {
      if (groups[lane] != group) {
        sums[group] += run;
        group = groups[lane];
        run = 0;
      }
      run += static_cast<uint64_t>(terms[lane]);
    }
    sums[group] += run;
  }

  static void run(const CpuDigestRange& r) {
    Batch batch;
    for (int64_t first = r.begin; first < r.end; first += kEntriesPerBatch) {
      const int64_t end = r.end - first < kEntriesPerBatch ? r.end : first + kEntriesPerBatch;
      batch.count = 0;
      for (int64_t i = first; i < end; ++i) {
        if (!adds_terms(r, i)) continue;
        batch.entries[batch.count] = i;
        batch.slots[batch.count++] = r.slots[i];
      }
      for (int j = 0; j < r.num_views && batch.count > 0; ++j) {
        const DigestView& view = r.views[j];
        if (view.num_units == 0) continue;
        int next = j + 1;
        while (next < r.num_views && r.views[next].num_units == 0) ++next;
        batch.locate(view);
        add_terms(r, view, next < r.num_views ? &r.views[next] : nullptr, batch);
      }
    }
  }
};

}  // namespace
}  // namespace kvcanary
