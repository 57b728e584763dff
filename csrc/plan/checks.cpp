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

std::optional<int64_t> first_at_least_host(const Tensor& index, int64_t limit) {
  if (index.scalar_type() == ScalarType::Int) {
    return first_at_least(index.const_data_ptr<int32_t>(), index.numel(), limit);
  }
  return first_at_least(index.const_data_ptr<int64_t>(), index.numel(), limit);
}

std::optional<int64_t> first_bad_group_host(const Tensor& slots, const Tensor& groups,
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

// torch's names of the device types a tensor of these ops can be on.
const char* device_type_name(DeviceType type) {
  switch (type) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
    case DeviceType::Meta:
      return "meta";
    case DeviceType::XPU:
      return "xpu";
    case DeviceType::MPS:
      return "mps";
    default:
      return nullptr;
  }
}

}  // namespace

std::ostream& operator<<(std::ostream& out, const PrintedInts& ints) {
  out << '[';
  for (size_t i = 0; i < ints.values.size(); ++i) {
    out << (i == 0 ? "" : ", ") << ints.values[i];
  }
  return out << ']';
}

std::ostream& operator<<(std::ostream& out, const PrintedDevice& printed) {
  const Device& device = printed.device;
  if (const char* name = device_type_name(device.type())) {
    out << name;
  } else {
    out << "device type " << static_cast<int>(device.type());
  }
  if (device.has_index() && device.type() != DeviceType::CPU) {
    out << ':' << static_cast<int>(device.index());
  }
  return out;
}

const IndexSearch kHostSearch{first_at_least_host, first_bad_group_host};

void check_index_dtype(const Tensor& t, const char* name) {
  const ScalarType dtype = t.scalar_type();
  KVCANARY_CHECK_TYPE(dtype == ScalarType::Int || dtype == ScalarType::Long, name,
                      " must be an int32 or int64 tensor, got ", dtype_of(t));
}

void check_roots_dtype(const Tensor& roots) {
  KVCANARY_CHECK_TYPE(roots.scalar_type() == ScalarType::Long,
                      "roots must be an int64 tensor (64-bit hashes), got ", dtype_of(roots),
                      "; pass roots as int64");
}

void check_slots_in_range(const Tensor& slots, int64_t capacity, const IndexSearch& search) {
  if (capacity < 0) {
    return;
  }
  if (const std::optional<int64_t> slot = search.first_at_least(slots, capacity)) {
    refuse<std::out_of_range>("slot ", *slot, " is out of range for sources of capacity ", capacity,
                              "; slots must be < ", capacity, " (or negative for padding)");
  }
}

void check_entries_in_range(const Tensor& index, const char* name, int64_t capacity,
                            const IndexSearch& search) {
  if (const std::optional<int64_t> slot = search.first_at_least(index, capacity)) {
    refuse<std::out_of_range>(name, " holds slot ", *slot,
                              ", out of range for a canary of capacity ", capacity,
                              "; slots must be < ", capacity, " (or negative for padding)");
  }
}

void check_groups_in_range(const Tensor& slots, const Tensor& groups, int64_t num_groups,
                           const IndexSearch& search) {
  if (const std::optional<int64_t> group = search.first_bad_group(slots, groups, num_groups)) {
    refuse<std::out_of_range>("group ", *group, " is out of range for num_groups ", num_groups,
                              "; groups must be in [0, ", num_groups, ")");
  }
}

}  // namespace kvcanary
