#include "plan/fold_plan.h"

#include <algorithm>
#include <cstdint>

#include "plan/checks.h"

namespace kvcanary {
namespace {

bool is_aligned(int64_t bytes) { return bytes % kReadAlign == 0; }

SourceLayout layout_source(const Tensor& view, int64_t index, int64_t read_bytes) {
  const IntList sizes = view.sizes();
  const IntList strides = view.strides();
  KVCANARY_CHECK_VALUE(sizes.size() >= 2, "source ", index,
                       " must be a view [num_pages, page_size, *token_shape], got shape ",
                       shape_of(view));
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  const int64_t token_bytes = itemsize * product_from(sizes, 2);
  KVCANARY_CHECK_VALUE(token_bytes > 0 && is_aligned(token_bytes), "source ", index, " has ",
                       token_bytes, " bytes per token (shape ", shape_of(view), ", dtype ",
                       dtype_of(view), "); it must be a positive multiple of ", kReadAlign);
  KVCANARY_CHECK_VALUE(read_bytes > 0 && is_aligned(read_bytes) && read_bytes <= token_bytes,
                       "read_bytes[", index, "] must be a positive multiple of ", kReadAlign,
                       " and <= the source's ", token_bytes, " bytes per token, got ", read_bytes);

  SourceLayout layout{};
  layout.data = static_cast<const unsigned char*>(view.const_data_ptr());
  layout.page_size = sizes[1];
  layout.page_stride = strides[0] * itemsize;
  layout.slot_stride = strides[1] * itemsize;
  layout.read_bytes = read_bytes;

  auto dims = coalesced_dims(view, 2);
  if (dims.empty()) {  // a token of one element (a 16-byte dtype)
    dims.emplace_back(1, itemsize);
  }
  KVCANARY_CHECK_VALUE(dims.back().second == itemsize, "source ", index,
                       " must have a contiguous innermost dim (stride 1), got shape ",
                       shape_of(view), " and strides ", strides_of(view),
                       "; make the fastest-moving dim of each token the last one");
  layout.run_bytes = dims.back().first * itemsize;
  KVCANARY_CHECK_VALUE(is_aligned(layout.run_bytes), "source ", index, " has contiguous runs of ",
                       layout.run_bytes, " bytes (shape ", shape_of(view), ", strides ",
                       strides_of(view), "); each contiguous innermost run must be a multiple of ",
                       kReadAlign, " bytes");
  dims.pop_back();
  KVCANARY_CHECK_VALUE(static_cast<int>(dims.size()) <= kMaxOuterDims, "source ", index, " has ",
                       dims.size(), " non-contiguous token dims (strides ", strides_of(view),
                       "); at most ", kMaxOuterDims, " are supported");
  // Strides between runs, tokens and pages; the run itself is contiguous.
  dims.emplace_back(sizes[1], layout.slot_stride);
  dims.emplace_back(sizes[0], layout.page_stride);
  for (const auto& [size, stride] : dims) {
    KVCANARY_CHECK_VALUE(size <= 1 || is_aligned(stride), "source ", index, " has a stride of ",
                         stride, " bytes (shape ", shape_of(view), ", strides ", strides_of(view),
                         ", dtype ", dtype_of(view), "); every stride must be a multiple of ",
                         kReadAlign, " bytes");
  }
  dims.resize(dims.size() - 2);
  layout.num_outer = static_cast<int32_t>(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    layout.outer_size[d] = dims[d].first;
    layout.outer_stride[d] = dims[d].second;
  }

  const auto address = reinterpret_cast<std::uintptr_t>(layout.data);
  KVCANARY_CHECK_VALUE(product_from(sizes, 0) == 0 || address % kReadAlign == 0, "source ", index,
                       " starts at an address that is not ", kReadAlign,
                       "-byte aligned (storage offset ", view.storage_offset(), " elements of ",
                       itemsize, " bytes); pass a view whose first byte is ", kReadAlign,
                       "-byte aligned");
  return layout;
}

}  // namespace

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

FoldPlan make_fold_plan(const std::vector<Tensor>& sources, const Tensor& slots,
                        const std::vector<int64_t>& read_bytes) {
  check_index_dtype(slots, "slots");
  KVCANARY_CHECK_VALUE(sources.size() == read_bytes.size(), "got ", sources.size(), " sources but ",
                       read_bytes.size(), " read_bytes; pass one read_bytes per source");
  FoldPlan plan;
  plan.sources.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const Tensor& view = sources[i];
    check_on_slots_device(view, slots, kPutOnOneDevice, "source ", i);
    plan.sources.push_back(layout_source(view, static_cast<int64_t>(i), read_bytes[i]));
    const int64_t capacity = plan.sources.back().page_size * view.sizes()[0];
    plan.capacity = i == 0 ? capacity : std::min(plan.capacity, capacity);
  }
  return plan;
}

}  // namespace kvcanary
