"""A pure-torch fold: the executable form of docs/spec.md, vectorised over slots.

It is the oracle the kernels are tested against and a baseline for the
benchmark. It shares nothing with the C++ code but the sources' views.
"""

from __future__ import annotations

import torch

from .sources import HashMode, KvSource, active_sources, as_mode, folded_bytes, token_bytes


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes seen as uint64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 lanes (wrapping arithmetic modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _token_words(view: torch.Tensor, slots: torch.Tensor, read_bytes: int) -> torch.Tensor:
    """The first read_bytes of each slot's token, as int64 words [n, read_bytes // 8]."""
    page_size = view.shape[1]
    as_bytes = view.unsqueeze(-1).view(torch.uint8)  # integer copies keep every bit pattern
    tokens = as_bytes[slots // page_size, slots % page_size].reshape(slots.numel(), token_bytes(view))
    return tokens[:, :read_bytes].contiguous().view(torch.int64)


def reference_fold(sources: KvSource | list[KvSource], slots: torch.Tensor, *, mode: HashMode = HashMode.ALL) -> torch.Tensor:
    """Same result as `torch_kvcanary.fold`, computed with eager torch ops."""
    mode = as_mode(mode)
    flat = slots.reshape(-1).long()
    acc = torch.zeros_like(flat)
    active = active_sources(sources, mode)
    if not active:
        return acc.view(slots.shape)
    views = [s.as_view() for s in active]
    capacity = min(s.capacity for s in active)
    too_big = flat >= capacity
    if bool(too_big.any()):
        raise IndexError(f"kv-canary: slot {int(flat[too_big][0])} is out of range for sources of capacity {capacity}")
    padding = flat < 0
    if capacity == 0:  # every slot is padding
        return acc.view(slots.shape)
    safe = flat.clamp(min=0)
    for source, view in zip(active, views):
        h = torch.zeros_like(flat)
        for word in _token_words(view, safe, folded_bytes(source, mode)).unbind(1):
            h = splitmix64(h ^ word)
        acc = splitmix64(acc ^ h)
    return acc.masked_fill(padding, 0).view(slots.shape)
