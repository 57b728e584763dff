#include "cuda/checks.h"

#include <cstdint>
#include <optional>

#include "cuda/fold_cuda.h"
#include "cuda/range_search.h"
#include "cuda/stream.h"

namespace kvcanary {
namespace {

// A host copy of `bytes` bytes at device address `source`, ordered after the
// work on `stream` (one host sync; the caller knows the copy is needed).
void copy_to_host(void* target, const void* source, size_t bytes, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(target, source, bytes, cudaMemcpyDeviceToHost, stream));
  check_cuda(cudaStreamSynchronize(stream));
}

// The value of the entry of `values` (int32 when values_int32, int64
// otherwise) that `launch` (a search writing a position, cuda/range_search.h)
// finds first, or nullopt when it finds none or while a CUDA graph is being
// captured on the current stream.
template <typename Launch>
std::optional<int64_t> value_at_first(const Tensor& values, bool values_int32,
                                      const Launch& launch) {
  const cudaStream_t stream = current_stream(values.get_device_index());
  if (values.numel() == 0 || capturing(stream)) {
    return std::nullopt;
  }
  const Tensor found = new_tensor({1}, ScalarType::Long, values.device());
  auto* first = reinterpret_cast<unsigned long long*>(found.mutable_data_ptr<int64_t>());
  check_cuda(launch(first, stream));
  unsigned long long position = kNoEntry;
  copy_to_host(&position, first, sizeof(position), stream);
  if (position == kNoEntry) {
    return std::nullopt;
  }
  const auto* base = static_cast<const char*>(values.const_data_ptr());
  if (values_int32) {
    int32_t value = 0;
    copy_to_host(&value, base + position * sizeof(int32_t), sizeof(value), stream);
    return value;
  }
  int64_t value = 0;
  copy_to_host(&value, base + position * sizeof(int64_t), sizeof(value), stream);
  return value;
}

std::optional<int64_t> first_at_least_cuda(const Tensor& index, int64_t limit) {
  const bool int32 = index.scalar_type() == ScalarType::Int;
  return value_at_first(index, int32, [&](unsigned long long* first, cudaStream_t stream) {
    return launch_first_at_least(index.const_data_ptr(), int32, index.numel(), limit, first,
                                 stream);
  });
}

std::optional<int64_t> first_bad_group_cuda(const Tensor& slots, const Tensor& groups,
                                            int64_t num_groups) {
  return value_at_first(groups, false, [&](unsigned long long* first, cudaStream_t stream) {
    return launch_first_bad_group(slots.const_data_ptr<int64_t>(), groups.const_data_ptr<int64_t>(),
                                  slots.numel(), num_groups, first, stream);
  });
}

}  // namespace

const IndexSearch kCudaSearch{first_at_least_cuda, first_bad_group_cuda};

void check_slots_per_call(int64_t num_slots) {
  KVCANARY_CHECK_VALUE(num_slots <= kMaxSlotsPerCall, "at most ", kMaxSlotsPerCall,
                       " slots per call on CUDA, got ", num_slots, "; split the batch");
}

}  // namespace kvcanary
