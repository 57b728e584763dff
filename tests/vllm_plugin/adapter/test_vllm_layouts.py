"""`layouts.vllm` and `digest.vllm_units` against vLLM's own CPU kernels (vLLM's CPU build):
where ``cpu_attn_reshape_and_cache`` puts a token's K and V, for each instruction set this
machine runs."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")

import torch_kvcanary as kc  # noqa: E402
from torch_kvcanary import digest, layouts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.every_release]  # each release's CPU kernels

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


def _distinct_bf16(count: int, first_bits: int) -> torch.Tensor:
    """``count`` distinct finite bf16 values: the bit patterns ``first_bits``, ``first_bits + 1``, ..."""
    assert 0 < first_bits and first_bits + count <= 0x7F80  # positive, below infinity
    return (torch.arange(count, dtype=torch.int32) + first_bits).to(torch.int16).view(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16).sort().values


@pytest.mark.parametrize("isa", _isas())
def test_k_and_v_views_hold_the_k_and_v_the_kernel_wrote(isa):
    """Every token of the cache written through vLLM's kernel, each K and V value distinct:
    the digest's K units of a block and head hold exactly the K bytes of that block's tokens
    and head, its V units their V bytes (as sets: the kernel packs a block's tokens, see
    VLLM_BLOCK_PACKED_BACKENDS), and layouts.vllm folds the same views."""
    from vllm import _custom_ops as ops

    tokens = BLOCKS * BLOCK_SIZE
    count = tokens * HEADS * HEAD_SIZE
    key = _distinct_bf16(count, 0x0800).view(tokens, HEADS, HEAD_SIZE)
    value = _distinct_bf16(count, 0x0800 + count).view(tokens, HEADS, HEAD_SIZE)
    kv = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    key_cache, value_cache = kv.view(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))  # token i goes to slots[i]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    by_slot = torch.empty_like(slots)
    by_slot[slots] = torch.arange(tokens)  # the token at each slot

    units = digest.vllm_units([kv], layout="LBHNC", backend="CPU_ATTN")
    assert units.unit_offsets == [0, HEADS]  # layer 0: K heads, then V heads
    sources = layouts.vllm(kv, layout="LBHNC", backend="CPU_ATTN")
    for unit_view, source, written in zip(units.views, sources, (key, value), strict=True):
        assert torch.equal(source.as_view(), unit_view)
        for block in range(BLOCKS):
            block_tokens = by_slot[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
            for head in range(HEADS):
                assert torch.equal(_bits(unit_view[block, :, head]), _bits(written[block_tokens, head]))


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


# MLA: the latent of kv_lora_rank 512 and qk_rope_head_dim 64 that vLLM's CPU MLA kernels need.
KV_LORA_RANK, ROPE_DIM = 512, 64


def _write_mla(kv: torch.Tensor, slots: torch.Tensor, backend: str, latent: torch.Tensor, rope: torch.Tensor) -> None:
    """Tokens written by ``backend``'s own cache update (AMX_MLA's kernel, or CPU_MLA's)."""
    if backend == "AMX_MLA":
        from vllm import _custom_ops as ops

        ops.amx_mla_concat_and_cache(latent, rope, kv, slots)
    else:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        impl = object.__new__(CPUMLAImpl)
        CPUMLAImpl.do_kv_cache_update(impl, latent, rope.unsqueeze(1), kv, slots, "auto", torch.tensor(1.0))


def _mla_backends() -> list[str]:
    return ["AMX_MLA", "CPU_MLA"] if torch.cpu._is_amx_tile_supported() else ["CPU_MLA"]


@pytest.mark.parametrize("backend", _mla_backends())
def test_an_mla_slot_is_its_tokens_latent_row(backend):
    """Each token written by vLLM's CPU MLA cache update, its values distinct: the slot's source
    row in `layouts.vllm_mla` holds that token's latent then its rope key, and nothing else."""
    assert backend in layouts.VLLM_MLA_BACKENDS
    tokens = BLOCKS * BLOCK_SIZE // 2  # as many distinct values as bf16 has
    width = KV_LORA_RANK + ROPE_DIM
    values = _distinct_bf16(tokens * width, 0x0800).view(tokens, width)
    kv = torch.zeros(BLOCKS, BLOCK_SIZE, width, dtype=torch.bfloat16)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(2))[:tokens]
    _write_mla(kv, slots, backend, values[:, :KV_LORA_RANK].contiguous(), values[:, KV_LORA_RANK:].contiguous())
    (source,) = layouts.vllm_mla(kv)
    rows = source.as_view()
    assert rows.shape == (BLOCKS, BLOCK_SIZE, 1, width)
    assert rows.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()  # a view, no copy
    for token, slot in enumerate(slots.tolist()):
        assert torch.equal(rows[slot // BLOCK_SIZE, slot % BLOCK_SIZE, 0].view(torch.int16), values[token].view(torch.int16))
    unwritten = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    unwritten[slots] = False
    assert not rows.reshape(BLOCKS * BLOCK_SIZE, width)[unwritten].view(torch.int16).any()


def test_an_mla_layer_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: a vLLM MLA layer is \[num_blocks, block_size, latent\], got shape \(2, 2, 32, 64\)"):
        layouts.vllm_mla(torch.zeros(2, 2, 32, 64))
