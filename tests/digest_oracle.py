"""The SPEC's digest ("Digest" in ../shared/SPEC.md) transcribed in plain Python ints.

It shares nothing with the package: the bytes of each unit are taken from the view with
ordinary indexing, words are read with int.from_bytes, and splitmix64 is written out.
"""

from __future__ import annotations

import torch

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    return splitmix64(splitmix64(splitmix64(a & MASK) ^ (b & MASK)) ^ (c & MASK))


def signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def unit_fold(data: bytes) -> int:
    assert len(data) % 4 == 0
    h = 0
    for i in range(0, len(data), 8):
        h = splitmix64(h ^ int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little"))
    return h


def unit_bytes(view: torch.Tensor, slot: int, unit: int) -> bytes:
    """The unit's bytes in logical row-major order."""
    page_size = view.shape[1]
    element = view[slot // page_size, slot % page_size, unit]
    return bytes(element.contiguous().reshape(-1).view(torch.uint8).tolist())


def digest(views, slots, positions, unit_offsets, groups=None, num_groups: int = 1) -> list[int]:
    views = [v.cpu() for v in views]
    slots = [int(s) for s in torch.as_tensor(slots).reshape(-1).tolist()]
    positions = [int(p) for p in torch.as_tensor(positions).reshape(-1).tolist()]
    groups = [0] * len(slots) if groups is None else [int(g) for g in torch.as_tensor(groups).reshape(-1).tolist()]
    out = [0] * num_groups
    for s, p, g in zip(slots, positions, groups):
        if s < 0:
            continue
        for view, offset in zip(views, unit_offsets):
            for k in range(view.shape[2]):
                out[g] = (out[g] + mix3(offset + k, p, unit_fold(unit_bytes(view, s, k)))) & MASK
    return [signed(x) for x in out]
