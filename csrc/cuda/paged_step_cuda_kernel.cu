// CUDA kernels of kvcanary::paged_step, in its one CUDA phase (kWholeStep): the
// step's record entries, then its context's verify entries, as the CPU kernel
// (cpu/paged_step_cpu.cpp) applies them one after another, here in a fixed
// sequence of launches that read device values only on the device (so that a
// CUDA graph can capture them), each safe for any values: entries outside their
// request, past a block table or past the capacity are skipped or reported,
// never read.
//
// Record order and exactness. The CPU records entry after entry, in order of
// (group, request in record order, token); an entry's chain is the link of the
// record at its previous slot as the entries before it left it. Here:
//  1. each entry gets a key, its place in that order; the last entry to
//     record a slot (the greatest key, an atomicMax per slot) writes the
//     slot's record once every chain is known: the record the CPU leaves;
//  2. a run (entries that each chain through the slot the entry before wrote,
//     a request's tokens) has its chains computed serially from its first
//     entry's, from the entries' inputs, as record does;
//  3. a run's first entry chains through its previous slot as the entries
//     before it left it: the record before the step when no earlier entry
//     records that slot (read before anything is written), else the link of
//     the last earlier entry w that does, mix3(chain(w), token(w),
//     position(w)). Such a dependent run waits for w's run: the independent
//     runs go in parallel, then one thread takes the dependent runs in key
//     order (w's run, earlier, is done by then). A request reading a block
//     another request of the step writes is rare, so that pass is short.
// The result is the CPU's: the same records, chains and ring rows (in another
// order, claimed with atomics).
#include "cuda/fold_cuda_warp.cuh"
#include "cuda/launch_shape.h"
#include "cuda/paged_step_cuda.h"
#include "cuda/ring_cuda.cuh"

namespace kvcanary {
namespace {

constexpr int kStepThreads = 128;
constexpr int64_t kMaxStepBlocks = 8192;
constexpr int kSortThreads = 256;

using Args = PagedStepLaunchArgs;

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Appends a violation row with its origin (cuda/ring_cuda.cuh).
__device__ void append_row(const Args& a, const int64_t* row, int64_t group, int64_t request) {
  const int64_t index = claim_ring_row(a.engine.counters, a.engine.ring_capacity);
  if (index < 0) {
    return;
  }
  write_ring_row(a.engine.ring, index, row);
  int64_t* origin = a.engine.origins + index * kOriginFields;
  origin[kOriginStep] = a.call.step;
  origin[kOriginGroup] = group;
  origin[kOriginRow] = request;
}

// One entry's inputs as core/canary_records.h reads them (entry 0 of
// `values`: slot, position, token, previous slot), with its root (null: none).
__device__ __forceinline__ EntryInputs one_entry(const int64_t* values,
                                                 const int64_t* root = nullptr) {
  EntryInputs in{};
  in.slots = values;
  in.positions = values + 1;
  in.tokens = values + 2;
  in.prev_slots = values + 3;
  in.num_entries = 1;
  in.roots = root;
  return in;
}

// The root of request r, or null when the step has none.
__device__ __forceinline__ const int64_t* root_of(const Args& a, int64_t r) {
  return a.call.roots != nullptr ? a.call.roots + r : nullptr;
}

__device__ __forceinline__ int64_t token_of(const Args& a, int64_t t) {
  return a.call.input_ids != nullptr ? load_index(a.call.input_ids, a.call.input_ids_int32, t) : -1;
}

__device__ __forceinline__ int64_t position_of(const Args& a, int64_t t) {
  return load_index(a.call.positions, a.call.positions_int32, t);
}

__device__ __forceinline__ int64_t query_start(const Args& a, int64_t r) {
  return load_index(a.call.rows.query_start_loc, a.call.rows.query_start_loc_int32, r);
}

// The request whose tokens [q[r], q[r + 1]) hold token t, or -1: the last r
// with q[r] <= t (a binary search), checked, since query_start_loc may be out
// of order.
__device__ int64_t request_of_token(const Args& a, int64_t t) {
  int64_t lo = 0, hi = a.call.rows.num_reqs;  // the first r in [0, num_reqs) with q[r] > t
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (query_start(a, mid) <= t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int64_t r = lo - 1;
  return r >= 0 && query_start(a, r) <= t && t < query_start(a, r + 1) ? r : -1;
}

// Each request's place in record order (by tokens in the cache, stable), and
// the ring's write index before the call appends anything.
__global__ void __launch_bounds__(kStepThreads) rank_kernel(const Args a) {
  const int64_t n = a.call.rows.num_reqs;
  if (global_thread() == 0) {
    a.scratch.words[kWordRingStart] = a.engine.counters[kRingWrite];
  }
  for (int64_t r = global_thread(); r < n; r += grid_threads()) {
    const int64_t mine = computed_of(a.call.rows, r);
    int64_t rank = 0;
    for (int64_t o = 0; o < n; ++o) {
      const int64_t other = computed_of(a.call.rows, o);
      rank += other < mine || (other == mine && o < r);
    }
    a.scratch.row_ranks[r] = rank;
  }
}

// Each record entry's slot, previous slot and key; the slots recorded get
// marked for the fold and claimed by their last entry; entries past the
// capacity get their rows.
__global__ void __launch_bounds__(kStepThreads) entries_kernel(const Args a) {
  const PagedStepScratch& s = a.scratch;
  int64_t recorded = 0;
  for (int64_t e = global_thread(); e < a.call.num_entries; e += grid_threads()) {
    const int64_t g = e / a.call.num_tokens, t = e % a.call.num_tokens;
    const int64_t r = request_of_token(a, t);
    int64_t slot = -1, prev = -1, key = -1;
    if (r >= 0) {
      s.words[kWordRecorded] = 1;
      const PagedGroup& group = a.engine.groups[g];
      slot = load_index(group.slot_mapping, group.slot_mapping_int32, t);
      const int64_t p = computed_of(a.call.rows, r) + (t - query_start(a, r));
      prev = group_slot(group, a.engine.block_size, r, p - 1);
      if (slot >= 0 && (slot >= a.engine.capacity || prev >= a.engine.capacity)) {
        const int64_t values[4] = {slot, position_of(a, t), token_of(a, t), prev};
        int64_t row[kViolationFields];
        out_of_range_row(row, kKindRecord, one_entry(values), 0);
        append_row(a, row, g, r);
      } else if (slot >= 0) {
        key = (g * a.call.rows.num_reqs + s.row_ranks[r]) * a.call.num_entries + e;
        atomicMax(reinterpret_cast<long long*>(s.writers + slot), static_cast<long long>(key));
        s.marked[slot] = 1;
        ++recorded;
      }
    }
    s.entry_slots[e] = slot;
    s.entry_prevs[e] = prev;
    s.entry_keys[e] = key;
  }
  if (recorded > 0) {
    atomicAdd(as_counter(a.engine.counters + kSlotsRecorded),
              static_cast<unsigned long long>(recorded));
  }
}

// Whether recorded entry e chains through the slot entry e - 1 recorded,
// the entry just before it in record order.
__device__ __forceinline__ bool continues_run(const Args& a, int64_t e) {
  const PagedStepScratch& s = a.scratch;
  if (e % a.call.num_tokens == 0 || s.entry_keys[e] < 0 || s.entry_keys[e - 1] < 0) {
    return false;
  }
  return s.entry_keys[e] - s.entry_keys[e - 1] == 1 && s.entry_prevs[e] >= 0 &&
         s.entry_prevs[e] == s.entry_slots[e - 1];
}

// The key of the last entry before key `key` that records `slot`, or -1.
__device__ int64_t last_writer_before(const Args& a, int64_t slot, int64_t key) {
  const PagedStepScratch& s = a.scratch;
  const int64_t last = s.writers[slot];
  if (last < key) {
    return last;  // every entry recording the slot comes before
  }
  int64_t best = -1;  // an entry at or after `key` records it too: search them all
  for (int64_t i = 0; i < a.call.num_entries; ++i) {
    const int64_t k = s.entry_keys[i];
    if (k >= 0 && k < key && k > best && s.entry_slots[i] == slot) {
      best = k;
    }
  }
  return best;
}

// Each run's first entry: its chain where no entry of the step before it
// records its previous slot (read before anything is written), else the
// entry it waits on, listed for the dependent pass.
__global__ void __launch_bounds__(kStepThreads) run_heads_kernel(const Args a) {
  const PagedStepScratch& s = a.scratch;
  for (int64_t e = global_thread(); e < a.call.num_entries; e += grid_threads()) {
    if (s.entry_keys[e] < 0 || continues_run(a, e)) {
      continue;
    }
    const int64_t prev = s.entry_prevs[e];
    const int64_t writer = prev >= 0 ? last_writer_before(a, prev, s.entry_keys[e]) : -1;
    if (writer < 0) {
      // A first position links to its request's root where the step has roots.
      const int64_t* root =
          prev < 0 ? root_of(a, request_of_token(a, e % a.call.num_tokens)) : nullptr;
      s.entry_chains[e] = root != nullptr ? *root : link_at(a.engine.records, prev);
      s.entry_deps[e] = -1;
    } else {
      s.entry_deps[e] = writer % a.call.num_entries;
      const auto at = atomicAdd(as_counter(s.words + kWordDeps), 1ull);
      s.deps[at] = e;
    }
  }
}

// Computes the chains of the run starting at entry e, whose chain is `chain`,
// into entry_chains. The loop is serial (each chain is the link of the one
// before), so it touches only the entries' own arrays, read in order; the
// records get the chains afterwards, in parallel (write_records_kernel).
__device__ void chain_run(const Args& a, int64_t e, int64_t chain) {
  for (;;) {
    a.scratch.entry_chains[e] = chain;
    const int64_t t = e % a.call.num_tokens;
    if (t + 1 == a.call.num_tokens || !continues_run(a, e + 1)) {
      return;
    }
    chain = static_cast<int64_t>(mix3<uint64_t>(static_cast<uint64_t>(chain),
                                                static_cast<uint64_t>(token_of(a, t)),
                                                static_cast<uint64_t>(position_of(a, t))));
    ++e;
  }
}

// The chains of the runs that wait on no other.
__global__ void __launch_bounds__(kStepThreads) independent_runs_kernel(const Args a) {
  const PagedStepScratch& s = a.scratch;
  for (int64_t e = global_thread(); e < a.call.num_entries; e += grid_threads()) {
    if (s.entry_keys[e] >= 0 && !continues_run(a, e) && s.entry_deps[e] < 0) {
      chain_run(a, e, s.entry_chains[e]);
    }
  }
}

// The dependent runs, in key order, by one thread: each one's first entry
// chains through the record its entry w left, w's run being done (an
// independent run, or a dependent one earlier in key order). One block sorts
// them first (each one's place is the count of smaller keys).
__global__ void __launch_bounds__(kSortThreads) dependent_runs_kernel(const Args a) {
  const PagedStepScratch& s = a.scratch;
  const int64_t n = s.words[kWordDeps];
  if (n == 0) {
    return;
  }
  int64_t* sorted = s.deps + a.call.num_entries;
  for (int64_t i = threadIdx.x; i < n; i += kSortThreads) {
    const int64_t key = s.entry_keys[s.deps[i]];
    int64_t place = 0;
    for (int64_t j = 0; j < n; ++j) {
      place += s.entry_keys[s.deps[j]] < key;
    }
    sorted[place] = s.deps[i];
  }
  __syncthreads();
  if (threadIdx.x != 0) {
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = sorted[i];
    const int64_t w = s.entry_deps[e];
    const int64_t t = w % a.call.num_tokens;
    const auto chain = static_cast<int64_t>(mix3<uint64_t>(
        static_cast<uint64_t>(s.entry_chains[w]), static_cast<uint64_t>(token_of(a, t)),
        static_cast<uint64_t>(position_of(a, t))));
    chain_run(a, e, chain);
  }
}

// Each slot's record from its last entry, once every chain is known.
__global__ void __launch_bounds__(kStepThreads) write_records_kernel(const Args a) {
  const PagedStepScratch& s = a.scratch;
  for (int64_t e = global_thread(); e < a.call.num_entries; e += grid_threads()) {
    const int64_t key = s.entry_keys[e];
    if (key < 0 || s.writers[s.entry_slots[e]] != key) {
      continue;
    }
    const int64_t slot = s.entry_slots[e], t = e % a.call.num_tokens;
    int64_t* record = a.engine.records + slot * kRecordFields;
    record[kToken] = token_of(a, t);
    record[kPosition] = position_of(a, t);
    record[kChain] = s.entry_chains[e];
    record[kFold] = s.folds[slot];
    a.engine.owner_tags[slot] = -1;
  }
}

// The entry at position p of request r's context [first, computed) in group
// g, chosen and read as select_entry (core/context_ranges.h) does it: slot -1
// where not checked.
struct ContextEntry {
  int64_t slot;
  int64_t prev;
  int64_t token;
};

__device__ ContextEntry context_entry(const Args& a, const PagedGroup& group, int64_t r,
                                      int64_t first, int64_t computed, int64_t p) {
  ContextEntry c{group_slot(group, a.engine.block_size, r, p), -1, -1};
  if (c.slot < 0 || !position_in_turn(a.call.checks, a.engine.block_size, p, computed - 1)) {
    c.slot = -1;
    return c;
  }
  if (p > 0) {
    c.prev = p == first && a.engine.padding_slot >= 0
                 ? a.engine.padding_slot
                 : group_slot(group, a.engine.block_size, r, p - 1);
  }
  c.token = history_token(a.call.checks, history_row(a.call.checks, r), p);
  return c;
}

// Calls visit(g, r, p, entry) for every checked context entry, one block per
// (group, request) in a grid-stride loop, its threads along the positions
// (those past the block table have no slot, so are not walked).
template <typename Visit>
__device__ void for_each_context_entry(const Args& a, Visit visit) {
  const int64_t units = a.engine.num_groups * a.call.rows.num_reqs;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t g = u / a.call.rows.num_reqs, r = u % a.call.rows.num_reqs;
    const PagedGroup& group = a.engine.groups[g];
    const int64_t computed = computed_of(a.call.rows, r);
    const int64_t first = first_attended(group, computed);
    const int64_t table_end = group.max_blocks * a.engine.block_size;
    const int64_t end = computed < table_end ? computed : table_end;
    for (int64_t p = (first > 0 ? first : 0) + threadIdx.x; p < end; p += blockDim.x) {
      const ContextEntry c = context_entry(a, group, r, first, computed, p);
      if (c.slot >= 0) {
        visit(g, r, p, c);
      }
    }
  }
}

__global__ void __launch_bounds__(kStepThreads) mark_context_kernel(const Args a) {
  for_each_context_entry(a, [&](int64_t, int64_t, int64_t, const ContextEntry& c) {
    if (c.slot < a.engine.capacity && c.slot != a.engine.padding_slot) {
      a.scratch.marked[c.slot] = 1;
    }
  });
}

// The fold of every marked slot over one launch's sources (at most
// kCapacity), continuing the chain of the launches before (`continue_chain`);
// a grid-stride loop whose bound is the block's, so that every lane of a warp
// folds together.
template <int kCapacity>
struct MarkedFoldArgs {
  SourceLayout sources[kCapacity];
  int num_sources;
  bool continue_chain;
};

// A launch of up to kSourcesPerLaunch sources keeps its arguments within
// every CUDA version's limit; more take one launch of kWideSources each.
constexpr int kWideSources = static_cast<int>(
    (kMaxWideLaunchArgBytes - sizeof(Args) - sizeof(MarkedFoldArgs<1>)) / sizeof(SourceLayout));
static_assert(sizeof(MarkedFoldArgs<kSourcesPerLaunch>) + sizeof(Args) <= kMaxLaunchArgBytes,
              "a launch's arguments must fit the limit");
static_assert(sizeof(MarkedFoldArgs<kWideSources>) + sizeof(Args) <= kMaxWideLaunchArgBytes,
              "a wide launch's arguments must fit its limit");

template <int kCapacity>
__global__ void __launch_bounds__(kThreadsPerBlock)
    fold_marked_kernel(const Args a, const MarkedFoldArgs<kCapacity> f) {
  __shared__ ulonglong2 tiles[kWarpsPerBlock][kWarpSize * kRowPitch];
  const PagedStepScratch& s = a.scratch;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock; base < a.engine.capacity;
       base += static_cast<int64_t>(gridDim.x) * kThreadsPerBlock) {
    const int64_t slot = base + threadIdx.x;
    const bool live = slot < a.engine.capacity && s.marked[slot] != 0;
    const uint64_t start = live && f.continue_chain ? static_cast<uint64_t>(s.folds[slot]) : 0;
    const uint64_t fold = fold_lane_slot(f.sources, f.num_sources, live ? slot : -1, live,
                                         tiles[threadIdx.x / kWarpSize], start);
    if (live) {
      s.folds[slot] = static_cast<int64_t>(fold);
    }
  }
}

// verify of the context's entries (all but padding_slot's), with their rows.
__global__ void __launch_bounds__(kStepThreads) verify_context_kernel(const Args a) {
  int64_t checked = 0;
  for_each_context_entry(a, [&](int64_t g, int64_t r, int64_t p, const ContextEntry& c) {
    a.scratch.words[kWordVerified] = 1;
    if (c.slot == a.engine.padding_slot) {
      return;
    }
    ++checked;
    const int64_t values[4] = {c.slot, p, c.token, c.prev};
    const EntryInputs in = one_entry(values, root_of(a, r));
    int64_t row[kViolationFields];
    if (c.slot >= a.engine.capacity || c.prev >= a.engine.capacity) {
      out_of_range_row(row, kKindVerify, in, 0);
      append_row(a, row, g, r);
      return;
    }
    const VerifyOutcome outcome = verify_entry(a.engine.records, a.engine.owner_tags, in, 0, c.slot,
                                               a.scratch.folds[c.slot], a.engine.padding_slot);
    if (outcome.reasons != 0) {
      verify_row(row, a.engine.records, in, 0, c.slot, outcome);
      append_row(a, row, g, r);
    }
  });
  if (checked > 0) {
    atomicAdd(as_counter(a.engine.counters + kSlotsVerified),
              static_cast<unsigned long long>(checked));
  }
}

// Last on the stream: the calls counted, then the mailbox, its step word
// last, after a system-wide fence, so that a host that reads the step reads
// the words before it as this call left them.
__global__ void finish_kernel(const Args a) {
  const int64_t* words = a.scratch.words;
  a.engine.counters[kRecordCalls] += words[kWordRecorded] != 0;
  a.engine.counters[kVerifyCalls] += words[kWordVerified] != 0;
  volatile int64_t* mailbox = a.engine.mailbox;
  mailbox[kMailRingStart] = words[kWordRingStart];
  mailbox[kMailPhase] = a.call.phase;
  mailbox[kMailViolations] = a.engine.counters[kViolations];
  __threadfence_system();
  mailbox[kMailStep] = a.call.step;
}

unsigned int step_blocks(int64_t n) { return grid_blocks(n, kStepThreads, kMaxStepBlocks); }

template <int kCapacity>
void launch_fold_marked(const Args& a, const SourceLayout* sources, int num_sources,
                        cudaStream_t stream) {
  for (int first = 0; first < num_sources; first += kCapacity) {
    MarkedFoldArgs<kCapacity> f{};
    f.num_sources = num_sources - first < kCapacity ? num_sources - first : kCapacity;
    for (int i = 0; i < f.num_sources; ++i) {
      f.sources[i] = sources[first + i];
    }
    f.continue_chain = first > 0;
    fold_marked_kernel<kCapacity>
        <<<grid_blocks(a.engine.capacity, kThreadsPerBlock, kMaxStepBlocks), kThreadsPerBlock, 0,
           stream>>>(a, f);
  }
}

}  // namespace

cudaError_t launch_paged_step(const PagedStepLaunchArgs& a, const SourceLayout* sources,
                              int num_sources, cudaStream_t stream) {
  const int64_t units = a.engine.num_groups * a.call.rows.num_reqs;
  rank_kernel<<<step_blocks(a.call.rows.num_reqs), kStepThreads, 0, stream>>>(a);
  entries_kernel<<<step_blocks(a.call.num_entries), kStepThreads, 0, stream>>>(a);
  mark_context_kernel<<<grid_blocks(units, 1, kMaxStepBlocks), kStepThreads, 0, stream>>>(a);
  if (num_sources <= kSourcesPerLaunch) {
    launch_fold_marked<kSourcesPerLaunch>(a, sources, num_sources, stream);
  } else {
    launch_fold_marked<kWideSources>(a, sources, num_sources, stream);
  }
  run_heads_kernel<<<step_blocks(a.call.num_entries), kStepThreads, 0, stream>>>(a);
  independent_runs_kernel<<<step_blocks(a.call.num_entries), kStepThreads, 0, stream>>>(a);
  dependent_runs_kernel<<<1, kSortThreads, 0, stream>>>(a);
  write_records_kernel<<<step_blocks(a.call.num_entries), kStepThreads, 0, stream>>>(a);
  verify_context_kernel<<<grid_blocks(units, 1, kMaxStepBlocks), kStepThreads, 0, stream>>>(a);
  finish_kernel<<<1, 1, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kvcanary
