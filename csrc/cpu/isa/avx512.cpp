// The AVX-512 CPU path: eight slots per 512-bit vector, eight vectors in
// flight, native 64-bit multiplies (AVX512DQ).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512dq")
// GCC's intrinsics fill "undefined" lanes from a self-initialised variable.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "cpu/kernels/digest_cpu_lanes.h"
#include "cpu/kernels/fold_cpu_lanes.h"

namespace kvcanary {
namespace {

struct U64x8 {
  __m512i v;
};

inline U64x8 operator^(U64x8 a, U64x8 b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline U64x8 operator>>(U64x8 a, int bits) { return {_mm512_srli_epi64(a.v, bits)}; }
inline U64x8 operator+(U64x8 a, U64x8 b) { return {_mm512_add_epi64(a.v, b.v)}; }
inline U64x8 operator*(U64x8 a, uint64_t c) {
  return {_mm512_mullo_epi64(a.v, _mm512_set1_epi64(static_cast<int64_t>(c)))};
}

inline __m512i load_four_chunks(const unsigned char* const* tokens, int64_t offset) {
  const auto chunk = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tokens[i] + offset));
  };
  const __m256i low = _mm256_inserti128_si256(_mm256_castsi128_si256(chunk(0)), chunk(2), 1);
  const __m256i high = _mm256_inserti128_si256(_mm256_castsi128_si256(chunk(4)), chunk(6), 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

struct Avx512Lanes {
  using Vec = U64x8;
  static constexpr int kLanes = 8;
  static constexpr int kBlockChunks = 4;
  static Vec zero() { return {_mm512_setzero_si512()}; }
  static void load_chunks(const unsigned char* const* tokens, int64_t offset, Vec* lo, Vec* hi) {
    // a = [t0 | t2 | t4 | t6], b = [t1 | t3 | t5 | t7]; unpacking per 128-bit
    // quarter gives lanes t0..t7 in order.
    const __m512i a = load_four_chunks(tokens, offset);
    const __m512i b = load_four_chunks(tokens + 1, offset);
    lo->v = _mm512_unpacklo_epi64(a, b);
    hi->v = _mm512_unpackhi_epi64(a, b);
  }
  // 64 bytes of each of the 8 lanes: an 8 x 8 transpose of 64-bit words.
  static void load_block(const unsigned char* const* tokens, int64_t offset, Vec* words) {
    __m512i row[8];
    for (int i = 0; i < 8; ++i) row[i] = _mm512_loadu_si512(tokens[i] + offset);
    // pairs of rows, word-interleaved: [r0w0 r1w0 | r0w2 r1w2 | ...] and [r0w1 r1w1 | ...]
    __m512i pair[8];
    for (int i = 0; i < 8; i += 2) {
      pair[i] = _mm512_unpacklo_epi64(row[i], row[i + 1]);
      pair[i + 1] = _mm512_unpackhi_epi64(row[i], row[i + 1]);
    }
    // quads of rows: even 128-bit quarters, then odd ones, of two pairs
    constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512i quad[8];
    for (int half = 0; half < 2; ++half) {
      const __m512i* p = pair + 4 * half;
      quad[4 * half + 0] = _mm512_shuffle_i64x2(p[0], p[2], kEven);  // words 0, 4
      quad[4 * half + 1] = _mm512_shuffle_i64x2(p[0], p[2], kOdd);   // words 2, 6
      quad[4 * half + 2] = _mm512_shuffle_i64x2(p[1], p[3], kEven);  // words 1, 5
      quad[4 * half + 3] = _mm512_shuffle_i64x2(p[1], p[3], kOdd);   // words 3, 7
    }
    constexpr int kWordOf[4] = {0, 2, 1, 3};
    for (int q = 0; q < 4; ++q) {
      words[kWordOf[q]].v = _mm512_shuffle_i64x2(quad[q], quad[q + 4], kEven);
      words[kWordOf[q] + 4].v = _mm512_shuffle_i64x2(quad[q], quad[q + 4], kOdd);
    }
  }
  static void store(int64_t* out, Vec v) { _mm512_storeu_si512(out, v.v); }
  static Vec load(const int64_t* in) { return {_mm512_loadu_si512(in)}; }
  static Vec splat(uint64_t value) { return {_mm512_set1_epi64(static_cast<int64_t>(value))}; }
};

}  // namespace

void fold_task_avx512(const CpuFoldWork& work, SlotSpan task, SlotSpan next) {
  LaneFold<Avx512Lanes, 8>::fold_task(work, task, next);
}

void digest_range_avx512(const CpuDigestRange& range) { LaneDigest<Avx512Lanes, 8>::run(range); }

}  // namespace kvcanary

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
