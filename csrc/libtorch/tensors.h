// The tensor type and the few tensor operations the ops need, on the LibTorch
// stable ABI (torch/csrc/stable, torch/headeronly): the library calls libtorch
// only through its C shim, so one build serves every torch from the floor its
// build names (TORCH_TARGET_VERSION, build_tools/build_ext.py) on.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// Torch 2.11's headers name the shim's error check TORCH_ERROR_CODE_CHECK; later
// ones STABLE_TORCH_ERROR_CODE_CHECK, the same check.
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK TORCH_ERROR_CODE_CHECK
#endif

namespace kvcanary {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;
using ScalarType = torch::headeronly::ScalarType;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;

// The product of `sizes` from dim `first_dim` on: the elements of a token
// ([num_pages, page_size, *token_shape] from dim 2), of a unit (from dim 3).
inline int64_t product_from(IntList sizes, size_t first_dim) {
  int64_t product = 1;
  for (size_t d = first_dim; d < sizes.size(); ++d) product *= sizes[d];
  return product;
}

// Whether `a` and `b` have the same shape (torch 2.11's size lists have no ==).
inline bool same_shape(const Tensor& a, const Tensor& b) {
  const IntList x = a.sizes(), y = b.sizes();
  return std::equal(x.begin(), x.end(), y.begin(), y.end());
}

// A new contiguous tensor on `device`, its memory uninitialised. The shim's
// empty_strided allocates directly (no dispatcher round trip), which matters
// for an op whose whole call takes a few microseconds.
inline Tensor new_tensor(IntList sizes, ScalarType dtype, const Device& device) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;
  }
  int32_t shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  int32_t shim_device =
      torch::stable::detail::to<int32_t>(torch::stable::detail::from(device.type()));
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), shim_dtype, shim_device,
      device.index() < 0 ? 0 : device.index(), &handle));
  return Tensor(handle);
}

// `t` itself when contiguous, which spares a dispatcher call per input and
// call; a contiguous copy otherwise.
inline Tensor in_memory_order(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// The entries of `t` in memory order as a contiguous int64 tensor (its shape
// does not matter to the kernels that read it).
inline Tensor in_memory_order_int64(const Tensor& t) {
  if (t.scalar_type() == ScalarType::Long) {
    return in_memory_order(t);
  }
  return torch::stable::contiguous(torch::stable::to(t, ScalarType::Long));
}

}  // namespace kvcanary
