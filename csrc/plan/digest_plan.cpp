#include "plan/digest_plan.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>

#include "plan/checks.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

constexpr int64_t kUnitAlign = 4;

void check_index_tensor(const Tensor& t, const char* name, const Tensor& slots) {
  check_index_dtype(t, name);
  KVCANARY_CHECK_VALUE(same_shape(t, slots), name, " must have the shape of slots ",
                       shape_of(slots), ", got ", shape_of(t));
  check_on_slots_device(t, slots, kPutOnOneDevice, name);
}

// The widest of 8, 4 and 1 bytes that divides every value in `values`.
int32_t common_piece(std::initializer_list<int64_t> values) {
  for (const int32_t piece : {8, 4}) {
    bool divides = true;
    for (const int64_t v : values) divides = divides && v % piece == 0;
    if (divides) return piece;
  }
  return 1;
}

DigestView layout_view(const Tensor& view, int64_t index, int64_t unit_offset) {
  const IntList sizes = view.sizes();
  const IntList strides = view.strides();
  KVCANARY_CHECK_VALUE(sizes.size() >= 3, "digest view ", index,
                       " must be [num_pages, page_size, units, *unit_shape], got shape ",
                       shape_of(view));
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  const int64_t unit_bytes = itemsize * product_from(sizes, 3);
  KVCANARY_CHECK_VALUE(unit_bytes > 0 && unit_bytes % kUnitAlign == 0, "digest view ", index,
                       " has units of ", unit_bytes, " bytes (shape ", shape_of(view), ", dtype ",
                       dtype_of(view), "); a unit's bytes must be a positive multiple of ",
                       kUnitAlign);

  DigestView out{};
  out.unit = paged_layout(view, 3, {"digest view", index, "unit"});
  SourceLayout& unit = out.unit;
  unit.read_bytes = unit_bytes;
  out.num_units = sizes[2];
  out.unit_stride = strides[2] * itemsize;
  out.first_unit_id = static_cast<uint64_t>(unit_offset);
  int64_t outer_gcd = 0;
  for (int d = 0; d < unit.num_outer; ++d) {
    outer_gcd = std::gcd(outer_gcd, unit.outer_stride[d]);
  }

  // What every load's address is a multiple of: the pointer, the strides of
  // dims longer than 1, and (when a unit has several runs) the run length.
  const auto stride_if = [](int64_t size, int64_t stride) { return size > 1 ? stride : 0; };
  const int64_t address = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(unit.data) % 16);
  const int64_t stride_gcd = std::gcd(
      std::gcd(stride_if(sizes[0], unit.page_stride), stride_if(sizes[1], unit.slot_stride)),
      std::gcd(stride_if(out.num_units, out.unit_stride), outer_gcd));
  const int64_t runs = unit.num_outer > 0 ? unit.run_bytes : 0;
  out.piece_bytes = common_piece({address, stride_gcd, runs});
  out.aligned_chunks = address == 0 && stride_gcd % 16 == 0 && runs % 16 == 0;
  return out;
}

}  // namespace

DigestPlan make_digest_plan(const std::vector<Tensor>& views, const Tensor& slots,
                            const Tensor& positions, const std::optional<Tensor>& groups,
                            const std::vector<int64_t>& unit_offsets, int64_t num_groups) {
  check_index_dtype(slots, "slots");
  check_index_tensor(positions, "positions", slots);
  if (groups.has_value()) {
    check_index_tensor(*groups, "groups", slots);
  }
  KVCANARY_CHECK_VALUE(num_groups >= 1, "num_groups must be >= 1, got ", num_groups);
  KVCANARY_CHECK_VALUE(
      views.size() == unit_offsets.size(), "got ", views.size(), " digest views but ",
      unit_offsets.size(),
      " unit_offsets; pass one unit offset (the global id of its unit 0) per view");
  std::vector<DigestView> laid_out;
  laid_out.reserve(views.size());
  int64_t capacity = -1;
  for (size_t i = 0; i < views.size(); ++i) {
    const Tensor& view = views[i];
    check_on_slots_device(view, slots, kPutOnOneDevice, "digest view ", i);
    laid_out.push_back(layout_view(view, static_cast<int64_t>(i), unit_offsets[i]));
    const int64_t view_capacity = laid_out.back().unit.page_size * view.sizes()[0];
    capacity = i == 0 ? view_capacity : std::min(capacity, view_capacity);
  }
  std::optional<Tensor> flat_groups;
  if (groups.has_value()) {
    flat_groups = in_memory_order_int64(*groups);
  }
  return DigestPlan{std::move(laid_out),
                    capacity,
                    num_groups,
                    in_memory_order_int64(slots),
                    in_memory_order_int64(positions),
                    std::move(flat_groups)};
}

void check_digest_entries_in_range(const DigestPlan& plan, const IndexSearch& search) {
  check_slots_in_range(plan.slots, plan.capacity, search);
  if (plan.groups.has_value()) {
    check_groups_in_range(plan.slots, *plan.groups, plan.num_groups, search);
  }
}

}  // namespace kvcanary
