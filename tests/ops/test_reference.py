"""The pure-torch reference: its splitmix64 against plain Python integers, and its fold
against the spec transcription (spec_oracle) on the golden vectors."""

import random

import pytest
import spec_oracle as oracle
import torch
from golden import expected_fingerprints, load_golden
from helpers import golden_source

import torch_kvcanary as kc
from torch_kvcanary.reference import splitmix64

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it


def test_splitmix64_matches_python_integers():
    rng = random.Random(0)
    values = [0, 1, oracle.MASK, 1 << 63, (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(1000)]
    got = splitmix64(torch.tensor([oracle.signed(v) for v in values], dtype=torch.int64))
    assert got.tolist() == [oracle.signed(oracle.splitmix64(v)) for v in values]


def test_reference_matches_the_spec_transcription_on_golden_layouts():
    for case in load_golden():
        sources = [golden_source(spec) for spec in case["sources"]]
        mode = kc.HashMode[case["mode"]]
        slots = torch.tensor(case["slots"], dtype=torch.int64)
        expected = expected_fingerprints(case)
        assert kc.reference_fold(sources, slots, mode=mode).tolist() == expected == case["expected"], case["name"]
