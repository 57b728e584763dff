"""`layouts.vllm` against vLLM's own CPU kernels (vLLM's CPU build): where
``cpu_attn_reshape_and_cache`` puts a token's K and V, for each instruction set this machine runs."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")

import torch_kvcanary as kc  # noqa: E402
from torch_kvcanary import layouts  # noqa: E402

BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 2, 32, 64


def _isas() -> list[str]:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    chosen = _get_attn_isa(torch.bfloat16, BLOCK_SIZE, HEAD_SIZE)
    return sorted({chosen, "vec"})


def _write(kv: torch.Tensor, slot: int, isa: str, seed: int) -> None:
    """One token's K and V written by vLLM's CPU kernel, as CPU_ATTN's do_kv_cache_update does."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(1, HEADS, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    value = torch.randn(1, HEADS, HEAD_SIZE, generator=generator).to(torch.bfloat16)
    key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, torch.tensor([slot]), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


def test_the_slots_of_a_block_cover_its_bytes_once():
    kv = torch.arange(BLOCKS * HEADS * BLOCK_SIZE * 2 * HEAD_SIZE, dtype=torch.int32).view(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    k_source, v_source = layouts.vllm(kv, layout="LBHNC", backend="CPU_ATTN")
    for block in range(BLOCKS):
        mine = torch.cat([s.as_view()[block].reshape(-1) for s in (k_source, v_source)]).sort().values
        assert torch.equal(mine, kv[block].reshape(-1))


@pytest.mark.parametrize("isa", _isas())
def test_a_token_write_stays_in_its_block(isa):
    kv = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    sources = layouts.vllm(kv, layout="LBHNC", backend="CPU_ATTN")
    all_slots = torch.arange(BLOCKS * BLOCK_SIZE)
    for step, slot in enumerate([BLOCK_SIZE + 5, 2 * BLOCK_SIZE, BLOCK_SIZE + 6, 31]):
        before = kc.fold(sources, all_slots)
        _write(kv, slot, isa, step)
        changed = (kc.fold(sources, all_slots) != before).nonzero().flatten()
        assert len(changed) > 0 and set((changed // BLOCK_SIZE).tolist()) == {slot // BLOCK_SIZE}


@pytest.mark.parametrize("isa", _isas())
def test_the_kernel_packs_a_blocks_tokens(isa):
    # Why CPU_ATTN is in VLLM_BLOCK_PACKED_BACKENDS: one token's write touches other slots' rows.
    assert "CPU_ATTN" in layouts.VLLM_BLOCK_PACKED_BACKENDS
    kv = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    k_source, _ = layouts.vllm(kv, layout="LBHNC", backend="CPU_ATTN")
    _write(kv, BLOCK_SIZE + 5, isa, 0)
    rows_touched = (k_source.as_view()[1] != 0).flatten(1).any(1).nonzero().flatten().tolist()
    assert rows_touched != [5]
