// The argument checks every op and backend shares, each with its message: one
// home for what a refused dtype, device or index says, and for how the refusal
// reaches Python.
//
// A refused call throws a standard exception whose message starts with
// "kv-canary: " and says what to change; torch turns it into a Python
// exception: std::out_of_range into IndexError (KVCANARY_CHECK_INDEX), and
// std::invalid_argument into ValueError (KVCANARY_CHECK_VALUE; RuntimeError
// from torch 2.15 on). No standard exception reaches Python as TypeError, so a
// dtype refusal (KVCANARY_CHECK_TYPE) is an std::invalid_argument too: the
// package's Python functions check dtypes before they call an op, and raise
// TypeError and ValueError as documented (torch_kvcanary/ops.py).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "libtorch/tensors.h"

namespace kvcanary {

// "kv-canary: " and the parts, as the message of a refused call.
template <typename... Parts>
std::string error_message(const Parts&... parts) {
  std::ostringstream out;
  out << "kv-canary: ";
  (out << ... << parts);
  return out.str();
}

template <typename Exception, typename... Parts>
[[noreturn]] __attribute__((noinline, cold)) void refuse(const Parts&... parts) {
  throw Exception(error_message(parts...));
}

// The message's parts are evaluated only when the check fails.
#define KVCANARY_CHECK_AS(exception, cond, ...)   \
  do {                                            \
    if (__builtin_expect(!(cond), 0)) {           \
      ::kvcanary::refuse<exception>(__VA_ARGS__); \
    }                                             \
  } while (0)
#define KVCANARY_CHECK_VALUE(cond, ...) KVCANARY_CHECK_AS(std::invalid_argument, cond, __VA_ARGS__)
#define KVCANARY_CHECK_TYPE(cond, ...) KVCANARY_CHECK_AS(std::invalid_argument, cond, __VA_ARGS__)
#define KVCANARY_CHECK_INDEX(cond, ...) KVCANARY_CHECK_AS(std::out_of_range, cond, __VA_ARGS__)

// How a message prints a tensor's sizes or strides ("[4, 2, 64]"), its dtype
// ("Byte", as torch's C++ names it) and its device ("cpu", "cuda:0", "meta").
struct PrintedInts {
  IntList values;
};
struct PrintedDevice {
  Device device;
};
std::ostream& operator<<(std::ostream& out, const PrintedInts& ints);
std::ostream& operator<<(std::ostream& out, const PrintedDevice& device);
inline PrintedInts shape_of(const Tensor& t) { return {t.sizes()}; }
inline PrintedInts strides_of(const Tensor& t) { return {t.strides()}; }
inline const char* dtype_of(const Tensor& t) {
  return torch::headeronly::toString(t.scalar_type());
}
inline PrintedDevice device_of(const Tensor& t) { return {t.device()}; }

// The remedy of a tensor on another device than the slots: the usual one, and
// the canary's (its tables stay where they are).
constexpr const char* kPutOnOneDevice = "put them on one device";
constexpr const char* kPutSlotsOnCanaryDevice = "put slots on the canary's device";

// `t`, named by the parts of `name` (e.g. "source ", 3), must be on the
// slots' device.
template <typename... Name>
void check_on_slots_device(const Tensor& t, const Tensor& slots, const char* remedy,
                           const Name&... name) {
  KVCANARY_CHECK_VALUE(t.device() == slots.device(), name..., " is on ", device_of(t),
                       " but slots are on ", device_of(slots), "; ", remedy);
}

// An index tensor (slots, positions, ...) must be int32 or int64.
void check_index_dtype(const Tensor& t, const char* name);

// The roots of record, verify and paged_step (the links of first positions,
// hashes) must be int64.
void check_roots_dtype(const Tensor& roots);

// How a backend finds the entries its range checks refuse. The host loops
// over them (kHostSearch); CUDA reduces them on the device (cuda/checks.h),
// and finds none while a CUDA graph is being captured, whose kernels then skip
// such entries without reading them.
struct IndexSearch {
  // The first entry of `index` (contiguous, int32 or int64) that is >= limit.
  std::optional<int64_t> (*first_at_least)(const Tensor& index, int64_t limit);
  // The group of the first entry whose slot is >= 0 and whose group is
  // outside [0, num_groups) (slots and groups: contiguous, int64, one size).
  std::optional<int64_t> (*first_bad_group)(const Tensor& slots, const Tensor& groups,
                                            int64_t num_groups);
};

extern const IndexSearch kHostSearch;

// The range checks, run when an op's check_bounds is set. Negative slots are
// padding and pass.
//
// fold, digest: IndexError for the first slot >= capacity, the smallest
// capacity of the sources; none when there are no sources (capacity < 0),
// since then no slot reads anything.
void check_slots_in_range(const Tensor& slots, int64_t capacity, const IndexSearch& search);

// record, verify: IndexError for the first entry of `index` (slots or
// prev_slots, named `name`) >= the canary's capacity.
void check_entries_in_range(const Tensor& index, const char* name, int64_t capacity,
                            const IndexSearch& search);

// digest: IndexError for the first entry whose slot is >= 0 and whose group
// is outside [0, num_groups).
void check_groups_in_range(const Tensor& slots, const Tensor& groups, int64_t num_groups,
                           const IndexSearch& search);

}  // namespace kvcanary
