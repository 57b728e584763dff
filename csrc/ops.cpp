// The kvcanary operator library: the schema lives here, once; each backend
// registers its kernels beside them (cpu/*.cpp, cuda/*.cpp).
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <string>
#include <vector>

#include "core/canary_records.h"
#include "core/indices.h"
#include "cuda/paged_step_scratch.h"
#include "plan/bound_sources.h"
#include "plan/checks.h"

// `import torch_kvcanary._C` loads this library, whose static initializers
// register the ops; the module itself is empty. PyMODINIT_FUNC exports it from
// a library whose other symbols are hidden.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}

namespace kvcanary {
namespace {

// The schemas, each with its contract.
constexpr const char* kSchemas[] = {
    // fold(sources, slots, read_bytes, check_bounds) -> int64 tensor shaped
    // like slots. sources[i] is a view [num_pages, page_size, *token_shape] of
    // any dtype; read_bytes[i] leading bytes of each token are folded. Slots <
    // 0 give 0; slots >= the smallest capacity raise IndexError when
    // check_bounds (CPU, or eager CUDA) and give 0 otherwise.
    "fold(Tensor[] sources, Tensor slots, SymInt[] read_bytes, "
    "bool check_bounds=True) -> Tensor",
    // bind_sources(sources, read_bytes) -> the sources' bound table: the
    // sources checked once as fold checks them, on one device, and laid out
    // in a contiguous int64 CPU tensor (plan/bound_sources.h) that each op's
    // `.bound` overload below takes in place of `Tensor[] sources, SymInt[]
    // read_bytes`, at a host cost that does not grow with the sources. The
    // table holds the sources' data pointers and owns nothing: its owner keeps
    // them alive and unchanged, and zeroes the table's first word to release
    // it; a bound op refuses a tensor that is not a live table with
    // ValueError. A bound op's schema names the table, not the sources, so a
    // compiler cannot order it against writes to them: the Tensor[] forms are
    // the ones for torch.compile.
    "bind_sources(Tensor[] sources, SymInt[] read_bytes) -> Tensor",
    "fold.bound(Tensor sources_table, Tensor slots, bool check_bounds=True) -> Tensor",
    // The canary (docs/spec.md, "The canary records"). records is int64
    // [capacity, 4] (token, position, chain, fold), owner_tags int64
    // [capacity], counters int64 [len(canary_counters())], ring int64
    // [ring_capacity, 8]. positions, tokens, prev_slots (int32/int64) and tags
    // (int64, one value or one per slot) are per-entry inputs shaped like
    // slots; a check whose input is None is not run. roots (int64, one per
    // slot; last, so that positional callers without it are unchanged) is the
    // link of each entry whose prev_slots value is negative (a request's
    // first position: its identity), in place of the anchor; verify flags a
    // first position whose chain is not its root with kIdentityMismatch (bit
    // 8) in place of kChainMismatch, the row's expected_aux being the root.
    // Slots past the capacity raise IndexError when check_bounds and give a
    // kSlotOutOfRange violation row otherwise.
    //
    // record: entries are applied in order, so an entry may chain through an
    // earlier entry's slot; nothing is written when an argument is refused.
    "record(Tensor[] sources, SymInt[] read_bytes, Tensor slots, "
    "Tensor? positions, Tensor? tokens, Tensor? prev_slots, Tensor? tags, "
    "Tensor(a!) records, Tensor(b!) owner_tags, Tensor(c!) counters, "
    "Tensor(d!) ring, bool check_bounds=True, Tensor? roots=None) -> ()",
    "record.bound(Tensor sources_table, Tensor slots, Tensor? positions, Tensor? tokens, "
    "Tensor? prev_slots, Tensor? tags, Tensor(a!) records, Tensor(b!) owner_tags, "
    "Tensor(c!) counters, Tensor(d!) ring, bool check_bounds=True, Tensor? roots=None) -> ()",
    // verify -> bool tensor shaped like slots, True where a check failed; each
    // flagged entry appends a row to the ring. padding_slot (-1: none) is
    // never checked, and a chain through it is not checked.
    "verify(Tensor[] sources, SymInt[] read_bytes, Tensor slots, "
    "Tensor? positions, Tensor? tokens, Tensor? prev_slots, Tensor? tags, "
    "Tensor records, Tensor owner_tags, Tensor(a!) counters, Tensor(b!) ring, "
    "int padding_slot=-1, bool check_bounds=True, Tensor? roots=None) -> Tensor",
    "verify.bound(Tensor sources_table, Tensor slots, Tensor? positions, Tensor? tokens, "
    "Tensor? prev_slots, Tensor? tags, Tensor records, Tensor owner_tags, Tensor(a!) counters, "
    "Tensor(b!) ring, int padding_slot=-1, bool check_bounds=True, Tensor? roots=None) -> Tensor",
    // refold: records[s, fold] = the fold of slot s for each entry s >= 0 of
    // slots (int32 or int64), the record's other fields kept; for a backend
    // whose write to one slot changes the bytes of others. Slots past the
    // capacity raise IndexError when check_bounds and are skipped otherwise.
    "refold(Tensor[] sources, SymInt[] read_bytes, Tensor slots, Tensor(a!) records, "
    "bool check_bounds=True) -> ()",
    "refold.bound(Tensor sources_table, Tensor slots, Tensor(a!) records, "
    "bool check_bounds=True) -> ()",
    // The names of the canary's counters, in the order of its counters tensor.
    "canary_counters() -> str[]",
    // digest(views, slots, positions, groups, unit_offsets, num_groups,
    // check_bounds) -> int64 [num_groups] (docs/spec.md, "The digest").
    // views[j] is [num_pages, page_size, units, *unit_shape] of any dtype, its
    // unit k having the global id unit_offsets[j] + k; entry i (slots,
    // positions and groups of one shape; groups None: all 0) with slots[i] >=
    // 0 adds mix3(id, positions[i], unit fold) of every unit to
    // out[groups[i]], wrapping. Slots past the smallest capacity and groups
    // outside [0, num_groups) raise IndexError when check_bounds (CPU, or
    // eager CUDA) and add nothing otherwise.
    "digest(Tensor[] views, Tensor slots, Tensor positions, Tensor? groups, "
    "int[] unit_offsets, SymInt num_groups, bool check_bounds=True) -> Tensor",
    // paged_step: one paged serving step's canary work for all its KV cache
    // groups, read from the engine's step buffers as they are (padded sizes
    // allowed): request r < num_reqs runs tokens [q[r], q[r + 1]) of
    // query_start_loc q (int32 or int64, >= num_reqs + 1 entries, q[0] = 0),
    // c = seq_lens[r] - (q[r + 1] - q[r]) tokens precede them in the cache;
    // token t < num_tokens has positions[t], input_ids[t] (None: no tokens)
    // and, in group g, slot slot_mappings[g][t] (negative: padding, skipped);
    // block_tables[g] row r is request r's (int32 or int64 [>= num_reqs,
    // max_blocks], any strides). Group g attends from position f = 0, or
    // max(0, c - sliding_windows[g] + 1), or c rounded down to chunk_sizes[g]
    // (0: none). Record: every group's written tokens, requests in order of
    // c (stable), each chained through the block-table slot of its position
    // - 1, as record stores them. Verify: the context [f, c) of each request
    // in each group, each position p as verify checks an entry, with no tag:
    // its fold, position, chain through the slot of p - 1 (padding_slot at
    // p = f > 0), and token history[history_rows[r], p] (history int32 or
    // int64 [H, L], any strides; history_rows int32 or int64, >= num_reqs
    // entries, None: row r) where history_known (bool, shaped like history;
    // None: everywhere) holds true (no history: tokens not checked); under
    // every > 1 only the blocks b with b % every == step % every and each
    // request's last block. roots (int64, 1-D, contiguous, >= num_reqs
    // entries; None: the anchor) gives request r the root roots[r]: the link
    // of each of its entries with no previous slot (position 0), as record
    // and verify take roots, both where the step records position 0 and where
    // it verifies it as context.
    // phase 0 (after the forward) records, then verifies the context; a
    // backend whose write to a slot changes its block's others calls twice:
    // phase 1 (before the forward) verifies the context at slots the step
    // does not write and the bytes of each request's unwritten tail [c + s,
    // C) (C: c rounded up to the block), phase 2 (after) records, refolds
    // every slot of the blocks written (but those flagged in this step) and
    // verifies the context at written slots. Each ring row written gets its
    // (step, group, request) at its index in origins (int64 [ring rows, 3]);
    // last, mailbox (int64 [4]; pinned host memory on CUDA) gets (step,
    // phase, the violations counter, the ring's write index when the step's
    // first call began). scratch (int64, 1-D, contiguous, on the records'
    // device) is the kernels' working memory, left undefined: on CUDA at
    // least paged_step_scratch_size(groups, num_tokens, num_reqs, capacity)
    // values, on the CPU any (it uses none); allocated once by the caller, so
    // that a step allocates nothing. A slot or previous slot past the
    // capacity is a SLOT_OUT_OF_RANGE row, never a read. Raises ValueError
    // before writing anything for arguments of the wrong dtype, shape, size
    // or device, and on the CPU for query_start_loc out of order, seq_lens
    // below a request's tokens or a request past its block table.
    "paged_step(Tensor sources_table, Tensor[] block_tables, Tensor[] slot_mappings, "
    "int[] sliding_windows, int[] chunk_sizes, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor positions, Tensor? input_ids, Tensor? history, Tensor? history_known, "
    "Tensor? history_rows, Tensor(a!) records, Tensor(b!) owner_tags, Tensor(c!) counters, "
    "Tensor(d!) ring, Tensor(e!) origins, Tensor(f!) mailbox, Tensor(g!) scratch, "
    "int num_reqs, int num_tokens, int block_size, int phase, int step, int every=1, "
    "int padding_slot=-1, Tensor? roots=None) -> ()",
    // The int64 values of scratch a CUDA call of paged_step needs for
    // num_groups KV cache groups, num_tokens tokens, num_reqs requests and a
    // canary of capacity slots (cuda/paged_step_scratch.h lays them out).
    "paged_step_scratch_size(int num_groups, int num_tokens, int num_reqs, int capacity) -> int",
    // The CPU kernel's instruction-set path: "scalar", "avx2" or "avx512"; the
    // best one the CPU has unless $KVCANARY_CPU_ISA names a lesser one.
    "cpu_isa() -> str",
};

std::vector<std::string> canary_counters() {
  return {std::begin(kCounterNames), std::end(kCounterNames)};
}

int64_t paged_step_scratch_size(int64_t num_groups, int64_t num_tokens, int64_t num_reqs,
                                int64_t capacity) {
  KVCANARY_CHECK_VALUE(num_groups >= 0 && num_groups <= kMaxPagedGroups && num_tokens >= 0 &&
                           num_tokens < kMaxTokens && num_reqs >= 0 && num_reqs < kMaxTokens &&
                           capacity >= 0 && capacity < kMaxTokens,
                       "paged_step_scratch_size takes num_groups in [0, ", kMaxPagedGroups,
                       "] and num_tokens, num_reqs and capacity in [0, 2**48), got ", num_groups,
                       ", ", num_tokens, ", ", num_reqs, " and ", capacity);
  return paged_step_scratch_values(num_groups * num_tokens, num_reqs, capacity);
}

}  // namespace
}  // namespace kvcanary

// The library's definition. The fake (meta) kernels are registered by the
// package's Python modules, each beside its op's wrapper, when the package
// loads this library (torch_kvcanary/_library.py); their module is not named
// to torch (set_python_module), which the stable ABI has only from torch 2.13,
// past the floor.
STABLE_TORCH_LIBRARY(kvcanary, m) {
  for (const char* schema : kvcanary::kSchemas) {
    m.def(schema);
  }
}

// No tensor arguments, or host work on the sources' metadata alone (which
// holds for any device, and for no sources): CompositeExplicitAutograd serves
// every call.
STABLE_TORCH_LIBRARY_IMPL(kvcanary, CompositeExplicitAutograd, m) {
  m.impl("canary_counters", TORCH_BOX(&kvcanary::canary_counters));
  m.impl("paged_step_scratch_size", TORCH_BOX(&kvcanary::paged_step_scratch_size));
  m.impl("bind_sources", TORCH_BOX(&kvcanary::bind_sources));
}
