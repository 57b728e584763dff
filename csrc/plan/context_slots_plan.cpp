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
