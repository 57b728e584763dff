"""The tests' double of a vLLM model runner: `FakeRunner`, the plugin's view (`adapter.RunnerView`)
of a runner that is not vLLM's, over `StepBuffers`, the persistent buffers a runner holds
(packed layers, one KV cache group's block table, the token history of V1 or V2) and the
rows of each step. The plugin's step code runs on them without vLLM, in the tests and in
the benchmarks (`benchmarks.engine_step`, `benchmarks.pd_transfer`)."""

from __future__ import annotations

import numpy as np
import torch

from torch_kvcanary.integrations.vllm import adapter

BLOCK_SIZE = 16
HEAD_SIZE = 32
NUM_KV_HEADS = 1
BACKEND = "FLASH_ATTN"
LAYOUT = "BLNHC"  # vLLM's NHD order of a packed layer: [num_blocks, block_size, heads, C] in memory


class FakeRunner(adapter.RunnerView):
    """The plugin's view of a model runner that is not vLLM's: the layers, block table and
    token history of `StepBuffers`."""

    def __init__(self, buffers: StepBuffers, backend: str = BACKEND):
        super().__init__(model_runner=buffers)
        self.buffers = buffers
        self.backend = backend
        self.is_v2 = buffers.runner == "v2"

    name = "torch_kvcanary.testing.fake_runner.FakeRunner"
    async_scheduling = False
    token_history_current = True
    token_history_on_host = False
    drafter_writes_seen = False
    kv_cache_layout = LAYOUT
    tensor_parallel_size = 1
    kv_cache_budget = None

    def kv_connector(self):
        return None

    def kv_cache_group_kinds(self) -> list[str]:
        return ["FullAttentionSpec"]

    def drafter_layer_names(self) -> list[str]:
        return []

    def kv_cache_groups(self, *, drafter: bool = False) -> list[adapter.KvCacheGroup]:
        layers = [adapter.AttentionLayer(f"layers.{i}.attn", cache, self.backend) for i, cache in enumerate(self.buffers.caches)]
        return [
            adapter.KvCacheGroup(
                0, "FullAttentionSpec", layers, BLOCK_SIZE, self.buffers.block_table, slot_mapping=self.buffers.slot_mapping
            )
        ]

    def _group_buffers(self, group: int):
        return BLOCK_SIZE, self.buffers.block_table, self.buffers.slot_mapping, None

    def token_history(self, device: torch.device) -> adapter.TokenHistory:
        return adapter.TokenHistory(self.buffers.history, self.buffers.history_known)


class StepBuffers:
    """A runner's persistent buffers for ``requests`` requests of ``context`` tokens each over
    ``layers`` layers: request r owns blocks 1 + r * blocks_per_request onwards (block 0 is
    vLLM's null block), and under V2 its token history row is ``state_rows[r]``. Input-batch
    row i holds request ``order[i]`` (a step may move requests to other rows, as vLLM's
    batch does, their block table and V1 history rows with them)."""

    def __init__(self, runner: str, layers: int, requests: int, context: int, decode_steps: int):
        self.runner = runner
        self.requests, self.context = requests, context
        longest = context + decode_steps + 1
        self.blocks_per_request = -(-longest // BLOCK_SIZE)
        num_blocks = 1 + requests * self.blocks_per_request
        generator = torch.Generator().manual_seed(0)
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE)
        self.caches = [
            torch.randint(-(1 << 15), 1 << 15, shape, generator=generator, dtype=torch.int16).view(torch.float16).permute(0, 2, 1, 3)
            for _ in range(layers)
        ]
        rows = torch.arange(requests)[:, None] * self.blocks_per_request + 1
        self.request_blocks = (rows + torch.arange(self.blocks_per_request)).to(torch.int32)
        self.block_table = self.request_blocks.clone()
        self.tokens = torch.randint(0, 32000, (requests, longest), generator=generator, dtype=torch.int32)
        self.order = torch.arange(requests)
        if runner == "v2":
            self.request_state_rows = torch.randperm(requests, generator=generator)
            self.state_rows = self.request_state_rows.clone()
            self.history = torch.zeros_like(self.tokens)
            self.history[self.state_rows] = self.tokens
            self.history_known = None
        else:
            self.state_rows = None
            self.history = self.tokens.clone()
            self.history_known = torch.zeros(self.tokens.shape, dtype=torch.bool)
        self.computed = np.zeros(requests, dtype=np.int64)  # by request
        self.slot_mapping = torch.zeros(requests * context, dtype=torch.int64)  # refilled in place, as vLLM's

    def block_of(self, request: int, position: int) -> int:
        return int(self.request_blocks[request, position // BLOCK_SIZE])

    def move(self, order: torch.Tensor) -> None:
        """Row i holds request ``order[i]`` from the next step on: the rows of the block table,
        V1's token history and V2's state-row mapping move in place."""
        if self.history_known is not None:
            by_request = torch.empty_like(self.history), torch.empty_like(self.history_known)
            by_request[0][self.order], by_request[1][self.order] = self.history, self.history_known
            self.history[:], self.history_known[:] = by_request[0][order], by_request[1][order]
        else:
            self.state_rows[:] = self.request_state_rows[order]
        self.block_table[:] = self.request_blocks[order]
        self.order = order.clone()

    def step(self, scheduled: int) -> adapter.Step:
        """The next forward: ``scheduled`` tokens of every request after those it has."""
        order = self.order
        request_ids = [f"request-{r}" for r in order.tolist()]
        computed = self.computed[order.numpy()]
        positions = torch.from_numpy((computed[:, None] + np.arange(scheduled)).reshape(-1))
        rows = torch.arange(self.requests).repeat_interleave(scheduled)
        input_ids = self.tokens[order[rows], positions]
        blocks = self.block_table[rows, positions // BLOCK_SIZE].to(torch.int64)
        self.slot_mapping[: len(positions)] = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        if self.history_known is not None:
            self.history_known[rows, positions] = True  # V1 holds a token once it is scheduled
        self.computed += scheduled
        num_scheduled = np.full(self.requests, scheduled, dtype=np.int64)
        return adapter.Step(request_ids, num_scheduled, computed, input_ids, positions, history_rows=self.state_rows)
