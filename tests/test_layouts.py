"""Engine layout helpers: the golden vectors' layouts rebuilt from their engines'
native tensors, and zero copies."""

import sys

import pytest
import torch
from helpers import DEVICES, golden_tensor, load_golden

import torch_kvcanary as kc
from torch_kvcanary import layouts

GOLDEN = {c["name"]: c for c in load_golden()}


def _native(case_name: str, shape, device) -> torch.Tensor:
    """The engine tensor whose view the golden case stores: its whole storage, reshaped."""
    spec = GOLDEN[case_name]["sources"][0]
    full = golden_tensor({**spec, "shape": [torch.Size(shape).numel()], "stride": [1], "offset": 0}, device)
    return full.view(shape)


def _read_bytes(case_name: str) -> int:
    return GOLDEN[case_name]["sources"][0]["read_bytes"]


def _expect(case_name, sources, device):
    case = GOLDEN[case_name]
    slots = torch.tensor(case["slots"], device=device)
    assert torch.equal(kc.fold(sources, slots).cpu(), torch.tensor(case["expected"]))


@pytest.mark.parametrize("device", DEVICES)
def test_hf_static_cache_golden(device):
    key = _native("hf_static_cache_k", (3, 4, 16, 32), device)  # [batch, heads, max_len, dim]
    k_source, _ = layouts.hf_static_cache(key, key, read_bytes=_read_bytes("hf_static_cache_k"))
    assert k_source.view.data_ptr() == key.data_ptr()
    _expect("hf_static_cache_k", [k_source], device)


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_golden(device):
    kv = _native("vllm_paged_k", (2, 6, 8, 2, 64), device)  # [2, blocks, block_size, heads, dim]
    k_source, v_source = layouts.vllm(kv, read_bytes=_read_bytes("vllm_paged_k"))
    _expect("vllm_paged_k", [k_source], device)
    assert v_source.view.data_ptr() == kv[1].data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_trtllm_golden(device):
    pool = _native("trtllm_block_v", (5, 2, 4, 8, 16), device)  # [blocks, 2, heads, tokens, dim]
    _, v_source = layouts.trtllm_block_pool(pool, read_bytes=_read_bytes("trtllm_block_v"))
    _expect("trtllm_block_v", [v_source], device)


def _token(source, slot):
    view = source.as_view()
    return view[slot // view.shape[1], slot % view.shape[1]]


def test_vllm_fused_layout_reads_the_right_halves():
    blocks, block_size, hd = 3, 4, 32
    storage = torch.randn(blocks * 2 * block_size * hd, dtype=torch.float16)
    fused = storage.as_strided((blocks, 2, block_size, hd), (2 * block_size * hd, hd, 2 * hd, 1))
    k_source, v_source = layouts.vllm_fused(fused)
    slot = 2 * block_size + 3
    assert torch.equal(_token(k_source, slot), fused[2, 0, 3]) and torch.equal(_token(v_source, slot), fused[2, 1, 3])
    slots = torch.arange(blocks * block_size)
    assert torch.equal(kc.fold([k_source, v_source], slots), kc.reference_fold([k_source, v_source], slots))
    k_canary, v_canary = kc.KvCanary(k_source), kc.KvCanary(v_source)
    k_canary.record(slots)
    v_canary.record(slots)
    fused[1, 1, 2, 7] += 1  # one V element of slot 1 * block_size + 2
    assert k_canary.violations(slots) == [] and v_canary.violations(slots) == [block_size + 2]


def test_sglang_helpers_are_views():
    k = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    v = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    k_src, v_src = layouts.sglang_mha(k, v)
    assert k_src.as_view().data_ptr() == k.data_ptr() and v_src.num_bytes_per_token == 8 * 128 * 2
    (mla,) = layouts.sglang_mla(torch.zeros(64, 1, 576, dtype=torch.bfloat16))
    assert mla.num_bytes_per_token == 1152
    assert layouts.sglang_mha(k, v, read_bytes=0) == ()
    (partial_k, _) = layouts.sglang_mha(k, v, read_bytes=64)
    assert partial_k.read_bytes == 64


@pytest.mark.parametrize(
    "helper, shape",
    [(layouts.vllm, (3, 4, 16, 2, 8)), (layouts.vllm_fused, (4, 3, 16, 8)), (layouts.trtllm_block_pool, (4, 3, 2, 16, 8))],
)
def test_shape_errors(helper, shape):
    with pytest.raises(ValueError, match="^kv-canary: "):
        helper(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"^kv-canary: key_cache is \[batch, heads, max_len, head_dim\]"):
        layouts.hf_static_cache(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, 5))


def test_full_read_is_the_default():
    cache = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16)
    k_source, _ = layouts.hf_static_cache(cache, cache)
    assert k_source.read_bytes == 4 * 16 * 2 == kc.clip_read_bytes(requested=sys.maxsize, num_bytes_per_token=128)
