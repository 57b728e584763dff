// The kv-canary fold: splitmix64, the 16-byte chunk step and the slot-to-byte
// mapping. Shared by the host (CPU kernel) and device (CUDA kernel) code, so the
// CPU tests exercise the arithmetic the GPU runs. The contract is the fold of
// SGLang's kv-canary (docs/spec.md, "The fold").
#pragma once

#include <cstdint>

// Internal linkage on the host: the CPU's SIMD translation units compile this
// header for other instruction sets, and their copies must never be merged
// with the portable ones.
#if defined(__CUDACC__)
#define KVC_HOST_DEVICE static __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE static inline
#endif

namespace kvcanary {

// Every read is a whole 16-byte chunk: read_bytes, token sizes, strides and
// data pointers are multiples of this (the CUDA kernel uses 128-bit loads).
constexpr int64_t kReadAlign = 16;

// Token dims left after coalescing contiguous ones; the innermost one is the
// contiguous run and is not counted here. Real layouts need at most 2.
constexpr int kMaxOuterDims = 6;

constexpr uint64_t kSplitmixMul1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kSplitmixMul2 = 0x94D049BB133111EBull;

// `Word` is uint64_t, or a SIMD vector of uint64 lanes with the same operators
// (^, logical >>, wrapping * by a constant).
template <typename Word>
KVC_HOST_DEVICE Word splitmix64(Word x) {
  x = (x ^ (x >> 30)) * kSplitmixMul1;
  x = (x ^ (x >> 27)) * kSplitmixMul2;
  return x ^ (x >> 31);
}

// The spec's mix3(a, b, c) = splitmix64(splitmix64(splitmix64(a) ^ b) ^ c): keys a
// hash by two more values (a digest term: unit id, position, unit fold).
template <typename Word>
KVC_HOST_DEVICE Word mix3(Word a, Word b, Word c) {
  return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c);
}

// One 16-byte chunk = two little-endian words, folded in order.
template <typename Word>
KVC_HOST_DEVICE Word fold_chunk(Word h, Word lo, Word hi) {
  return splitmix64(splitmix64(h ^ lo) ^ hi);
}

// A source after validation: the bytes of slot s are the first `read_bytes`
// bytes, in logical row-major order, of the token at
//   data + (s / page_size) * page_stride + (s % page_size) * slot_stride.
// A token is `num_outer` nested dims of contiguous runs of `run_bytes` each.
// All sizes and strides are in bytes and int64 (pools exceed 4 GiB).
struct SourceLayout {
  const unsigned char* data;
  int64_t page_size;
  int64_t page_stride;
  int64_t slot_stride;
  int64_t read_bytes;
  int64_t run_bytes;
  int32_t num_outer;
  int64_t outer_size[kMaxOuterDims];
  int64_t outer_stride[kMaxOuterDims];
};

KVC_HOST_DEVICE int64_t token_offset(const SourceLayout& src, int64_t slot) {
  if (src.page_size == 1) {  // row sources: spare the 64-bit division
    return slot * src.page_stride;
  }
  return (slot / src.page_size) * src.page_stride + (slot % src.page_size) * src.slot_stride;
}

// Byte offset of contiguous run `run` inside a token (mixed radix over the
// outer dims, innermost last).
KVC_HOST_DEVICE int64_t run_offset(const SourceLayout& src, int64_t run) {
  int64_t offset = 0;
  for (int d = src.num_outer - 1; d >= 0; --d) {
    offset += (run % src.outer_size[d]) * src.outer_stride[d];
    run /= src.outer_size[d];
  }
  return offset;
}

// Byte offset, inside a token, of the 16-byte chunk starting at logical byte
// `byte` (a multiple of kReadAlign).
KVC_HOST_DEVICE int64_t chunk_offset(const SourceLayout& src, int64_t byte) {
  if (src.num_outer == 0) {
    return byte;
  }
  return run_offset(src, byte / src.run_bytes) + byte % src.run_bytes;
}

}  // namespace kvcanary
