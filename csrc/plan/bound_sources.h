// A bound sources table: the sources of the canary ops validated once, by
// bind_sources, and laid out in an int64 host tensor that the ops' bound
// overloads (record.bound, verify.bound, ...) take instead of `Tensor[]
// sources, SymInt[] read_bytes`. Reading a table costs the same for any number
// of sources: the dispatcher passes one tensor, and the kernels read the
// layouts where they lie.
//
// The table holds raw data pointers and owns nothing: its owner keeps the
// sources alive and unchanged (torch_kvcanary/binding.py), and releases the
// table (zeroing its magic word) before it lets them go.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/fold_math.h"
#include "libtorch/tensors.h"
#include "plan/fold_plan.h"

namespace kvcanary {

// The table: kTableHeaderWords header words, then one SourceLayout per source
// (kLayoutWords words each, its bytes as they lie in memory).
enum TableHeader : int64_t {
  kTableMagic = 0,    // kBoundTableMagic while the table is live; 0 once released
  kTableVersion,      // kBoundTableVersion
  kTableNumSources,   // the number of sources
  kTableCapacity,     // the smallest source capacity; -1 with no sources
  kTableDeviceType,   // the sources' device (DeviceType), CPU with no sources
  kTableDeviceIndex,  // and its index
  kTableLayoutWords,  // kLayoutWords
  kTableHeaderWords,
};

constexpr int64_t kBoundTableMagic = 0x6b76632d7461626cLL;  // "kvc-tabl"
constexpr int64_t kBoundTableVersion = 1;

static_assert(std::is_trivially_copyable_v<SourceLayout> && sizeof(SourceLayout) % 8 == 0 &&
                  alignof(SourceLayout) <= alignof(int64_t),
              "a SourceLayout must lie in whole int64 words of the table");
constexpr int64_t kLayoutWords = sizeof(SourceLayout) / sizeof(int64_t);

// bind_sources(sources, read_bytes) -> the table: the sources checked as fold
// checks them (make_fold_plan's rules and messages), all on one device.
Tensor bind_sources(const std::vector<Tensor>& sources, const std::vector<int64_t>& read_bytes);

// The plan of a call over a bound table: checks that `table` is a live table
// of this version and that the sources lie on the slots' device, and that the
// slots are int32 or int64. The plan's layouts are the table's own rows.
FoldPlan bound_fold_plan(const Tensor& table, const Tensor& slots);

}  // namespace kvcanary
