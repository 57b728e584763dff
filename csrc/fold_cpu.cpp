// CPU kernel of kvcanary::fold.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>

#include "fold_plan.h"

namespace kvcanary {
namespace {

// Little-endian host: the two words of a chunk are its bytes as uint64.
inline void load_chunk(const unsigned char* p, uint64_t* lo, uint64_t* hi) {
  std::memcpy(lo, p, 8);
  std::memcpy(hi, p + 8, 8);
}

// Slots per parallel task: enough work to amortise scheduling.
constexpr int64_t kGrainSlots = 2048;

at::Tensor fold_cpu(at::TensorList sources, const at::Tensor& slots,
                    at::IntArrayRef read_bytes, bool check_bounds) {
  const FoldPlan plan = make_fold_plan(sources, slots, read_bytes);
  const at::Tensor flat = slots.contiguous();
  at::Tensor out = at::empty(slots.sizes(), slots.options().dtype(at::kLong));
  int64_t* result = out.mutable_data_ptr<int64_t>();
  const int64_t n = flat.numel();
  const int num_sources = static_cast<int>(plan.sources.size());
  AT_DISPATCH_INDEX_TYPES(flat.scalar_type(), "kvcanary_fold_cpu", [&] {
    const index_t* slot = flat.const_data_ptr<index_t>();
    if (check_bounds) {
      check_slots_in_range(slot, n, plan.capacity);
    }
    at::parallel_for(0, n, kGrainSlots, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        result[i] = fold_slot(plan.sources.data(), num_sources, plan.capacity,
                              slot[i], load_chunk);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcanary, CPU, m) { m.impl("fold", &fold_cpu); }

}  // namespace kvcanary
