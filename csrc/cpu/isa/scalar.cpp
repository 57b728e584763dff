// The portable CPU path: plain 64-bit arithmetic, eight slots (or digest units)
// in flight.
#include <cstring>

#include "cpu/kernels/digest_cpu_lanes.h"
#include "cpu/kernels/fold_cpu_lanes.h"

namespace kvcanary {
namespace {

struct ScalarLanes {
  using Vec = uint64_t;
  static constexpr int kLanes = 1;
  static constexpr int kBlockChunks = 1;
  static Vec zero() { return 0; }
  static void load_chunks(const unsigned char* const* tokens, int64_t offset, Vec* lo, Vec* hi) {
    // Little-endian host: the chunk's words are its bytes as uint64.
    std::memcpy(lo, tokens[0] + offset, 8);
    std::memcpy(hi, tokens[0] + offset + 8, 8);
  }
  static void store(int64_t* out, Vec v) { *out = static_cast<int64_t>(v); }
  static Vec load(const int64_t* in) { return static_cast<uint64_t>(*in); }
  static Vec splat(uint64_t value) { return value; }
};

}  // namespace

void fold_task_scalar(const CpuFoldWork& work, SlotSpan task, SlotSpan next) {
  LaneFold<ScalarLanes, 8>::fold_task(work, task, next);
}

void digest_range_scalar(const CpuDigestRange& range) { LaneDigest<ScalarLanes, 8>::run(range); }

}  // namespace kvcanary
