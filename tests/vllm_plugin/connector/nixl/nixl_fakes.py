"""What the NIXL transport's tests without a server share: fakes of the vLLM objects its
scheduler half reads (the config, a request's blocks, the KV cache manager) and the load D's
scheduler orders for a request (`ordered_load`)."""

from types import SimpleNamespace

import torch

from torch_kvcanary.integrations.vllm.connector import nixl


def vllm_config(tp: int = 1, extra: dict | None = None, *, heads: int = 8):
    """A server of ``tp`` tensor-parallel ranks of a model with ``heads`` KV heads of 64 in bfloat16."""
    model = SimpleNamespace(use_mla=False, dtype=torch.bfloat16, get_total_num_kv_heads=lambda: heads, get_head_size=lambda: 64)
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, decode_context_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
    )


class Blocks:
    """vLLM's ``KVCacheBlocks`` of a request that hit no local prefix."""

    def __init__(self, block_ids):
        self.block_ids = block_ids
        self.blocks = ([SimpleNamespace(block_hash=None, is_null=False) for _ in block_ids],)

    def get_block_ids(self):
        return (self.block_ids,)


class FakeKvCacheManager:
    """vLLM's KV cache manager as the scheduler half reads it: each request's blocks."""

    def __init__(self, blocks):
        self.blocks = blocks

    def get_block_ids(self, request_id):
        return (self.blocks[request_id],)


def ordered_load(scheduler, params: dict, tokens: list[int], block_ids: list[int], loaded: int) -> nixl.LoadOrder:
    """The load D's ``scheduler`` orders for request 0 with ``params``, its prompt ``tokens``
    in ``block_ids``, ``loaded`` of them read over NIXL."""
    request = SimpleNamespace(
        request_id="request-0", kv_transfer_params=params, prompt_token_ids=tokens, lora_request=None, cache_salt=None
    )
    scheduler.on_alloc(request, Blocks(block_ids), loaded)
    (load,) = scheduler.plan(SimpleNamespace(num_scheduled_tokens={})).loads
    return load
