// The argument checks every op and backend shares, each with its message: one
// home for what a refused dtype, device or index says. Each raises a
// `kv-canary:` error that says what to change.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace kvcanary {

// The remedy of a tensor on another device than the slots: the usual one, and
// the canary's (its tables stay where they are).
constexpr const char* kPutOnOneDevice = "put them on one device";
constexpr const char* kPutSlotsOnCanaryDevice = "put slots on the canary's device";

// `t`, named by the parts of `name` (e.g. "source ", 3), must be on the
// slots' device. The message is formatted only when the check fails.
template <typename... Name>
void check_on_slots_device(const at::Tensor& t, const at::Tensor& slots, const char* remedy,
                           const Name&... name) {
  TORCH_CHECK_VALUE(t.device() == slots.device(), "kv-canary: ", name..., " is on ", t.device(),
                    " but slots are on ", slots.device(), "; ", remedy);
}

// An index tensor (slots, positions, ...) must be int32 or int64.
void check_index_dtype(const at::Tensor& t, const char* name);

// How a backend finds the entries its range checks refuse. The host loops
// over them (kHostSearch); CUDA reduces them on the device (cuda/checks.h),
// and finds none while a CUDA graph is being captured, whose kernels then skip
// such entries without reading them.
struct IndexSearch {
  // The first entry of `index` (flat, int32 or int64) that is >= limit.
  std::optional<int64_t> (*first_at_least)(const at::Tensor& index, int64_t limit);
  // The group of the first entry whose slot is >= 0 and whose group is
  // outside [0, num_groups) (slots and groups: flat, int64, one shape).
  std::optional<int64_t> (*first_bad_group)(const at::Tensor& slots, const at::Tensor& groups,
                                            int64_t num_groups);
};

extern const IndexSearch kHostSearch;

// The range checks, run when an op's check_bounds is set. Negative slots are
// padding and pass.
//
// fold, digest: IndexError for the first slot >= capacity, the smallest
// capacity of the sources; none when there are no sources (capacity < 0),
// since then no slot reads anything.
void check_slots_in_range(const at::Tensor& slots, int64_t capacity, const IndexSearch& search);

// record, verify: IndexError for the first entry of `index` (slots or
// prev_slots, named `name`) >= the canary's capacity.
void check_entries_in_range(const at::Tensor& index, const char* name, int64_t capacity,
                            const IndexSearch& search);

// digest: IndexError for the first entry whose slot is >= 0 and whose group
// is outside [0, num_groups).
void check_groups_in_range(const at::Tensor& slots, const at::Tensor& groups, int64_t num_groups,
                           const IndexSearch& search);

}  // namespace kvcanary
