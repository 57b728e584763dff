#include "plan/context_slots_plan.h"

#include "plan/checks.h"

namespace kvcanary {
namespace {

void check_on_table_device(const Tensor& t, const char* name, const Tensor& block_table) {
  KVCANARY_CHECK_VALUE(t.device() == block_table.device(), name, " is on ", device_of(t),
                       " but block_table is on ", device_of(block_table), "; ", kPutOnOneDevice);
}

}  // namespace

ContextSlotsPlan make_context_slots_plan(const Tensor& block_table, const Tensor& offsets,
                                         const Tensor& starts, int64_t block_size,
                                         int64_t num_entries, int64_t cut_slot) {
  check_index_dtype(block_table, "block_table");
  check_index_dtype(starts, "starts");
  KVCANARY_CHECK_TYPE(offsets.scalar_type() == ScalarType::Long,
                      "offsets must be an int64 tensor, got ", dtype_of(offsets));
  KVCANARY_CHECK_VALUE(block_table.dim() == 2,
                       "block_table must be [num_table_rows, max_blocks], got shape ",
                       shape_of(block_table));
  KVCANARY_CHECK_VALUE(offsets.dim() == 1 && offsets.numel() >= 1,
                       "offsets must be 1-D with num_rows + 1 entries, got shape ",
                       shape_of(offsets));
  const int64_t num_rows = offsets.numel() - 1;
  KVCANARY_CHECK_VALUE(starts.dim() == 1 && starts.numel() == num_rows, "starts must be 1-D with ",
                       num_rows, " entries (one per row; offsets has ", num_rows + 1,
                       "), got shape ", shape_of(starts));
  KVCANARY_CHECK_VALUE(num_rows <= block_table.size(0), "got ", num_rows,
                       " rows but block_table has ", block_table.size(0),
                       "; row r reads row r of block_table");
  check_on_table_device(offsets, "offsets", block_table);
  check_on_table_device(starts, "starts", block_table);
  KVCANARY_CHECK_VALUE(block_size >= 1, "block_size must be >= 1, got ", block_size);
  KVCANARY_CHECK_VALUE(num_entries >= 0, "num_entries must be >= 0, got ", num_entries);

  ContextSlotsPlan plan{ContextRanges{}, in_memory_order(offsets), in_memory_order_int64(starts)};
  ContextRanges& c = plan.ranges;
  c.block_table = block_table.const_data_ptr();
  c.table_int32 = block_table.scalar_type() == ScalarType::Int;
  c.row_stride = block_table.stride(0);
  c.block_stride = block_table.stride(1);
  c.max_blocks = block_table.size(1);
  c.offsets = plan.offsets.const_data_ptr<int64_t>();
  c.starts = plan.starts.const_data_ptr<int64_t>();
  c.num_rows = num_rows;
  c.block_size = block_size;
  c.cut_slot = cut_slot;
  c.num_entries = num_entries;
  return plan;
}

ContextSlotsOutputs new_context_slots_outputs(ContextRanges& c, const Device& device) {
  const int64_t n = c.num_entries;
  ContextSlotsOutputs out{
      new_tensor({n}, ScalarType::Long, device), new_tensor({n}, ScalarType::Long, device),
      new_tensor({n}, ScalarType::Long, device), new_tensor({n}, ScalarType::Long, device)};
  c.slots = out.slots.mutable_data_ptr<int64_t>();
  c.positions = out.positions.mutable_data_ptr<int64_t>();
  c.prev_slots = out.prev_slots.mutable_data_ptr<int64_t>();
  c.rows = out.rows.mutable_data_ptr<int64_t>();
  return out;
}

ContextChecksPlan make_context_checks_plan(const Tensor& block_table, int64_t num_rows,
                                           const std::optional<Tensor>& written,
                                           const std::optional<Tensor>& history,
                                           const std::optional<Tensor>& history_known,
                                           const std::optional<Tensor>& history_rows, int64_t every,
                                           int64_t turn, bool deferred) {
  KVCANARY_CHECK_VALUE(every >= 1, "every must be >= 1, got ", every);
  KVCANARY_CHECK_VALUE(turn >= 0 && turn < every, "turn must be in [0, every) = [0, ", every,
                       "), got ", turn);
  ContextChecksPlan plan;
  ContextChecks& k = plan.checks;
  k.deferred = deferred;
  k.every = every;
  k.turn = turn;
  if (written.has_value()) {
    KVCANARY_CHECK_TYPE(written->scalar_type() == ScalarType::Long,
                        "written must be an int64 tensor, got ", dtype_of(*written));
    KVCANARY_CHECK_VALUE(written->dim() == 1, "written must be 1-D, got shape ",
                         shape_of(*written));
    check_on_table_device(*written, "written", block_table);
    plan.written = in_memory_order(*written);
    k.written = plan.written->const_data_ptr<int64_t>();
    k.num_written = written->numel();
  }
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
  if (history_rows.has_value()) {
    KVCANARY_CHECK_VALUE(history.has_value(), "history_rows needs history");
    check_index_dtype(*history_rows, "history_rows");
    KVCANARY_CHECK_VALUE(history_rows->dim() == 1 && history_rows->numel() == num_rows,
                         "history_rows must be 1-D with ", num_rows,
                         " entries (one per row), got shape ", shape_of(*history_rows));
    check_on_table_device(*history_rows, "history_rows", block_table);
    plan.history_row_of = in_memory_order(*history_rows);
    k.history_row_of = plan.history_row_of->const_data_ptr();
    k.history_row_of_int32 = history_rows->scalar_type() == ScalarType::Int;
  }
  return plan;
}

void check_context_checks(const ContextRanges& c, const ContextChecks& k) {
  for (int64_t i = 1; i < k.num_written; ++i) {
    KVCANARY_CHECK_VALUE(k.written[i] >= k.written[i - 1],
                         "written must be sorted ascending (torch.sort), got written[", i,
                         "] = ", k.written[i], " after written[", i - 1, "] = ", k.written[i - 1]);
  }
  if (k.history == nullptr) {
    return;
  }
  for (int64_t r = 0; r < c.num_rows; ++r) {
    const int64_t length = c.offsets[r + 1] - c.offsets[r];
    if (length == 0) {
      continue;
    }
    const int64_t h = history_row(k, r);
    KVCANARY_CHECK_INDEX(h >= 0, "row ", r, " reads a history row outside history's ",
                         k.history_rows, " rows; history_rows must be in [0, ", k.history_rows,
                         ")");
    const int64_t last = c.starts[r] + length - 1;
    KVCANARY_CHECK_INDEX(last < k.history_len, "row ", r, " reaches position ", last,
                         " but history holds ", k.history_len, " positions per row");
  }
}

void check_context_ranges(const ContextRanges& c, const int64_t* offsets, const int64_t* starts) {
  check_range_offsets(offsets, c.num_rows, c.num_entries);
  for (int64_t r = 0; r < c.num_rows; ++r) {
    const int64_t length = offsets[r + 1] - offsets[r];
    if (length > 0) {
      check_range_positions(r, starts[r], starts[r] + length - 1, c.block_size, c.max_blocks);
    }
  }
}

}  // namespace kvcanary
