#include "plan/bound_sources.h"

#include <cstring>

#include "plan/checks.h"

namespace kvcanary {
namespace {

constexpr const char* kBindAgain =
    "; bind the sources again (torch_kvcanary.SourceTable, or a new KvCanary) and pass its table";

// Whether `table` has a table's form: an int64 host tensor, contiguous, 1-D,
// with room for a header.
bool has_table_form(const Tensor& table) {
  return table.scalar_type() == ScalarType::Long && table.device().type() == DeviceType::CPU &&
         table.dim() == 1 && table.is_contiguous() && table.numel() >= kTableHeaderWords;
}

// The table's header, after checking that `table` is one: a tensor of a
// table's form holding a live header of this version and the rows it
// announces.
const int64_t* checked_header(const Tensor& table) {
  KVCANARY_CHECK_VALUE(has_table_form(table),
                       "sources_table must be a table made by bind_sources (a contiguous 1-D "
                       "int64 CPU tensor), got a ",
                       dtype_of(table), " tensor of shape ", shape_of(table), " on ",
                       device_of(table), kBindAgain);
  const int64_t* header = table.const_data_ptr<int64_t>();
  KVCANARY_CHECK_VALUE(header[kTableMagic] == kBoundTableMagic,
                       "sources_table is not a live table of bind_sources (released, or never one)",
                       kBindAgain);
  KVCANARY_CHECK_VALUE(
      header[kTableVersion] == kBoundTableVersion && header[kTableLayoutWords] == kLayoutWords,
      "sources_table was made by another version of torch_kvcanary", kBindAgain);
  const int64_t n = header[kTableNumSources];
  KVCANARY_CHECK_VALUE(n >= 0 && table.numel() == kTableHeaderWords + n * kLayoutWords,
                       "sources_table holds ", table.numel(), " words but its header announces ", n,
                       " sources", kBindAgain);
  return header;
}

}  // namespace

Tensor bind_sources(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes) {
  const FoldPlan plan = lay_out_sources(sources, read_bytes, nullptr);
  const int64_t n = static_cast<int64_t>(plan.sources.size());
  Tensor table =
      new_tensor({kTableHeaderWords + n * kLayoutWords}, ScalarType::Long, Device(DeviceType::CPU));
  int64_t* words = table.mutable_data_ptr<int64_t>();
  const Device device = n > 0 ? sources[0].device() : Device(DeviceType::CPU);
  words[kTableMagic] = kBoundTableMagic;
  words[kTableVersion] = kBoundTableVersion;
  words[kTableNumSources] = n;
  words[kTableCapacity] = plan.capacity;
  words[kTableDeviceType] = static_cast<int64_t>(device.type());
  words[kTableDeviceIndex] = device.index();
  words[kTableLayoutWords] = kLayoutWords;
  if (n > 0) {
    std::memcpy(words + kTableHeaderWords, plan.sources.data(), n * sizeof(SourceLayout));
  }
  return table;
}

FoldPlan bound_fold_plan(const Tensor& table, const Tensor& slots) {
  check_index_dtype(slots, "slots");
  const int64_t* header = checked_header(table);
  const int64_t n = header[kTableNumSources];
  const Device sources_device(static_cast<DeviceType>(header[kTableDeviceType]),
                              static_cast<torch::stable::DeviceIndex>(header[kTableDeviceIndex]));
  KVCANARY_CHECK_VALUE(n == 0 || sources_device == slots.device(), "the bound sources are on ",
                       PrintedDevice{sources_device}, " but slots are on ", device_of(slots),
                       "; put slots on the sources' device");
  FoldPlan plan;
  plan.sources = {reinterpret_cast<const SourceLayout*>(header + kTableHeaderWords),
                  static_cast<size_t>(n)};
  plan.capacity = header[kTableCapacity];
  return plan;
}

}  // namespace kvcanary
