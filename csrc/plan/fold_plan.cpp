#include "plan/fold_plan.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "plan/bound_sources.h"
#include "plan/checks.h"

namespace kvcanary {
namespace {

bool is_aligned(int64_t bytes) { return bytes % kReadAlign == 0; }

// Dims [first_dim, view.dim()) of `view` as (size, byte stride) pairs with
// size-1 dims dropped and contiguous neighbours merged, innermost last: a
// token's dims for the fold (first_dim 2), a unit's for the digest (3).
std::vector<std::pair<int64_t, int64_t>> coalesced_dims(const Tensor& view, int64_t first_dim) {
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  const IntList sizes = view.sizes();
  const IntList strides = view.strides();
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t d = static_cast<size_t>(first_dim); d < sizes.size(); ++d) {
    const int64_t size = sizes[d];
    const int64_t stride = strides[d] * itemsize;
    if (size == 1) {
      continue;
    }
    if (!dims.empty() && dims.back().second == size * stride) {
      dims.back() = {dims.back().first * size, stride};
    } else {
      dims.emplace_back(size, stride);
    }
  }
  return dims;
}

// A source's rank, its bytes per token and read_bytes.
void check_token_bytes(const Tensor& view, int64_t index, int64_t read_bytes) {
  const IntList sizes = view.sizes();
  KVCANARY_CHECK_VALUE(sizes.size() >= 2, "source ", index,
                       " must be a view [num_pages, page_size, *token_shape], got shape ",
                       shape_of(view));
  const int64_t token_bytes = static_cast<int64_t>(view.element_size()) * product_from(sizes, 2);
  KVCANARY_CHECK_VALUE(token_bytes > 0 && is_aligned(token_bytes), "source ", index, " has ",
                       token_bytes, " bytes per token (shape ", shape_of(view), ", dtype ",
                       dtype_of(view), "); it must be a positive multiple of ", kReadAlign);
  KVCANARY_CHECK_VALUE(read_bytes > 0 && is_aligned(read_bytes) && read_bytes <= token_bytes,
                       "read_bytes[", index, "] must be a positive multiple of ", kReadAlign,
                       " and <= the source's ", token_bytes, " bytes per token, got ", read_bytes);
}

// That every read of a source laid out as `layout` is a whole 16-byte chunk:
// its contiguous runs, its strides (of dims longer than 1) and its first byte
// are multiples of kReadAlign.
void check_whole_chunks(const Tensor& view, int64_t index, const SourceLayout& layout) {
  KVCANARY_CHECK_VALUE(is_aligned(layout.run_bytes), "source ", index, " has contiguous runs of ",
                       layout.run_bytes, " bytes (shape ", shape_of(view), ", strides ",
                       strides_of(view), "); each contiguous innermost run must be a multiple of ",
                       kReadAlign, " bytes");
  // Strides between runs, tokens and pages; the run itself is contiguous.
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int d = 0; d < layout.num_outer; ++d) {
    dims.emplace_back(layout.outer_size[d], layout.outer_stride[d]);
  }
  const IntList sizes = view.sizes();
  dims.emplace_back(sizes[1], layout.slot_stride);
  dims.emplace_back(sizes[0], layout.page_stride);
  for (const auto& [size, stride] : dims) {
    KVCANARY_CHECK_VALUE(size <= 1 || is_aligned(stride), "source ", index, " has a stride of ",
                         stride, " bytes (shape ", shape_of(view), ", strides ", strides_of(view),
                         ", dtype ", dtype_of(view), "); every stride must be a multiple of ",
                         kReadAlign, " bytes");
  }
  const auto address = reinterpret_cast<std::uintptr_t>(layout.data);
  KVCANARY_CHECK_VALUE(product_from(sizes, 0) == 0 || address % kReadAlign == 0, "source ", index,
                       " starts at an address that is not ", kReadAlign,
                       "-byte aligned (storage offset ", view.storage_offset(), " elements of ",
                       view.element_size(), " bytes); pass a view whose first byte is ", kReadAlign,
                       "-byte aligned");
}

SourceLayout layout_source(const Tensor& view, int64_t index, int64_t read_bytes) {
  check_token_bytes(view, index, read_bytes);
  SourceLayout layout = paged_layout(view, 2, {"source", index, "token"});
  layout.read_bytes = read_bytes;
  check_whole_chunks(view, index, layout);
  return layout;
}

}  // namespace

SourceLayout paged_layout(const Tensor& view, int64_t first_item_dim, const ViewName& name) {
  const IntList sizes = view.sizes();
  const IntList strides = view.strides();
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  SourceLayout layout{};
  layout.data = static_cast<const unsigned char*>(view.const_data_ptr());
  layout.page_size = sizes[1];
  layout.page_stride = strides[0] * itemsize;
  layout.slot_stride = strides[1] * itemsize;

  auto dims = coalesced_dims(view, first_item_dim);
  if (dims.empty()) {  // an item of one element
    dims.emplace_back(1, itemsize);
  }
  KVCANARY_CHECK_VALUE(dims.back().second == itemsize, name.kind, " ", name.index,
                       " must have a contiguous innermost dim (stride 1), got shape ",
                       shape_of(view), " and strides ", strides_of(view),
                       "; make the fastest-moving dim of each ", name.item, " the last one");
  layout.run_bytes = dims.back().first * itemsize;
  dims.pop_back();
  KVCANARY_CHECK_VALUE(static_cast<int>(dims.size()) <= kMaxOuterDims, name.kind, " ", name.index,
                       " has ", dims.size(), " non-contiguous ", name.item, " dims (strides ",
                       strides_of(view), "); at most ", kMaxOuterDims, " are supported");
  layout.num_outer = static_cast<int32_t>(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    layout.outer_size[d] = dims[d].first;
    layout.outer_stride[d] = dims[d].second;
  }
  return layout;
}

FoldPlan lay_out_sources(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes,
                         const Tensor* slots) {
  KVCANARY_CHECK_VALUE(sources.size() == read_bytes.size(), "got ", sources.size(), " sources but ",
                       read_bytes.size(), " read_bytes; pass one read_bytes per source");
  FoldPlan plan;
  plan.owned.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const Tensor& view = sources[i];
    if (slots != nullptr) {
      check_on_slots_device(view, *slots, kPutOnOneDevice, "source ", i);
    } else {
      KVCANARY_CHECK_VALUE(view.device() == sources[0].device(), "source ", i, " is on ",
                           device_of(view), " but source 0 is on ", device_of(sources[0]), "; ",
                           kPutOnOneDevice);
    }
    plan.owned.push_back(layout_source(view, static_cast<int64_t>(i), read_bytes[i]));
    const int64_t capacity = plan.owned.back().page_size * view.sizes()[0];
    plan.capacity = i == 0 ? capacity : std::min(plan.capacity, capacity);
  }
  plan.sources = plan.owned;
  return plan;
}

FoldPlan make_fold_plan(const std::vector<Tensor>& sources, const Tensor& slots,
                        const std::vector<int64_t>& read_bytes) {
  check_index_dtype(slots, "slots");
  return lay_out_sources(sources, read_bytes, &slots);
}

FoldPlan make_fold_plan(const SourcesArg& sources, const Tensor& slots) {
  if (sources.table != nullptr) {
    return bound_fold_plan(*sources.table, slots);
  }
  return make_fold_plan(*sources.views, slots, *sources.read_bytes);
}

}  // namespace kvcanary
