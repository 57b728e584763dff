#include "plan/paged_step_plan.h"

#include "plan/bound_sources.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

// A step buffer: int32 or int64, 1-D, contiguous, on the step's device, with
// at least `needed` entries.
void check_step_buffer(const Tensor& t, const char* name, int64_t needed, const char* entries,
                       const Tensor& reference) {
  check_index_dtype(t, name);
  KVCANARY_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), name,
                       " must be a contiguous 1-D tensor, got shape ", shape_of(t), " and strides ",
                       strides_of(t));
  KVCANARY_CHECK_VALUE(t.numel() >= needed, name, " has ", t.numel(),
                       " entries but the step needs ", needed, " (", entries,
                       "); pass the engine's whole buffer");
  KVCANARY_CHECK_VALUE(t.device() == reference.device(), name, " is on ", device_of(t),
                       " but the canary is on ", device_of(reference),
                       "; pass the step's buffers on the canary's device");
}

// An int64 table of the canary's paged step, contiguous, with `rows` rows of
// `columns` (rows < 0: any number).
void check_step_table(const Tensor& t, const char* name, int64_t rows, int64_t columns,
                      const Tensor& reference) {
  KVCANARY_CHECK_TYPE(t.scalar_type() == ScalarType::Long, "the canary's ", name,
                      " must be int64, got ", dtype_of(t));
  const bool shaped = columns == 0 ? t.dim() == 1 && t.size(0) == rows
                                   : t.dim() == 2 && t.size(0) == rows && t.size(1) == columns;
  KVCANARY_CHECK_VALUE(
      shaped && t.is_contiguous(), "the canary's ", name, " must be a contiguous int64 tensor of ",
      rows, columns ? " rows of " : " values", columns ? std::to_string(columns) : std::string(),
      ", got shape ", shape_of(t));
  KVCANARY_CHECK_VALUE(t.device() == reference.device() || name == std::string("mailbox"),
                       "the canary's ", name, " is on ", device_of(t), " but its records are on ",
                       device_of(reference));
}

void check_on_table_device(const Tensor& t, const char* name, const Tensor& block_table) {
  KVCANARY_CHECK_VALUE(t.device() == block_table.device(), name, " is on ", device_of(t),
                       " but block_table is on ", device_of(block_table), "; ", kPutOnOneDevice);
}

// The token history (history, history_known) as the context's checks read it,
// checked without reading its data: dtypes, shapes and devices; every entry
// checked (every 1, nothing written) until a call sets the rest.
ContextChecks history_checks(const Tensor& block_table, const std::optional<Tensor>& history,
                             const std::optional<Tensor>& history_known) {
  ContextChecks k{};
  k.every = 1;
  if (history.has_value()) {
    check_index_dtype(*history, "history");
    KVCANARY_CHECK_VALUE(history->dim() == 2,
                         "history must be [history_rows, max_positions], got shape ",
                         shape_of(*history));
    check_on_table_device(*history, "history", block_table);
    k.history = history->const_data_ptr();
    k.history_int32 = history->scalar_type() == ScalarType::Int;
    k.history_rows = history->size(0);
    k.history_len = history->size(1);
    k.history_row_stride = history->stride(0);
    k.history_position_stride = history->stride(1);
  }
  if (history_known.has_value()) {
    KVCANARY_CHECK_VALUE(history.has_value(), "history_known needs history");
    KVCANARY_CHECK_TYPE(history_known->scalar_type() == ScalarType::Bool,
                        "history_known must be a bool tensor, got ", dtype_of(*history_known));
    KVCANARY_CHECK_VALUE(history_known->dim() == 2 && history_known->size(0) == k.history_rows &&
                             history_known->size(1) == k.history_len,
                         "history_known must be shaped like history, ", shape_of(*history),
                         ", got shape ", shape_of(*history_known));
    check_on_table_device(*history_known, "history_known", block_table);
    k.known = history_known->const_data_ptr<bool>();
    k.known_row_stride = history_known->stride(0);
    k.known_position_stride = history_known->stride(1);
  }
  return k;
}

PagedGroup make_group(const PagedStepArgs& a, size_t g, const Tensor& records) {
  const Tensor& table = a.engine.block_tables[g];
  const Tensor& mapping = a.engine.slot_mappings[g];
  check_index_dtype(table, "block_tables[g]");
  KVCANARY_CHECK_VALUE(table.dim() == 2 && table.size(0) >= a.call.num_reqs, "block_tables[", g,
                       "] must be [>= num_reqs = ", a.call.num_reqs, ", max_blocks], got shape ",
                       shape_of(table));
  KVCANARY_CHECK_VALUE(table.device() == records.device(), "block_tables[", g, "] is on ",
                       device_of(table), " but the canary is on ", device_of(records),
                       "; pass the step's buffers on the canary's device");
  check_step_buffer(mapping, "slot_mappings[g]", a.call.num_tokens, "one per token", records);
  KVCANARY_CHECK_VALUE(a.engine.sliding_windows[g] >= 0 && a.engine.chunk_sizes[g] >= 0 &&
                           (a.engine.sliding_windows[g] == 0 || a.engine.chunk_sizes[g] == 0),
                       "group ", g, " has sliding window ", a.engine.sliding_windows[g],
                       " and chunk size ", a.engine.chunk_sizes[g],
                       "; give each group at most one of them, > 0 (0: none)");
  PagedGroup group{};
  group.block_table = table.const_data_ptr();
  group.table_int32 = table.scalar_type() == ScalarType::Int;
  group.row_stride = table.stride(0);
  group.block_stride = table.stride(1);
  group.max_blocks = table.size(1);
  group.slot_mapping = mapping.const_data_ptr();
  group.slot_mapping_int32 = mapping.scalar_type() == ScalarType::Int;
  group.sliding_window = a.engine.sliding_windows[g];
  group.chunk_size = a.engine.chunk_sizes[g];
  return group;
}

}  // namespace

PagedStepPlan make_paged_step_plan(const PagedStepArgs& a) {
  const size_t num_groups = a.engine.block_tables.size();
  KVCANARY_CHECK_VALUE(
      num_groups >= 1 && a.engine.slot_mappings.size() == num_groups &&
          a.engine.sliding_windows.size() == num_groups &&
          a.engine.chunk_sizes.size() == num_groups,
      "got ", a.engine.block_tables.size(), " block tables, ", a.engine.slot_mappings.size(),
      " slot mappings, ", a.engine.sliding_windows.size(), " sliding windows and ",
      a.engine.chunk_sizes.size(), " chunk sizes; pass one of each per KV cache group");
  KVCANARY_CHECK_VALUE(a.call.phase >= 0 && a.call.phase < kNumPhases,
                       "phase must be 0 (the whole step), ",
                       "1 (before the forward) or 2 (after it), got ", a.call.phase);
  KVCANARY_CHECK_VALUE(
      a.call.num_reqs >= 0 && a.call.num_tokens >= 0 && a.call.num_tokens < kMaxTokens,
      "num_reqs and num_tokens must be >= 0, got ", a.call.num_reqs, " and ", a.call.num_tokens);
  KVCANARY_CHECK_VALUE(a.engine.block_size >= 1 && a.engine.block_size < kMaxTokens,
                       "block_size must be in [1, 2**48), got ", a.engine.block_size);
  KVCANARY_CHECK_VALUE(a.call.every >= 1, "every must be >= 1, got ", a.call.every);
  KVCANARY_CHECK_VALUE(a.call.step >= 0, "step must be >= 0, got ", a.call.step);

  PagedStepPlan plan;
  plan.fold = bound_fold_plan(a.engine.sources_table, a.engine.slot_mappings[0]);
  plan.capacity =
      check_canary_tables(a.engine.tables, a.engine.slot_mappings[0], plan.fold.capacity);
  KVCANARY_CHECK_VALUE(a.engine.padding_slot < plan.capacity,
                       "padding_slot must be < the canary's ", plan.capacity, " slots, got ",
                       a.engine.padding_slot);
  const Tensor& records = a.engine.tables.records;
  check_step_table(a.engine.origins, "ring origins", a.engine.tables.ring.size(0), kOriginFields,
                   records);
  check_step_table(a.engine.mailbox, "mailbox", kMailboxWords, 0, records);
  KVCANARY_CHECK_VALUE(a.engine.scratch.scalar_type() == ScalarType::Long &&
                           a.engine.scratch.dim() == 1 && a.engine.scratch.is_contiguous() &&
                           a.engine.scratch.device() == records.device(),
                       "paged_step's scratch must be a contiguous 1-D int64 tensor on the "
                       "canary's device (",
                       device_of(records), "), got ", dtype_of(a.engine.scratch), " of shape ",
                       shape_of(a.engine.scratch), " on ", device_of(a.engine.scratch));
  for (size_t g = 0; g < num_groups; ++g) {
    plan.groups.push_back(make_group(a, g, records));
  }
  check_step_buffer(a.call.query_start_loc, "query_start_loc", a.call.num_reqs + 1, "num_reqs + 1",
                    records);
  check_step_buffer(a.call.seq_lens, "seq_lens", a.call.num_reqs, "one per request", records);
  check_step_buffer(a.call.positions, "positions", a.call.num_tokens, "one per token", records);
  plan.rows = {a.call.query_start_loc.const_data_ptr(),
               a.call.query_start_loc.scalar_type() == ScalarType::Int,
               a.call.seq_lens.const_data_ptr(), a.call.seq_lens.scalar_type() == ScalarType::Int,
               a.call.num_reqs};
  plan.positions = a.call.positions.const_data_ptr();
  plan.positions_int32 = a.call.positions.scalar_type() == ScalarType::Int;
  if (a.call.input_ids.has_value()) {
    check_step_buffer(*a.call.input_ids, "input_ids", a.call.num_tokens, "one per token", records);
    plan.input_ids = a.call.input_ids->const_data_ptr();
    plan.input_ids_int32 = a.call.input_ids->scalar_type() == ScalarType::Int;
  }
  plan.history = history_checks(a.engine.block_tables[0], a.call.history, a.call.history_known);
  if (a.call.history_rows.has_value()) {
    KVCANARY_CHECK_VALUE(a.call.history.has_value(), "history_rows needs history");
    check_step_buffer(*a.call.history_rows, "history_rows", a.call.num_reqs, "one per request",
                      records);
    plan.history.history_row_of = a.call.history_rows->const_data_ptr();
    plan.history.history_row_of_int32 = a.call.history_rows->scalar_type() == ScalarType::Int;
  }
  if (a.call.roots.has_value()) {
    check_roots_dtype(*a.call.roots);
    check_step_buffer(*a.call.roots, "roots", a.call.num_reqs, "one per request", records);
    plan.roots = a.call.roots->const_data_ptr<int64_t>();
  }
  return plan;
}

void check_paged_step_rows(const PagedStepPlan& plan, const PagedStepArgs& a) {
  const PagedStepRows& rows = plan.rows;
  const int64_t first = load_index(rows.query_start_loc, rows.query_start_loc_int32, 0);
  KVCANARY_CHECK_VALUE(first == 0, "query_start_loc[0] must be 0, got ", first);
  for (int64_t r = 0; r < rows.num_reqs; ++r) {
    const int64_t end = load_index(rows.query_start_loc, rows.query_start_loc_int32, r + 1);
    const int64_t scheduled = scheduled_of(rows, r);
    KVCANARY_CHECK_VALUE(scheduled >= 0 && end <= a.call.num_tokens, "request ", r,
                         " runs tokens [", end - scheduled, ", ", end,
                         ") of query_start_loc; each request's tokens must follow the one "
                         "before's, within num_tokens = ",
                         a.call.num_tokens);
    const int64_t seq_len = load_index(rows.seq_lens, rows.seq_lens_int32, r);
    KVCANARY_CHECK_VALUE(seq_len >= scheduled && seq_len < kMaxTokens, "request ", r,
                         " has seq_lens ", seq_len, " but runs ", scheduled,
                         " tokens; seq_lens counts the tokens in the cache once the step is done");
    for (size_t g = 0; g < plan.groups.size(); ++g) {
      const int64_t blocks = (seq_len + a.engine.block_size - 1) / a.engine.block_size;
      KVCANARY_CHECK_VALUE(blocks <= plan.groups[g].max_blocks, "request ", r, " has ", seq_len,
                           " tokens, ", blocks, " blocks of ", a.engine.block_size,
                           ", but block_tables[", g, "] holds ", plan.groups[g].max_blocks,
                           " per row");
    }
  }
}

}  // namespace kvcanary
