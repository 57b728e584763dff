// CPU kernel of kvcanary::paged_step: the step's ranges planned from the
// engine's rows (cpu/kernels/paged_step_cpu.h), then its record, refold and
// verify batches, each folded on torch's threads and applied with the
// bookkeeping of record and verify (cpu/kernels/canary_cpu.h). The batches
// live in host memory the call owns: no tensor is allocated.
#include "cpu/kernels/paged_step_cpu.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "core/paged_step.h"
#include "cpu/fold_cpu_entry.h"
#include "cpu/kernels/canary_cpu.h"
#include "plan/paged_step_plan.h"

namespace kvcanary {
namespace {

// Entries of one record or verify batch, int64 columns, with the KV cache
// group and row (request) of each, and each entry's root (its request's) when
// the step has roots (request_roots: one per row; null: none).
struct EntryBatch {
  std::vector<int64_t> slots, positions, tokens, prev_slots, groups, rows, roots;
  const int64_t* request_roots;

  explicit EntryBatch(const int64_t* request_roots = nullptr) : request_roots(request_roots) {}

  void add(int64_t slot, int64_t position, int64_t token, int64_t prev_slot, int64_t group,
           int64_t row) {
    slots.push_back(slot);
    positions.push_back(position);
    tokens.push_back(token);
    prev_slots.push_back(prev_slot);
    groups.push_back(group);
    rows.push_back(row);
    if (request_roots != nullptr) {
      roots.push_back(request_roots[row]);
    }
  }
  int64_t size() const { return static_cast<int64_t>(slots.size()); }

  // The batch as record and verify read it; `checks` false leaves out all but
  // the slots (a check of the bytes alone), `with_tokens` false the tokens.
  EntryInputs inputs(bool checks, bool with_tokens) const {
    EntryInputs in{};
    in.slots = slots.data();
    in.positions = checks ? positions.data() : nullptr;
    in.tokens = checks && with_tokens ? tokens.data() : nullptr;
    in.prev_slots = checks ? prev_slots.data() : nullptr;
    in.roots = checks && request_roots != nullptr ? roots.data() : nullptr;
    in.num_entries = size();
    return in;
  }
};

class PagedStepCpu {
 public:
  PagedStepCpu(const PagedStepPlan& plan, const PagedStepArgs& args)
      : plan_(plan), args_(args), capacity_(plan.capacity) {
    const PagedStepRows& rows = plan.rows;
    const int64_t num_rows = rows.num_reqs;
    const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
    computed_.resize(num_rows);
    scheduled_.resize(num_rows);
    token_starts_.resize(num_rows);
    firsts_.resize(num_groups * num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      scheduled_[r] = scheduled_of(rows, r);
      computed_[r] = computed_of(rows, r);
      token_starts_[r] = load_index(rows.query_start_loc, rows.query_start_loc_int32, r);
      for (int64_t g = 0; g < num_groups; ++g) {
        firsts_[g * num_rows + r] = first_attended(plan.groups[g], computed_[r]);
      }
    }
    step_ = {computed_.data(),
             scheduled_.data(),
             firsts_.data(),
             num_rows,
             num_groups,
             args.engine.block_size,
             args.call.phase != kWholeStep};
    ranges_ = step_ranges(step_);
    counters_ = args.engine.tables.counters.mutable_data_ptr<int64_t>();
    ring_ = args.engine.tables.ring.mutable_data_ptr<int64_t>();
    ring_capacity_ = args.engine.tables.ring.size(0);
    origins_ = args.engine.origins.mutable_data_ptr<int64_t>();
  }

  void run() {
    int64_t* mailbox = args_.engine.mailbox.mutable_data_ptr<int64_t>();
    if (args_.call.phase != kAfterForward) {
      mailbox[kMailRingStart] = counters_[kRingWrite];
    }
    if (args_.call.phase != kWholeStep) {
      written_ = written_slots();
    }
    switch (args_.call.phase) {
      case kWholeStep:
        record();
        verify(context(false), true);
        break;
      case kBeforeForward:
        verify(context(false), true);
        verify(tails(), false);
        break;
      case kAfterForward:
        record();
        refold_blocks_written(mailbox[kMailRingStart]);
        verify(context(true), true);
        break;
    }
    mailbox[kMailPhase] = args_.call.phase;
    mailbox[kMailViolations] = counters_[kViolations];
    mailbox[kMailStep] = args_.call.step;
  }

 private:
  int64_t num_rows() const { return step_.num_rows; }
  int64_t num_groups() const { return step_.num_groups; }
  int64_t range_start(int64_t set, int64_t r) const { return ranges_.starts[set * num_rows() + r]; }
  int64_t range_end(int64_t set, int64_t r) const { return ranges_.ends[set * num_rows() + r]; }
  const PagedGroup& group(int64_t g) const { return plan_.groups[g]; }
  int64_t token_slot(int64_t g, int64_t t) const {
    return load_index(group(g).slot_mapping, group(g).slot_mapping_int32, t);
  }

  // Every slot the forward writes, in any group, ascending.
  std::vector<int64_t> written_slots() const {
    std::vector<int64_t> slots;
    slots.reserve(num_groups() * args_.call.num_tokens);
    for (int64_t g = 0; g < num_groups(); ++g) {
      for (int64_t r = 0; r < num_rows(); ++r) {
        for (int64_t t = token_starts_[r]; t < token_starts_[r] + scheduled_[r]; ++t) {
          slots.push_back(token_slot(g, t));
        }
      }
    }
    std::sort(slots.begin(), slots.end());
    return slots;
  }

  // Each group's written tokens, rows in record order (cpu/kernels/
  // paged_step_cpu.h), each chained through the slot of its position - 1.
  void record() {
    EntryBatch batch(plan_.roots);
    const std::vector<int64_t> order = record_order(step_);
    for (int64_t g = 0; g < num_groups(); ++g) {
      for (const int64_t r : order) {
        for (int64_t j = 0; j < scheduled_[r]; ++j) {
          const int64_t t = token_starts_[r] + j;
          const int64_t p = computed_[r] + j;
          const int64_t token =
              plan_.input_ids ? load_index(plan_.input_ids, plan_.input_ids_int32, t) : -1;
          batch.add(token_slot(g, t), load_index(plan_.positions, plan_.positions_int32, t), token,
                    group_slot(group(g), args_.engine.block_size, r, p - 1), g, r);
        }
      }
    }
    if (batch.size() == 0) {
      return;
    }
    const EntryColumns columns(batch.inputs(true, true), true, nullptr);
    std::vector<int64_t> folds(batch.size());
    fold_slot_values_cpu(plan_.fold, batch.slots.data(), false, batch.size(), folds.data());
    const int64_t first_row = counters_[kRingWrite];
    record_entries(table_pointers<CpuRecordTables>(args_.engine.tables, capacity_), columns,
                   folds.data());
    std::vector<bool> reported(batch.size());
    for (int64_t i = 0; i < batch.size(); ++i) {
      const int64_t s = batch.slots[i];
      reported[i] = s >= 0 && (s >= capacity_ || batch.prev_slots[i] >= capacity_);
    }
    name_rows(first_row, batch, reported);
  }

  // Each group's context entries (the step's context sets: the positions
  // each request still attends to), chosen by select_entry
  // (core/context_ranges.h): before the forward those at slots it does not
  // write, after it those it writes (`deferred`); in a whole step all of
  // them.
  EntryBatch context(bool deferred) const {
    EntryBatch batch(plan_.roots);
    ContextChecks checks = plan_.history;
    checks.deferred = deferred;
    checks.every = args_.call.every;
    checks.turn = args_.call.step % args_.call.every;
    if (args_.call.phase != kWholeStep) {
      checks.written = written_.data();
      checks.num_written = static_cast<int64_t>(written_.size());
    }
    for (int64_t g = 0; g < num_groups(); ++g) {
      const int64_t set = kStepSets + g;
      std::vector<int64_t> offsets(num_rows() + 1, 0), starts(num_rows());
      for (int64_t r = 0; r < num_rows(); ++r) {
        starts[r] = range_start(set, r);
        offsets[r + 1] = offsets[r] + range_end(set, r) - starts[r];
      }
      const int64_t n = offsets[num_rows()];
      std::vector<int64_t> slots(n), positions(n), prev_slots(n), rows(n), tokens(n, -1);
      ContextRanges c = group_ranges(group(g), args_.engine.block_size);
      c.offsets = offsets.data();
      c.starts = starts.data();
      c.num_rows = num_rows();
      c.cut_slot = args_.engine.padding_slot;
      c.num_entries = n;
      c.slots = slots.data();
      c.positions = positions.data();
      c.prev_slots = prev_slots.data();
      c.rows = rows.data();
      int64_t* token_out = checks.history != nullptr ? tokens.data() : nullptr;
      if (n <= kContextEntriesGrain) {
        context_checks_range(c, checks, token_out, 0, n);
      } else {
        torch::stable::parallel_for(0, n, kContextEntriesGrain, [&](int64_t begin, int64_t end) {
          context_checks_range(c, checks, token_out, begin, end);
        });
      }
      for (int64_t i = 0; i < n; ++i) {
        if (slots[i] >= 0) {
          batch.add(slots[i], positions[i], tokens[i], prev_slots[i], g, rows[i]);
        }
      }
    }
    return batch;
  }

  // The slots of each group's ranges of step set `set`, with their rows.
  EntryBatch set_slots(int64_t set) const {
    EntryBatch batch;
    for (int64_t g = 0; g < num_groups(); ++g) {
      for (int64_t r = 0; r < num_rows(); ++r) {
        for (int64_t p = range_start(set, r); p < range_end(set, r); ++p) {
          const int64_t s = group_slot(group(g), args_.engine.block_size, r, p);
          if (s >= 0) {
            batch.add(s, p, -1, -1, g, r);
          }
        }
      }
    }
    return batch;
  }

  // The unwritten rest of each request's last block (blocks_packed): only
  // their bytes are checked, since a tail slot may hold a rejected draft
  // token's record.
  EntryBatch tails() const { return set_slots(kTail); }

  // Under blocks_packed a write to a slot changes its block's other slots, so
  // every slot of a block the forward wrote gets its fold recomputed, its
  // record kept; a slot verify flagged in this step (a ring row since
  // `ring_start`) keeps its fold too, so that it is reported again while it
  // is read. If the ring overflowed in this step, which slots were flagged
  // is not known, and only the written slots are refolded.
  void refold_blocks_written(int64_t ring_start) {
    const int64_t ring_end = counters_[kRingWrite];
    ring_start = std::min(ring_start, ring_end);
    std::vector<int64_t> flagged;
    for (int64_t i = ring_start; i < std::min(ring_end, ring_capacity_); ++i) {
      flagged.push_back(ring_[i * kViolationFields + kRowSlot]);
    }
    std::sort(flagged.begin(), flagged.end());
    const bool overflowed = ring_end > ring_capacity_;
    std::vector<int64_t> slots;
    for (const int64_t s : set_slots(kBlocksWritten).slots) {
      const bool kept = overflowed ? !std::binary_search(written_.begin(), written_.end(), s)
                                   : std::binary_search(flagged.begin(), flagged.end(), s);
      if (!kept && s < capacity_) {
        slots.push_back(s);
      }
    }
    std::sort(slots.begin(), slots.end());
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    std::vector<int64_t> folds(slots.size());
    fold_slot_values_cpu(plan_.fold, slots.data(), false, static_cast<int64_t>(slots.size()),
                         folds.data());
    int64_t* records = args_.engine.tables.records.mutable_data_ptr<int64_t>();
    for (size_t i = 0; i < slots.size(); ++i) {
      records[slots[i] * kRecordFields + kFold] = folds[i];
    }
  }

  // verify of a batch (`checks` false: the bytes alone), folded with its
  // checks beside the fold, then its rows in entry order.
  void verify(const EntryBatch& batch, bool checks) {
    const int64_t n = batch.size();
    if (n == 0) {
      return;
    }
    const EntryColumns columns(batch.inputs(checks, plan_.history.history != nullptr), false,
                               nullptr);
    std::vector<int64_t> folds(n);
    const auto flagged = std::make_unique<bool[]>(n);
    const VerifySide side{table_pointers<CpuVerifyTables>(args_.engine.tables, capacity_), columns,
                          folds.data(), args_.engine.padding_slot, flagged.get()};
    fold_slot_values_cpu(plan_.fold, batch.slots.data(), false, n, folds.data(),
                         {&VerifySide::lines, &VerifySide::after, &side});
    const int64_t first_row = counters_[kRingWrite];
    verify_rows(side.tables, columns, folds.data(), args_.engine.padding_slot, flagged.get());
    name_rows(first_row, batch, std::vector<bool>(flagged.get(), flagged.get() + n));
  }

  // The origins of the ring rows a batch appended from `first_row` on, one
  // per entry `reported`, in entry order.
  void name_rows(int64_t first_row, const EntryBatch& batch, const std::vector<bool>& reported) {
    int64_t index = first_row;
    for (int64_t i = 0; i < batch.size() && index < ring_capacity_; ++i) {
      if (!reported[i]) continue;
      int64_t* origin = origins_ + index * kOriginFields;
      origin[kOriginStep] = args_.call.step;
      origin[kOriginGroup] = batch.groups[i];
      origin[kOriginRow] = batch.rows[i];
      ++index;
    }
  }

  const PagedStepPlan& plan_;
  const PagedStepArgs& args_;
  int64_t capacity_;
  std::vector<int64_t> computed_, scheduled_, token_starts_, firsts_;
  StepInputs step_{};
  StepRanges ranges_;
  std::vector<int64_t> written_;
  int64_t* counters_;
  int64_t* ring_;
  int64_t ring_capacity_;
  int64_t* origins_;
};

void paged_step_cpu(const PagedStepArgs& args) {
  const PagedStepPlan plan = make_paged_step_plan(args);
  check_paged_step_rows(plan, args);
  PagedStepCpu(plan, args).run();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(kvcanary, CPU, m) {
  m.impl("paged_step", TORCH_BOX(&paged_step_op<paged_step_cpu>));
}

}  // namespace kvcanary
