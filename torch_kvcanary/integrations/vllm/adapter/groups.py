"""The KV cache groups of a model runner as the plugin watches them (`KvCacheGroup`, its
`AttentionLayer`s), the group kinds it watches and skips, and the slot it never writes
(`NULL_SLOT`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionLayer:
    name: str
    kv_cache: torch.Tensor  # the tensor vLLM binds to the layer
    backend: str  # its attention backend's get_name()
    drafter: bool = False  # a layer of the speculative drafter, not of the served model


NULL_SLOT = 0
"""A slot no token is ever written to: vLLM's block pool keeps block 0 as its null block,
which block tables show in place of the blocks a window has freed, and never hands out."""

# The KV cache groups the plugin watches, by their spec's class (vllm/v1/kv_cache_interface.py),
# and those it skips: Mamba groups hold a state per request, not a slot per token.
WATCHED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")
SKIPPED_SPECS = ("MambaSpec",)


@dataclass(frozen=True)
class KvCacheGroup:
    """One watched KV cache group of a runner: its index in vLLM's ``kv_cache_groups``, its
    kind (spec class name), its attention layers in layer order, its block size (kernel
    blocks: slot = block * block_size + offset in the layers' tensors), the block table
    attention reads on the runner's device (int32 ``[>= rows, max_blocks]``, row ``i`` for
    input-batch row ``i``), Model Runner V1's block table object of the group (None under
    V2), the window of a sliding-window or chunked-local group, and its slot mapping (the
    runner's buffer, refilled each step: token ``t``'s slot, int64 ``[>= tokens]``)."""

    index: int
    kind: str
    layers: list[AttentionLayer]
    block_size: int
    device_block_table: torch.Tensor
    block_table: object = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    slot_mapping: torch.Tensor | None = None

    def first_attended(self, num_computed: np.ndarray) -> np.ndarray:
        """Per row, the first position the forward's tokens attend to, with ``num_computed``
        tokens in the cache; vLLM frees the blocks wholly below it, and may reuse them.
        These are vLLM's ``get_num_skipped_tokens`` of SlidingWindowManager (without the
        trailing tokens it retains for spec decoding, which it does not attend to) and of
        ChunkedLocalAttentionManager; 0 for full attention."""
        if self.sliding_window is not None:
            return np.maximum(num_computed - self.sliding_window + 1, 0)
        if self.attention_chunk_size is not None:
            return num_computed // self.attention_chunk_size * self.attention_chunk_size
        return np.zeros_like(num_computed)

    def row_blocks(self, row: int) -> np.ndarray:
        """The blocks of input-batch row ``row`` in the group's block table, in order (V1)."""
        table = self.block_table
        return table.block_table.np[row, : table.num_blocks_per_row[row]]

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The slot (block * block_size + offset) of each (input-batch row, position) in the
        group's device block table; -1 where the position is negative (before a request's first token)."""
        at = positions.clamp(min=0)
        blocks = self.device_block_table[rows, at // self.block_size].to(torch.int64)
        return torch.where(positions >= 0, blocks * self.block_size + at % self.block_size, -1)
