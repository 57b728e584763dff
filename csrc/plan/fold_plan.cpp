#include "plan/fold_plan.h"

#include <c10/util/Exception.h>

#include <cstdint>

#include "plan/checks.h"

namespace kvcanary {
namespace {

bool is_aligned(int64_t bytes) { return bytes % kReadAlign == 0; }

SourceLayout layout_source(const at::Tensor& view, int64_t index, int64_t read_bytes) {
  TORCH_CHECK_VALUE(view.dim() >= 2, "kv-canary: source ", index,
                    " must be a view [num_pages, page_size, *token_shape], got "
                    "shape ",
                    view.sizes());
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  const int64_t token_bytes = itemsize * c10::multiply_integers(view.sizes().slice(2));
  TORCH_CHECK_VALUE(token_bytes > 0 && is_aligned(token_bytes), "kv-canary: source ", index,
                    " has ", token_bytes, " bytes per token (shape ", view.sizes(), ", dtype ",
                    view.scalar_type(), "); it must be a positive multiple of ", kReadAlign);
  TORCH_CHECK_VALUE(read_bytes > 0 && is_aligned(read_bytes) && read_bytes <= token_bytes,
                    "kv-canary: read_bytes[", index,
                    "] must be a positive "
                    "multiple of ",
                    kReadAlign, " and <= the source's ", token_bytes, " bytes per token, got ",
                    read_bytes);

  SourceLayout layout{};
  layout.data = static_cast<const unsigned char*>(view.const_data_ptr());
  layout.page_size = view.size(1);
  layout.page_stride = view.stride(0) * itemsize;
  layout.slot_stride = view.stride(1) * itemsize;
  layout.read_bytes = read_bytes;

  auto dims = coalesced_dims(view, 2);
  if (dims.empty()) {  // a token of one element (a 16-byte dtype)
    dims.emplace_back(1, itemsize);
  }
  TORCH_CHECK_VALUE(dims.back().second == itemsize, "kv-canary: source ", index,
                    " must have a contiguous innermost dim (stride 1), "
                    "got shape ",
                    view.sizes(), " and strides ", view.strides(),
                    "; make the fastest-moving dim of each token the last one");
  layout.run_bytes = dims.back().first * itemsize;
  TORCH_CHECK_VALUE(is_aligned(layout.run_bytes), "kv-canary: source ", index,
                    " has contiguous runs of ", layout.run_bytes, " bytes (shape ", view.sizes(),
                    ", strides ", view.strides(),
                    "); each contiguous innermost run must be "
                    "a multiple of ",
                    kReadAlign, " bytes");
  dims.pop_back();
  TORCH_CHECK_VALUE(static_cast<int>(dims.size()) <= kMaxOuterDims, "kv-canary: source ", index,
                    " has ", dims.size(), " non-contiguous token dims (strides ", view.strides(),
                    "); at most ", kMaxOuterDims, " are supported");
  // Strides between runs, tokens and pages; the run itself is contiguous.
  dims.emplace_back(view.size(1), layout.slot_stride);
  dims.emplace_back(view.size(0), layout.page_stride);
  for (const auto& [size, stride] : dims) {
    TORCH_CHECK_VALUE(size <= 1 || is_aligned(stride), "kv-canary: source ", index,
                      " has a stride of ", stride, " bytes (shape ", view.sizes(), ", strides ",
                      view.strides(), ", dtype ", view.scalar_type(),
                      "); every stride must be a multiple "
                      "of ",
                      kReadAlign, " bytes");
  }
  dims.resize(dims.size() - 2);
  layout.num_outer = static_cast<int32_t>(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    layout.outer_size[d] = dims[d].first;
    layout.outer_stride[d] = dims[d].second;
  }

  const auto address = reinterpret_cast<std::uintptr_t>(layout.data);
  TORCH_CHECK_VALUE(view.numel() == 0 || address % kReadAlign == 0, "kv-canary: source ", index,
                    " starts at an address that "
                    "is not ",
                    kReadAlign, "-byte aligned (storage offset ", view.storage_offset(),
                    " elements of ", itemsize, " bytes); pass a view whose first byte is ",
                    kReadAlign, "-byte aligned");
  return layout;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> coalesced_dims(const at::Tensor& view, int64_t first_dim) {
  const int64_t itemsize = static_cast<int64_t>(view.element_size());
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t d = first_dim; d < view.dim(); ++d) {
    const int64_t size = view.size(d);
    const int64_t stride = view.stride(d) * itemsize;
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

FoldPlan make_fold_plan(at::TensorList sources, const at::Tensor& slots,
                        at::IntArrayRef read_bytes) {
  check_index_dtype(slots, "slots");
  TORCH_CHECK_VALUE(sources.size() == read_bytes.size(), "kv-canary: got ", sources.size(),
                    " sources but ", read_bytes.size(),
                    " read_bytes; pass one read_bytes per source");
  FoldPlan plan;
  plan.sources.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& view = sources[i];
    check_on_slots_device(view, slots, kPutOnOneDevice, "source ", i);
    plan.sources.push_back(layout_source(view, static_cast<int64_t>(i), read_bytes[i]));
    const int64_t capacity = view.size(0) * view.size(1);
    plan.capacity = i == 0 ? capacity : std::min(plan.capacity, capacity);
  }
  return plan;
}

}  // namespace kvcanary
