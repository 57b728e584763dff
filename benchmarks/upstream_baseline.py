"""A CUDA fold written the upstream way, as a benchmark baseline: a persistent grid of
64 blocks of 512 threads, one thread per slot, each thread looping 16-byte loads over
its own row. Row sources only (page_size 1, rows of `read_bytes` or more).

The kernel holds no torch headers: nvcc builds it into a small shared library in
seconds (a torch extension would take minutes), cached by source and architecture, and
ctypes launches it on torch's current stream.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from build_tools.cuda_toolkit import find_nvcc

MAX_POOLS = 8

_CUDA_SOURCE = r"""
#include <cuda_runtime.h>

namespace {
constexpr int kMaxPools = @MAX_POOLS@;
struct Rows {
  const unsigned char* data[kMaxPools];
  long long stride[kMaxPools];
  int count;
  long long read_bytes;
};

__device__ unsigned long long mix(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void __launch_bounds__(512) upstream_fold(Rows rows, const long long* slots, long long n, long long* out) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long slot = slots[i];
    unsigned long long acc = 0;
    if (slot >= 0) {
      for (int s = 0; s < rows.count; ++s) {
        const unsigned char* row = rows.data[s] + slot * rows.stride[s];
        unsigned long long h = 0;
        for (long long b = 0; b < rows.read_bytes; b += 16) {
          const ulonglong2 v = *reinterpret_cast<const ulonglong2*>(row + b);
          h = mix(h ^ v.x);
          h = mix(h ^ v.y);
        }
        acc = mix(acc ^ h);
      }
    }
    out[i] = slot >= 0 ? (long long)acc : 0;
  }
}
}  // namespace

extern "C" int upstream_fold_launch(const void* const* data, const long long* strides, int count,
                                    long long read_bytes, const long long* slots, long long n,
                                    long long* out, void* stream) {
  if (count < 0 || count > kMaxPools) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  Rows rows{};
  rows.count = count;
  rows.read_bytes = read_bytes;
  for (int i = 0; i < count; ++i) {
    rows.data[i] = static_cast<const unsigned char*>(data[i]);
    rows.stride[i] = strides[i];
  }
  upstream_fold<<<64, 512, 0, static_cast<cudaStream_t>(stream)>>>(rows, slots, n, out);
  return cudaGetLastError();
}
""".replace("@MAX_POOLS@", str(MAX_POOLS))


def build_library(arch: str) -> Path:
    """The baseline as a shared library for `arch` (e.g. "90"), built once per source and
    architecture into the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("kv-canary: the upstream baseline needs a CUDA toolkit: put its nvcc on PATH or set CUDA_HOME")
    digest = hashlib.sha256(_CUDA_SOURCE.encode()).hexdigest()[:16]
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "torch_kvcanary")
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"upstream_fold_{digest}_sm{arch}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        source, partial = Path(scratch, "upstream_fold.cu"), Path(scratch, library.name)
        source.write_text(_CUDA_SOURCE)
        command = [
            str(nvcc),
            "-O3",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            "-o",
            str(partial),
            str(source),
        ]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"kv-canary: nvcc could not build the upstream baseline:\n{proc.stderr[-2000:]}")
        os.replace(partial, library)  # atomic: a concurrent build never loads half a file
    return library


@cache
def _load(arch: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(arch)))
    lib.upstream_fold_launch.restype = ctypes.c_int
    lib.upstream_fold_launch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_longlong),
        ctypes.c_int,
        ctypes.c_longlong,
        ctypes.c_void_p,
        ctypes.c_longlong,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return lib


def upstream_fold(pools: list[torch.Tensor], read_bytes: int):
    """A callable slots -> int64 fingerprints over uint8 row pools on one CUDA device (slots:
    a contiguous int64 tensor there, all in range or -1). The pools' pointers are bound
    here, so a call costs one launch."""
    if not 0 < len(pools) <= MAX_POOLS:
        raise ValueError(f"kv-canary: the upstream baseline folds 1 to {MAX_POOLS} pools, got {len(pools)}")
    for pool in pools:
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.stride(1) != 1 or not pool.is_cuda:
            raise ValueError("kv-canary: the upstream baseline folds uint8 rows [rows, bytes] on a CUDA device")
        if pool.shape[1] < read_bytes or read_bytes % 16:
            raise ValueError("kv-canary: the upstream baseline reads whole 16-byte chunks within each row")
    major, minor = torch.cuda.get_device_capability(pools[0].device)
    lib = _load(f"{major}{minor}")
    data = (ctypes.c_void_p * len(pools))(*[p.data_ptr() for p in pools])
    strides = (ctypes.c_longlong * len(pools))(*[p.stride(0) for p in pools])

    def call(slots: torch.Tensor) -> torch.Tensor:
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.device != pools[0].device:
            raise ValueError("kv-canary: the upstream baseline takes contiguous int64 slots on the pools' device")
        out = torch.empty_like(slots)
        stream = torch.cuda.current_stream(slots.device).cuda_stream
        err = lib.upstream_fold_launch(data, strides, len(pools), read_bytes, slots.data_ptr(), slots.numel(), out.data_ptr(), stream)
        if err:
            raise RuntimeError(f"kv-canary: the upstream baseline kernel did not launch (CUDA error {err})")
        return out

    return call
