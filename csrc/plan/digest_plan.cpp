#include "plan/digest_plan.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <numeric>

#include "plan/checks.h"
#include "plan/fold_plan.h"

namespace kvcanary {
namespace {

constexpr int64_t kUnitAlign = 4;

void check_index_tensor(const at::Tensor& t, const char* name, const at::Tensor& slots) {
  check_index_dtype(t, name);
  TORCH_CHECK_VALUE(t.sizes() == slots.sizes(), "kv-canary: ", name,
                    " must have the shape of slots ", slots.sizes(), ", got ", t.sizes());
  check_on_slots_device(t, slots, kPutOnOneDevice, name);
}

at::Tensor as_flat_long(const at::Tensor& t) { return t.reshape(-1).to(at::kLong).contiguous(); }

// The widest of 8, 4 and 1 bytes that divides every value in `values`.
int32_t common_piece(std::initializer_list<int64_t> values) {
  for (const int32_t piece : {8, 4}) {
    bool divides = true;
    for (const int64_t v : values) divides = divides && v % piece == 0;
    if (divides) return piece;
  }
  return 1;
}

DigestView layout_view(const at::Tensor& view, int64_t index, int64_t unit_offset) {
  TORCH_CHECK_VALUE(view.dim() >= 3, "kv-canary: digest view ", index,
                    " must be [num_pages, page_size, units, *unit_shape], got shape ",
                    view.sizes());
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  const int64_t unit_bytes = itemsize * c10::multiply_integers(view.sizes().slice(3));
  TORCH_CHECK_VALUE(unit_bytes > 0 && unit_bytes % kUnitAlign == 0, "kv-canary: digest view ",
                    index, " has units of ", unit_bytes, " bytes (shape ", view.sizes(), ", dtype ",
                    view.scalar_type(), "); a unit's bytes must be a positive multiple of ",
                    kUnitAlign);

  DigestView out{};
  SourceLayout& unit = out.unit;
  unit.data = static_cast<const unsigned char*>(view.const_data_ptr());
  unit.page_size = view.size(1);
  unit.page_stride = view.stride(0) * itemsize;
  unit.slot_stride = view.stride(1) * itemsize;
  unit.read_bytes = unit_bytes;
  out.num_units = view.size(2);
  out.unit_stride = view.stride(2) * itemsize;
  out.first_unit_id = static_cast<uint64_t>(unit_offset);

  auto dims = coalesced_dims(view, 3);
  if (dims.empty()) {  // a unit of one element
    dims.emplace_back(1, itemsize);
  }
  TORCH_CHECK_VALUE(dims.back().second == itemsize, "kv-canary: digest view ", index,
                    " must have a contiguous innermost dim (stride 1), got shape ", view.sizes(),
                    " and strides ", view.strides(),
                    "; make the fastest-moving dim of each unit the last one");
  unit.run_bytes = dims.back().first * itemsize;
  dims.pop_back();
  TORCH_CHECK_VALUE(static_cast<int>(dims.size()) <= kMaxOuterDims, "kv-canary: digest view ",
                    index, " has ", dims.size(), " non-contiguous unit dims (strides ",
                    view.strides(), "); at most ", kMaxOuterDims, " are supported");
  unit.num_outer = static_cast<int32_t>(dims.size());
  int64_t outer_gcd = 0;
  for (size_t d = 0; d < dims.size(); ++d) {
    unit.outer_size[d] = dims[d].first;
    unit.outer_stride[d] = dims[d].second;
    outer_gcd = std::gcd(outer_gcd, dims[d].second);
  }

  // What every load's address is a multiple of: the pointer, the strides of
  // dims longer than 1, and (when a unit has several runs) the run length.
  const auto stride_if = [](int64_t size, int64_t stride) { return size > 1 ? stride : 0; };
  const int64_t address = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(unit.data) % 16);
  const int64_t strides = std::gcd(std::gcd(stride_if(view.size(0), unit.page_stride),
                                            stride_if(view.size(1), unit.slot_stride)),
                                   std::gcd(stride_if(out.num_units, out.unit_stride), outer_gcd));
  const int64_t runs = unit.num_outer > 0 ? unit.run_bytes : 0;
  out.piece_bytes = common_piece({address, strides, runs});
  out.aligned_chunks = address == 0 && strides % 16 == 0 && runs % 16 == 0;
  return out;
}

}  // namespace

DigestPlan make_digest_plan(at::TensorList views, const at::Tensor& slots,
                            const at::Tensor& positions, const std::optional<at::Tensor>& groups,
                            at::IntArrayRef unit_offsets, int64_t num_groups) {
  check_index_dtype(slots, "slots");
  check_index_tensor(positions, "positions", slots);
  if (groups.has_value()) {
    check_index_tensor(*groups, "groups", slots);
  }
  TORCH_CHECK_VALUE(num_groups >= 1, "kv-canary: num_groups must be >= 1, got ", num_groups);
  TORCH_CHECK_VALUE(views.size() == unit_offsets.size(), "kv-canary: got ", views.size(),
                    " digest views but ", unit_offsets.size(),
                    " unit_offsets; pass one unit offset (the global id of its unit 0) per view");
  DigestPlan plan;
  plan.num_groups = num_groups;
  plan.views.reserve(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const at::Tensor& view = views[i];
    check_on_slots_device(view, slots, kPutOnOneDevice, "digest view ", i);
    plan.views.push_back(layout_view(view, static_cast<int64_t>(i), unit_offsets[i]));
    const int64_t capacity = view.size(0) * view.size(1);
    plan.capacity = i == 0 ? capacity : std::min(plan.capacity, capacity);
  }
  plan.slots = as_flat_long(slots);
  plan.positions = as_flat_long(positions);
  if (groups.has_value()) {
    plan.groups = as_flat_long(*groups);
  }
  return plan;
}

void check_digest_entries_in_range(const DigestPlan& plan, const IndexSearch& search) {
  check_slots_in_range(plan.slots, plan.capacity, search);
  if (plan.groups.defined()) {
    check_groups_in_range(plan.slots, plan.groups, plan.num_groups, search);
  }
}

}  // namespace kvcanary
