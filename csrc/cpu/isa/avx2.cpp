// The AVX2 CPU path: four slots per 256-bit vector, four vectors in flight.
// AVX2 has no 64-bit multiply; it is built from 32-bit ones.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC target("avx2")
#endif

#include "cpu/kernels/digest_cpu_lanes.h"
#include "cpu/kernels/fold_cpu_lanes.h"

namespace kvcanary {
namespace {

struct U64x4 {
  __m256i v;
};

inline U64x4 operator^(U64x4 a, U64x4 b) { return {_mm256_xor_si256(a.v, b.v)}; }
inline U64x4 operator>>(U64x4 a, int bits) { return {_mm256_srli_epi64(a.v, bits)}; }
inline U64x4 operator+(U64x4 a, U64x4 b) { return {_mm256_add_epi64(a.v, b.v)}; }

// Low 64 bits of a * c in each lane:
// lo(a) * lo(c) + ((hi(a) * lo(c) + lo(a) * hi(c)) << 32).
inline U64x4 operator*(U64x4 a, uint64_t c) {
  const __m256i c_lo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xffffffffu));
  const __m256i c_hi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a.v, 32), c_lo),
                                         _mm256_mul_epu32(a.v, c_hi));
  return {_mm256_add_epi64(_mm256_mul_epu32(a.v, c_lo), _mm256_slli_epi64(cross, 32))};
}

inline __m256i load_two_chunks(const unsigned char* low_half, const unsigned char* high_half) {
  const __m256i low =
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low_half)));
  return _mm256_inserti128_si256(low, _mm_loadu_si128(reinterpret_cast<const __m128i*>(high_half)),
                                 1);
}

struct Avx2Lanes {
  using Vec = U64x4;
  static constexpr int kLanes = 4;
  static constexpr int kBlockChunks = 1;
  static Vec zero() { return {_mm256_setzero_si256()}; }
  static void load_chunks(const unsigned char* const* tokens, int64_t offset, Vec* lo, Vec* hi) {
    // a = [t0 | t2], b = [t1 | t3]; unpacking per 128-bit half gives lanes t0..t3 in order.
    const __m256i a = load_two_chunks(tokens[0] + offset, tokens[2] + offset);
    const __m256i b = load_two_chunks(tokens[1] + offset, tokens[3] + offset);
    lo->v = _mm256_unpacklo_epi64(a, b);
    hi->v = _mm256_unpackhi_epi64(a, b);
  }
  static void store(int64_t* out, Vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v.v);
  }
  static Vec load(const int64_t* in) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in))};
  }
  static Vec splat(uint64_t value) { return {_mm256_set1_epi64x(static_cast<int64_t>(value))}; }
};

}  // namespace

void fold_task_avx2(const CpuFoldWork& work, SlotSpan task, SlotSpan next) {
  LaneFold<Avx2Lanes, 4>::fold_task(work, task, next);
}

void digest_range_avx2(const CpuDigestRange& range) { LaneDigest<Avx2Lanes, 4>::run(range); }

}  // namespace kvcanary

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
