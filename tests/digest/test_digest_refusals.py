"""Every invalid argument of `kv_digest` and of the digest's unit helpers raises a Python
exception whose message starts with `kv-canary:` and names what to change; a slot past the
capacity unchecked adds nothing (the sanitizer job runs this file)."""

import expecttest
import pytest
import torch
from helpers import refusal, refusal_lines

import torch_kvcanary as kc
from torch_kvcanary import digest as digest_units


class TestDigestErrors(expecttest.TestCase):
    def test_slot_past_capacity(self):
        views = [torch.zeros(3, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.float32)]
        entries = torch.tensor([0, 8, 12])
        self.assertExpectedInline(
            refusal(IndexError, lambda: kc.kv_digest(views, entries, entries, unit_offsets=[0, 2])),
            """kv-canary: slot 8 is out of range for sources of capacity 8; slots must be < 8 (or negative for padding)""",
        )

    def test_slot_past_capacity_unchecked_adds_nothing(self):
        views = [torch.randint(0, 256, (3, 4, 2, 16), dtype=torch.uint8), torch.randn(2, 4, 2)]
        entries, positions = torch.tensor([0, 8, 5, 12]), torch.tensor([0, 1, 2, 3])
        unchecked = kc.kv_digest(views, entries, positions, unit_offsets=[0, 2], check_bounds=False)
        in_range = kc.kv_digest(views, torch.tensor([0, -1, 5, -1]), positions, unit_offsets=[0, 2])
        assert torch.equal(unchecked, in_range) and int(in_range) != 0

    def test_groups_out_of_range(self):
        view = torch.zeros(3, 4, 2, 16, dtype=torch.uint8)
        entries = torch.tensor([0, 1, -1])
        self.assertExpectedInline(
            refusal(
                IndexError, lambda: kc.kv_digest([view], entries, entries, unit_offsets=[0], groups=torch.tensor([0, 2, 9]), num_groups=2)
            ),
            """kv-canary: group 2 is out of range for num_groups 2; groups must be in [0, 2)""",
        )
        # a padding entry's group is not looked at
        assert kc.kv_digest([view], entries, entries, unit_offsets=[0], groups=torch.tensor([0, 1, 9]), num_groups=2).shape == (2,)

    def test_views(self):
        entries = torch.tensor([0])
        u8 = torch.zeros(4, 2, 2, 24, dtype=torch.uint8)
        cases = {
            "unit of 6 bytes": [torch.zeros(4, 2, 3, 6, dtype=torch.uint8)],
            "innermost not contiguous": [torch.zeros(4, 2, 3, 16, 2)[..., 0]],
            "rank 2": [torch.zeros(4, 2)],
            "float16 element unit": [torch.zeros(4, 2, 3, dtype=torch.float16)],
        }
        calls = {name: (lambda v=v: kc.kv_digest(v, entries, entries, unit_offsets=[0])) for name, v in cases.items()}
        calls["unit_offsets length"] = lambda: kc.kv_digest([u8, u8], entries, entries, unit_offsets=[0])
        calls["devices"] = lambda: kc.kv_digest([u8.to("meta")], entries, entries, unit_offsets=[0])
        calls["positions shape"] = lambda: kc.kv_digest([u8], entries, torch.tensor([0, 1]), unit_offsets=[0])
        calls["num_groups 0"] = lambda: kc.kv_digest([u8], entries, entries, unit_offsets=[0], num_groups=0)
        self.assertExpectedInline(
            refusal_lines(ValueError, calls),
            """\
unit of 6 bytes: kv-canary: digest view 0 has units of 6 bytes (shape [4, 2, 3, 6], dtype Byte); a unit's bytes must be a positive multiple of 4
innermost not contiguous: kv-canary: digest view 0 must have a contiguous innermost dim (stride 1), got shape [4, 2, 3, 16] and strides [192, 96, 32, 2]; make the fastest-moving dim of each unit the last one
rank 2: kv-canary: digest view 0 must be [num_pages, page_size, units, *unit_shape], got shape [4, 2]
float16 element unit: kv-canary: digest view 0 has units of 2 bytes (shape [4, 2, 3], dtype Short); a unit's bytes must be a positive multiple of 4
unit_offsets length: kv-canary: got 2 digest views but 1 unit_offsets; pass one unit offset (the global id of its unit 0) per view
devices: kv-canary: digest view 0 is on meta but slots are on cpu; put them on one device
positions shape: kv-canary: positions must have the shape of slots [1], got [2]
num_groups 0: kv-canary: num_groups must be >= 1, got 0""",
        )

    def test_types(self):
        view = torch.zeros(4, 2, 2, 16, dtype=torch.uint8)
        entries = torch.tensor([0])
        cases = {
            "float slots": lambda: kc.kv_digest([view], torch.tensor([0.0]), entries, unit_offsets=[0]),
            "list positions": lambda: kc.kv_digest([view], entries, [0], unit_offsets=[0]),
            "int16 groups": lambda: kc.kv_digest([view], entries, entries, unit_offsets=[0], groups=entries.short()),
            "a tensor for views": lambda: kc.kv_digest(view, entries, entries, unit_offsets=[0]),
        }
        self.assertExpectedInline(
            refusal_lines(TypeError, cases),
            """\
float slots: kv-canary: slots must be an int32 or int64 tensor, got Float
list positions: kv-canary: positions must be an int32 or int64 tensor, got list
int16 groups: kv-canary: groups must be an int32 or int64 tensor, got Short
a tensor for views: kv-canary: views must be a sequence of tensors [num_pages, page_size, units, *unit_shape]""",
        )


def test_digest_unit_helpers_refuse_bad_input():
    k = [torch.zeros(4, 3, 16, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="kv-canary: 3 local KV heads on each of 2 ranks do not split 4 KV heads"):
        digest_units.sglang_mha_units(k, k, tp_rank=0, tp_size=2, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"kv-canary: tp_rank must be in \[0, tp_size=2\), got 2"):
        digest_units.sglang_mha_units(k, k, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="kv-canary: a vLLM layer is"):
        digest_units.vllm_units([torch.zeros(3, 4, 2, 16)])
    with pytest.raises(ValueError, match="kv-canary: a packed vLLM layer needs backend="):
        digest_units.vllm_units([torch.zeros(3, 4, 2, 16)], layout="LBHNC")
    with pytest.raises(ValueError, match="kv-canary: a 5-D vLLM layer is the legacy"):
        digest_units.vllm_units([torch.zeros(2, 3, 4, 2, 16)], layout="LBHNC", backend="FLASH_ATTN")
    with pytest.raises(ValueError, match="kv-canary: each of key_caches is"):
        digest_units.hf_static_cache_units([torch.zeros(2, 3, 4)], [torch.zeros(2, 3, 4, 16)])
    with pytest.raises(TypeError, match="kv-canary: kv_caches must be a sequence of per-layer tensors"):
        digest_units.vllm_units(torch.zeros(2, 4, 2, 2, 16))
    with pytest.raises(ValueError, match="kv-canary: got 1 K layers but 2 V layers"):
        digest_units.sglang_mha_units(k, k + k)
