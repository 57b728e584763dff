"""The scheduler half of the NIXL transport (`NixlScheduler`)."""

from __future__ import annotations

from ... import adapter
from .config import RECORDS_KEY, RECORDS_PORT
from .orders import LoadOrder, NixlOrders, SnapshotOrder


class NixlScheduler:
    """The scheduler side: which requests P snapshots and D verifies, and P's address in
    the params it hands over. ``kv_cache_manager`` is the scheduler's, which vLLM binds to
    the connector once it has built both."""

    def __init__(self, block_size: int, address: str, tp_size: int):
        self.block_size = block_size
        self.address = address
        self.tp_size = tp_size
        self.kv_cache_manager = None
        self._prefills: dict[str, object] = {}  # P: requests it hands over to a decode side, until they finish
        self._loads: list[LoadOrder] = []

    @classmethod
    def build(cls, vllm_config, block_size: int) -> NixlScheduler:
        """The scheduler half of a server whose records servers listen on NIXL's side-channel host."""
        port = vllm_config.kv_transfer_config.kv_connector_extra_config[RECORDS_PORT]
        address = f"{adapter.nixl.side_channel_host()}:{port}"
        return cls(block_size, address, vllm_config.parallel_config.tensor_parallel_size)

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
            address, tp_size = _records_servers(params.get(RECORDS_KEY))
            self._loads.append(
                LoadOrder(
                    request.request_id, adapter.nixl.remote_request_id(params), address, tp_size,
                    list(request.prompt_token_ids[:end]), list(blocks.get_block_ids()[0]), start, end,
                )
            )  # fmt: skip

    def plan(self, scheduler_output) -> NixlOrders:
        """The step's orders: D's loads allocated since the last step, and a snapshot of each
        request of P whose prompt the step completes. A request stays watched until it
        finishes: where P's own canary flags a block in that step, vLLM rolls the request
        back and recomputes it, and the step that completes the prompt again snapshots the
        recomputed KV in place of the KV P threw away."""
        orders = NixlOrders(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in self._prefills.items():
            computed, count = request.num_computed_tokens, scheduled.get(request_id, 0)
            if computed < request.num_prompt_tokens <= computed + count:
                block_ids = list(self.kv_cache_manager.get_block_ids(request_id)[0])
                orders.snapshots.append(SnapshotOrder(request_id, block_ids, request.num_prompt_tokens))
        return orders

    def on_finished(self, request, params: dict | None) -> None:
        """Adds P's records servers to the params of a request handed to a decode side."""
        self._prefills.pop(request.request_id, None)
        if params is not None and adapter.nixl.loads_remotely(params):
            params[RECORDS_KEY] = {"address": self.address, "tp_size": self.tp_size}


def _records_servers(value) -> tuple[str | None, int]:
    """(rank 0's address, P's tensor-parallel size) of a `RECORDS_KEY` value; (None, 1)
    for anything else, whose load then has no records to compare with."""
    if isinstance(value, dict) and isinstance(value.get("address"), str) and isinstance(value.get("tp_size"), int):
        if value["tp_size"] > 0:
            return value["address"], value["tp_size"]
    return None, 1
