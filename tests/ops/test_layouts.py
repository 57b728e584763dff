"""Engine layout helpers: the golden vectors' layouts rebuilt from their engines'
native tensors, and zero copies."""

import sys

import pytest
import torch
from golden import golden_tensor, load_golden
from helpers import DEVICES

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
    k_source, v_source = layouts.vllm(kv, layout="NHD", read_bytes=_read_bytes("vllm_paged_k"))
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


def test_full_read_is_the_default():
    cache = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16)
    k_source, _ = layouts.hf_static_cache(cache, cache)
    assert k_source.read_bytes == 4 * 16 * 2 == kc.clip_read_bytes(requested=sys.maxsize, num_bytes_per_token=128)


# vLLM's packed caches. The expected K and V of each backend are vLLM's own expressions,
# transcribed from its attention backends' forward() (vLLM 0.32):
#   CPU_ATTN (cpu_attn.py):    kv.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
#   FLASH_ATTN (flash_attn.py): kv.transpose(1, 2).split(head_size, dim=-1)
def _cpu_attn_halves(kv):
    blocks, heads, block_size, _ = kv.shape
    key, value = kv.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    return key.transpose(1, 2), value.transpose(1, 2)  # [blocks, block_size, heads, head_size]


def _flash_attn_halves(kv):
    return kv.transpose(1, 2).split(kv.shape[-1] // 2, dim=-1)


def _packed(layout_order, blocks=5, heads=2, block_size=32, head_size=64):
    """A logical [B, H, N, 2D] bf16 layer stored with its axes in ``layout_order``."""
    logical = (blocks, heads, block_size, 2 * head_size)
    physical = torch.randn([logical[a] for a in layout_order]).to(torch.bfloat16)
    return physical.permute([layout_order.index(a) for a in range(4)])


def _assert_halves(sources, key, value):
    k_source, v_source = sources
    blocks, block_size = key.shape[:2]
    for slot in (0, 1, block_size - 1, block_size, blocks * block_size - 1):
        assert torch.equal(_token(k_source, slot), key[slot // block_size, slot % block_size])
        assert torch.equal(_token(v_source, slot), value[slot // block_size, slot % block_size])


@pytest.mark.parametrize("layout", sorted(layouts.VLLM_LAYOUTS))
def test_vllm_packed_flash_attn_reads_what_the_backend_reads(layout):
    kv = _packed(layouts.VLLM_LAYOUTS[layout])
    sources = layouts.vllm(kv, layout=layout, backend="FLASH_ATTN")
    _assert_halves(sources, *_flash_attn_halves(kv))
    assert all(s.view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for s in sources)


def test_vllm_cpu_attn_reads_what_the_backend_reads():
    kv = _packed(layouts.VLLM_LAYOUTS["LBHNC"])
    sources = layouts.vllm(kv, layout="LBHNC", backend="CPU_ATTN")
    _assert_halves(sources, *_cpu_attn_halves(kv))
    slots = torch.arange(5 * 32)
    assert torch.equal(kc.fold(sources, slots), kc.reference_fold(sources, slots))
    assert all(s.view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr() for s in sources)


def test_vllm_two_kv_heads_the_backend_decides():
    # With two KV heads the same tensor is a valid layer for both backends; each reading
    # must be the backend's own, and they differ.
    kv = _packed(layouts.VLLM_LAYOUTS["LBHNC"])
    cpu, flash = (layouts.vllm(kv, layout="LBHNC", backend=b) for b in ("CPU_ATTN", "FLASH_ATTN"))
    assert not torch.equal(_token(cpu[0], 1), _token(flash[0], 1))
    canary = kc.KvCanary(cpu, on_violation=None)
    slots = torch.arange(5 * 32)
    canary.record(slots)
    kv.view(5, 2, 64, 64)[3, 1, 32 + 7, 0] += 1  # CPU_ATTN's V of slot 3 * 32 + 7, head 1
    assert canary.violations(slots) == [3 * 32 + 7]


def test_vllm_legacy_hnd_is_a_view_of_its_layout():
    blocks, block_size, heads, dim = 3, 16, 2, 64
    physical = torch.randn(2, blocks, heads, block_size, dim).to(torch.bfloat16)  # HND stride order
    kv = physical.permute(0, 1, 3, 2, 4)  # the logical [2, B, N, H, D]
    k_source, v_source = layouts.vllm(kv, layout="HND")
    assert torch.equal(_token(k_source, block_size + 5), physical[0, 1, :, 5])
    assert torch.equal(_token(v_source, 2), physical[1, 0, :, 2])


def test_vllm_takes_vllms_layout_enum():
    class KVCacheLayout:  # stands in for vllm.v1.kv_cache_layout.KVCacheLayout.LBHNC
        name = "LBHNC"

    kv = _packed(layouts.VLLM_LAYOUTS["LBHNC"])
    _assert_halves(layouts.vllm(kv, layout=KVCacheLayout(), backend="CPU_ATTN"), *_cpu_attn_halves(kv))
