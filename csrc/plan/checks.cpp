#include "plan/checks.h"

namespace kvcanary {
namespace {

template <typename index_t>
std::optional<int64_t> first_at_least(const index_t* index, int64_t n, int64_t limit) {
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(index[i]) >= limit) {
      return static_cast<int64_t>(index[i]);
    }
  }
  return std::nullopt;
}

std::optional<int64_t> first_at_least_host(const at::Tensor& index, int64_t limit) {
  if (index.scalar_type() == at::kInt) {
    return first_at_least(index.const_data_ptr<int32_t>(), index.numel(), limit);
  }
  return first_at_least(index.const_data_ptr<int64_t>(), index.numel(), limit);
}

std::optional<int64_t> first_bad_group_host(const at::Tensor& slots, const at::Tensor& groups,
                                            int64_t num_groups) {
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t* group = groups.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (slot[i] >= 0 && (group[i] < 0 || group[i] >= num_groups)) {
      return group[i];
    }
  }
  return std::nullopt;
}

}  // namespace

const IndexSearch kHostSearch{first_at_least_host, first_bad_group_host};

void check_index_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "kv-canary: ", name,
                   " must be an int32 or int64 tensor, got ", t.scalar_type());
}

void check_slots_in_range(const at::Tensor& slots, int64_t capacity, const IndexSearch& search) {
  if (capacity < 0) {
    return;
  }
  if (const std::optional<int64_t> slot = search.first_at_least(slots, capacity)) {
    TORCH_CHECK_INDEX(false, "kv-canary: slot ", *slot, " is out of range for sources of capacity ",
                      capacity, "; slots must be < ", capacity, " (or negative for padding)");
  }
}

void check_entries_in_range(const at::Tensor& index, const char* name, int64_t capacity,
                            const IndexSearch& search) {
  if (const std::optional<int64_t> slot = search.first_at_least(index, capacity)) {
    TORCH_CHECK_INDEX(false, "kv-canary: ", name, " holds slot ", *slot,
                      ", out of range for a canary of capacity ", capacity, "; slots must be < ",
                      capacity, " (or negative for padding)");
  }
}

void check_groups_in_range(const at::Tensor& slots, const at::Tensor& groups, int64_t num_groups,
                           const IndexSearch& search) {
  if (const std::optional<int64_t> group = search.first_bad_group(slots, groups, num_groups)) {
    TORCH_CHECK_INDEX(false, "kv-canary: group ", *group, " is out of range for num_groups ",
                      num_groups, "; groups must be in [0, ", num_groups, ")");
  }
}

}  // namespace kvcanary
