"""The pure-torch reference: its splitmix64 against plain Python integers, and its fold
against a slot-by-slot Python transcription of the SPEC."""

import random
import struct

import torch
from helpers import golden_source, load_golden

import torch_kvcanary as kc
from torch_kvcanary.reference import splitmix64

MASK = (1 << 64) - 1


def py_splitmix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_splitmix64_matches_python_integers():
    rng = random.Random(0)
    values = [0, 1, MASK, 1 << 63, (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(1000)]
    got = splitmix64(torch.tensor([signed(v) for v in values], dtype=torch.int64))
    assert got.tolist() == [signed(py_splitmix64(v)) for v in values]


def py_fold(sources, slot: int, mode: kc.HashMode) -> int:
    """The SPEC's fold of one slot, word by word in Python."""
    if mode is kc.HashMode.OFF or slot < 0:
        return 0
    acc = 0
    for source in sources:
        if source.read_bytes == 0:
            continue
        view = source.as_view()
        token = view[slot // view.shape[1], slot % view.shape[1]]
        raw = token.unsqueeze(-1).view(torch.uint8).flatten().numpy().tobytes()
        n = 16 if mode is kc.HashMode.PARTIAL else source.read_bytes
        h = 0
        for (word,) in struct.iter_unpack("<Q", raw[:n]):
            h = py_splitmix64(h ^ word)
        acc = py_splitmix64(acc ^ h)
    return signed(acc)


def test_reference_matches_the_spec_transcription_on_golden_layouts():
    for case in load_golden():
        sources = [golden_source(spec) for spec in case["sources"]]
        mode = kc.HashMode[case["mode"]]
        slots = torch.tensor(case["slots"], dtype=torch.int64)
        expected = [py_fold(sources, s, mode) for s in case["slots"]]
        assert kc.reference_fold(sources, slots, mode=mode).tolist() == expected == case["expected"], case["name"]
