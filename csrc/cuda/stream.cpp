#include "cuda/stream.h"

#include <stdexcept>
#include <string>

#include "libtorch/shim_lookup.h"

namespace kvcanary {
namespace {

// The signature of the C shim's aoti_torch_get_current_cuda_stream.
using GetCurrentStream = int32_t (*)(int32_t device_index, void** stream);

constexpr const char* kStreamFunction = "aoti_torch_get_current_cuda_stream";

}  // namespace

cudaStream_t current_stream(int32_t device_index) {
  static const auto get_current_stream =
      reinterpret_cast<GetCurrentStream>(find_shim_function("libtorch_cuda.so", kStreamFunction));
  if (get_current_stream == nullptr) {
    throw std::runtime_error(std::string("kv-canary: this torch has no ") + kStreamFunction +
                             " (libtorch_cuda is not loaded): the CUDA kernels need a CUDA "
                             "build of torch");
  }
  void* stream = nullptr;
  if (get_current_stream(device_index, &stream) != 0) {
    throw std::runtime_error("kv-canary: torch gave no current CUDA stream for device " +
                             std::to_string(device_index));
  }
  return static_cast<cudaStream_t>(stream);
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

void check_cuda(cudaError_t error) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string("kv-canary: CUDA error ") + cudaGetErrorName(error) +
                             ": " + cudaGetErrorString(error));
  }
}

}  // namespace kvcanary
