"""The scheduler half of the NIXL transport (`NixlScheduler`)."""

from __future__ import annotations

from ... import adapter
from .config import RECORDS_KEY
from .orders import HandOverOrder, LoadOrder, NixlOrders


class NixlScheduler:
    """The scheduler side: which requests P writes the records of and D verifies, and P's
    tensor-parallel size in the params it hands over. ``kv_cache_manager`` is the
    scheduler's, which vLLM binds to the connector once it has built both."""

    def __init__(self, block_size: int, tp_size: int):
        self.block_size = block_size
        self.tp_size = tp_size
        self.kv_cache_manager = None
        self._prefills: dict[str, object] = {}  # P: requests it hands over to a decode side, until they finish
        self._loads: list[LoadOrder] = []

    @classmethod
    def build(cls, vllm_config, block_size: int) -> NixlScheduler:
        return cls(block_size, vllm_config.parallel_config.tensor_parallel_size)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager

    def on_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Called before NixlConnector's ``update_state_after_alloc`` (which clears
        ``do_remote_prefill``)."""
        params = request.kv_transfer_params or {}
        if adapter.nixl.hands_over(params):
            self._prefills[request.request_id] = request
        elif adapter.nixl.loads_remotely(params) and num_external_tokens > 0:
            start = adapter.locally_cached_blocks(blocks) * self.block_size
            end = start + num_external_tokens
            self._loads.append(
                LoadOrder(
                    request.request_id, _prefill_tp_size(params.get(RECORDS_KEY)),
                    list(request.prompt_token_ids[:end]), list(blocks.get_block_ids()[0]), start, end,
                )
            )  # fmt: skip

    def plan(self, scheduler_output) -> NixlOrders:
        """The step's orders: D's loads allocated since the last step, and the records to
        write of each request of P whose prompt the step completes. A request stays watched
        until it finishes: where P's own canary flags a block in that step, vLLM rolls the
        request back and recomputes it, and the step that completes the prompt again writes
        the records of the recomputed KV over those of the KV P threw away."""
        orders = NixlOrders(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in self._prefills.items():
            computed, count = request.num_computed_tokens, scheduled.get(request_id, 0)
            if computed < request.num_prompt_tokens <= computed + count:
                block_ids = list(self.kv_cache_manager.get_block_ids(request_id)[0])
                orders.handovers.append(HandOverOrder(request_id, block_ids, request.num_prompt_tokens))
        return orders

    def on_finished(self, request, params: dict | None) -> None:
        """Says, in the params of a request handed to a decode side, that its blocks carry the
        canary's records, and how many tensor-parallel ranks P splits the heads over."""
        self._prefills.pop(request.request_id, None)
        if params is not None and adapter.nixl.loads_remotely(params):
            params[RECORDS_KEY] = {"tp_size": self.tp_size}


def _prefill_tp_size(value) -> int | None:
    """P's tensor-parallel size of a `RECORDS_KEY` value; None for anything else, whose
    load then has no records to compare with."""
    if isinstance(value, dict) and isinstance(value.get("tp_size"), int) and value["tp_size"] > 0:
        return value["tp_size"]
    return None
