"""The scheduler half of the NIXL transport (`NixlScheduler`)."""

from __future__ import annotations

from ... import adapter
from ...config import MODES, settings
from ..stats import OFF
from ..verifier import SchedulerVerifier
from .claim import Claims, facts
from .config import RECORDS_KEY, strict_transfers
from .orders import HandOverOrder, LoadOrder, NixlOrders


class NixlScheduler(SchedulerVerifier):
    """The scheduler side: which requests P writes the records of and D verifies, P's claim
    in the params it hands over and D's judgement of the claims it receives (`claim.Claims`).
    ``kv_cache_manager`` is the scheduler's, which vLLM binds to the connector once it has
    built both."""

    def __init__(self, block_size: int, claims: Claims):
        self.block_size = block_size
        self.claims = claims
        self.kv_cache_manager = None
        self._prefills: dict[str, object] = {}  # P: requests it hands over to a decode side, until they finish
        self._written: set[str] = set()  # P: those of them whose records a step was ordered to write
        self._loads: list[LoadOrder] = []

    @classmethod
    def build(cls, vllm_config, block_size: int) -> NixlScheduler:
        plugin = settings()
        own = None if plugin is None else facts(vllm_config, block_size, mode_name(plugin.mode))
        return cls(block_size, Claims(own, strict=strict_transfers(vllm_config)))

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
            remote_tp_size, unverified = self.claims.judge(params)
            self._loads.append(
                LoadOrder(
                    request.request_id, remote_tp_size,
                    list(request.prompt_token_ids[:end]), list(blocks.get_block_ids()[0]), start, end, unverified,
                    identified=request.lora_request is not None or bool(request.cache_salt),
                    unknown_keys=self.claims.unknown_keys(params), unclaimed=self.claims.unclaimed(params),
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
                self._written.add(request_id)
        return orders

    def on_output(self, connector_output) -> None:
        """P: once the workers say a canary has turned itself off, they write no records, and
        this side claims none from then on (`Claims.stop`). The requests that finish in the
        step it turned off in are handed on before vLLM passes the step's output here: those
        few may still carry a claim, which D then finds differs from their rows. D goes on
        judging claims: its workers still watching compare their heads of each load."""
        if canary_off(connector_output):
            self.claims.stop()

    def on_finished(self, request, params: dict | None) -> None:
        """P: claims, in the params of a request handed to a decode side whose records a step
        was ordered to write, that its blocks carry them (`Claims.claim`); no claim while
        this side's canary is off, or for a request whose prompt no step completed."""
        self._prefills.pop(request.request_id, None)
        written = request.request_id in self._written
        self._written.discard(request.request_id)
        if params is None or not adapter.nixl.loads_remotely(params):
            return
        claim = self.claims.claim() if written else None
        if claim is not None:
            params[RECORDS_KEY] = claim
        else:
            params.pop(RECORDS_KEY, None)


def canary_off(connector_output) -> bool:
    """Whether the workers' stats of a step (``kv_connector_stats`` of vLLM's connector
    output) say that a worker's canary has turned itself off (`stats.OFF`)."""
    stats = getattr(connector_output, "kv_connector_stats", None)
    return stats is not None and bool(stats.data.get(OFF))


def mode_name(mode) -> str:
    """``KVCANARY_VLLM_MODE``'s value of the fold mode ``mode``."""
    return next(name for name, value in MODES.items() if value == mode)
