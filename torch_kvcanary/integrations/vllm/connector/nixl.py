"""Verified transfers through vLLM's ``NixlConnector``: prefill/decode disaggregation.

The prefill side (P) computes a request's prompt and hands its blocks to the decode side
(D), which reads them over NIXL. The canary's records are relocation-invariant (token,
position, chain and fold do not depend on the slot), so:

- P, in the step that completes a request's prompt, snapshots the records of the prompt's
  slots (`NixlWorker.snapshot`, after the forward recorded them) and holds the snapshot
  until NIXL reports the request's blocks sent or their lease expired (`release`): a block
  freed and reused after the snapshot cannot change what is compared. A small TCP server
  on the loopback (`RecordsServer`) serves the snapshots; its address rides in the
  request's ``kv_transfer_params`` (`RECORDS_KEY`), since vLLM builds those params before
  the worker's results of the step reach the scheduler.
- D fetches P's snapshot before NIXL starts reading the blocks (`NixlWorker.fetch`), and
  when NIXL reports the read done (before vLLM marks the request's load done) records what
  landed with the request's prompt tokens and positions and compares (`NixlWorker.land`):
  every block holding a slot whose token, position, chain or fold differs, or whose
  records are missing (no address, no snapshot, a timeout, another request's snapshot), is
  a load error of that step, which vLLM recomputes (``"recompute"``) or fails the request
  for (``"fail"``); the bad slots' records are broken, so a forward reading them first is
  flagged too.

Both sides compare slots written with the same layout (one tensor-parallel rank each): the
fold of a slot is a rank's bytes, so a prefill and a decode side sharded differently would
compare folds of different bytes (`check_nixl`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .. import adapter
from ..config import CONNECTOR
from .records_channel import RecordsClient, RecordsServer

logger = logging.getLogger(adapter.LOGGER)

CONNECTORS = ("NixlConnector",)
RECORDS_KEY = "kv_canary_records"
"""The key of ``kv_transfer_params`` holding P's records server, ``"host:port"``."""
RECORDS_PORT = "records_port"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` naming the port of this server's records server."""
PROGRESS_DELAY = "nixl_progress_delay_us"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` setting the delay of NIXL's progress thread."""
NIXL_LEASE_S = 30
"""NixlConnector's default ``kv_lease_duration``: how long P holds a request's blocks for D."""


# The plan the scheduler side hands the workers each step ------------------------------------


@dataclass
class Snapshot:
    """P: a request whose prompt the step completes; its records of positions [0, tokens) are held."""

    request_id: str
    block_ids: list[int]
    tokens: int


@dataclass
class Load:
    """D: a request whose prompt positions [start, end) NIXL loads into ``block_ids``
    (all of the request's blocks), from P's request ``remote_request_id`` whose records
    P's server at ``address`` holds."""

    request_id: str
    remote_request_id: str | None
    address: str | None
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class NixlPlan:
    snapshots: list[Snapshot] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)


def slots_of(block_ids: list[int], count: int, block_size: int) -> torch.Tensor:
    """The slots of a request's first ``count`` positions in its blocks ``block_ids``."""
    positions = torch.arange(count, dtype=torch.int64)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


# Scheduler side -------------------------------------------------------------------------


class NixlScheduler:
    """The scheduler side: which requests P snapshots and D verifies, and P's address in
    the params it hands over. ``kv_cache_manager`` is the scheduler's, which vLLM binds to
    the connector once it has built both."""

    def __init__(self, block_size: int, address: str):
        self.block_size = block_size
        self.address = address
        self.kv_cache_manager = None
        self._prefills: dict[str, object] = {}  # P: requests whose prompt is not yet complete
        self._loads: list[Load] = []

    def before_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Called before NixlConnector's ``update_state_after_alloc`` (which clears
        ``do_remote_prefill``)."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._prefills[request.request_id] = request
        elif params.get("do_remote_prefill") and num_external_tokens > 0:
            first = blocks.blocks[0]
            start = sum(block.block_hash is not None and not block.is_null for block in first) * self.block_size
            end = start + num_external_tokens
            self._loads.append(
                Load(
                    request.request_id, params.get("remote_request_id"), params.get(RECORDS_KEY),
                    list(request.prompt_token_ids[:end]), list(blocks.get_block_ids()[0]), start, end,
                )
            )  # fmt: skip

    def plan(self, scheduler_output) -> NixlPlan:
        plan = NixlPlan(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._prefills.items()):
            count = scheduled.get(request_id, 0)
            if count and request.num_computed_tokens + count >= request.num_prompt_tokens:
                block_ids = list(self.kv_cache_manager.get_block_ids(request_id)[0])
                plan.snapshots.append(Snapshot(request_id, block_ids, request.num_prompt_tokens))
                del self._prefills[request_id]
        return plan

    def finished(self, request, params: dict | None) -> None:
        """Adds P's records server to the params of a request handed to a decode side."""
        self._prefills.pop(request.request_id, None)
        if params is not None and params.get("do_remote_prefill"):
            params[RECORDS_KEY] = self.address


# Worker side ----------------------------------------------------------------------------


@dataclass
class _Pending:
    load: Load
    records: torch.Tensor | None
    why: str


class NixlWorker:
    """The worker side: P's snapshots and server, D's fetches and verification."""

    def __init__(self, block_size: int, host: str, port: int, max_age_s: float):
        self.block_size = block_size
        self.server = RecordsServer(host, port, max_age_s)
        self.client = RecordsClient()
        self._pending: dict[str, _Pending] = {}
        self.verify_seconds = 0.0  # D: spent recording and comparing landed requests
        self.fetch_seconds = 0.0  # D: spent fetching P's records
        self.verified_requests = 0
        self._handed_over = 0  # P: slots snapshotted since `take_counts`

    def snapshot(self, canary, plan: NixlPlan) -> None:
        """P: holds the records of each request whose prompt the step completed (after its forward)."""
        for snap in plan.snapshots:
            records = canary.records(slots_of(snap.block_ids, snap.tokens, self.block_size))
            self.server.hold(snap.request_id, records.cpu())
            self._handed_over += snap.tokens

    def take_counts(self) -> dict[str, int]:
        """P's counters since the last call, by their names in `stats.COUNTS`: the slots
        whose records it snapshotted for a decode side, and the decode sides' requests for
        records it answered with them and without."""
        answers = self.server.take_answers()
        counts = {
            "transfer_slots_handed_over": self._handed_over,
            "transfer_records_served": answers["served"],
            "transfer_records_missing": answers["missing"],
        }
        self._handed_over = 0
        return counts

    def release(self, finished_sending) -> None:
        """P: NIXL sent these requests' blocks, or their lease expired: their blocks are freed."""
        if finished_sending:
            self.server.release(finished_sending)

    def fetch(self, plan: NixlPlan) -> None:
        """D: P's records of each load, before NIXL starts reading its blocks: P holds them
        until it learns the blocks were read, so a question sent later could find them gone.
        One round trip per prefill server and step."""
        begin = time.perf_counter()
        unasked = (None, f"its kv_transfer_params carry no {RECORDS_KEY} (the prefill side runs no {CONNECTOR})")
        asked = [load for load in plan.loads if load.address is not None and load.remote_request_id is not None]
        answers = self.client.fetch([(load.address, load.remote_request_id) for load in asked])
        by_request = {load.request_id: answer for load, answer in zip(asked, answers)}
        for load in plan.loads:
            self._pending[load.request_id] = _Pending(load, *by_request.get(load.request_id, unasked))
        self.fetch_seconds += time.perf_counter() - begin

    def land(self, canary, finished_recving, failed_recving) -> tuple[set[int], int, int]:
        """D: records the slots of each request NIXL finished loading and compares them with
        P's: (the blocks of the bad slots, slots verified, slots that failed). A load NIXL
        itself failed is NIXL's load error and is not recorded."""
        errors: set[int] = set()
        verified = failed = 0
        begin = time.perf_counter()
        for request_id in finished_recving:
            pending = self._pending.pop(request_id, None)
            if pending is None or request_id in (failed_recving or ()):
                continue
            bad_slots = self._verify(canary, pending)
            self.verified_requests += 1
            verified += pending.load.end - pending.load.start
            failed += len(bad_slots)
            errors |= set((bad_slots // self.block_size).tolist())
        self.verify_seconds += time.perf_counter() - begin
        return errors, verified, failed

    def _verify(self, canary, pending: _Pending) -> torch.Tensor:
        load = pending.load
        slots = slots_of(load.block_ids, load.end, self.block_size)
        landed_slots = slots[load.start : load.end]
        prev = int(slots[load.start - 1]) if load.start else -1
        tokens = torch.tensor(load.tokens[load.start : load.end], dtype=torch.int64)
        landed = canary.record_loaded(landed_slots, tokens, start=load.start, prev_slot=prev).cpu()
        canary.refold_blocks(landed_slots)  # NIXL wrote whole blocks
        theirs = pending.records
        if theirs is not None and len(theirs) < load.end:
            theirs, pending.why = None, f"the prefill side's records cover {len(theirs)} positions, not {load.end}"
        if theirs is None:
            bad = torch.ones(len(landed_slots), dtype=torch.bool)
            logger.warning("kv-canary: request %s: no records of its prefilled KV to compare with: %s", load.request_id, pending.why)
        else:
            bad = (landed != theirs[load.start : load.end]).any(dim=1)
        bad_slots = landed_slots[bad]
        if len(bad_slots):
            canary.invalidate(bad_slots)
            if theirs is not None:
                logger.warning(
                    "kv-canary: request %s: %d of the %d slots NIXL loaded differ from the prefill side's records "
                    "(first at position %d); their blocks are load errors",
                    load.request_id, len(bad_slots), len(landed_slots), load.start + int(bad.nonzero()[0]),
                )  # fmt: skip
        return bad_slots

    def close(self) -> None:
        if self.verified_requests:
            logger.info(
                "kv-canary: verified the KV of %d requests landed through NIXL: %.0f us each fetching the prefill side's "
                "records, %.0f us each recording and comparing",
                self.verified_requests, 1e6 * self.fetch_seconds / self.verified_requests,
                1e6 * self.verify_seconds / self.verified_requests,
            )  # fmt: skip
        self.client.close()
        self.server.close()


# NIXL's progress thread -----------------------------------------------------------------


def delay_progress_thread(delay_us: int) -> None:
    """Makes NIXL's agents created from here on in this process wait ``delay_us``
    microseconds between the polls of their progress thread. NIXL's Python layer (1.5)
    sets the delay to 0, so that each agent's progress thread polls UCX without pause and
    takes a core even while idle, which stalls a host with few cores; vLLM exposes no
    setting for it. The agent's config class is replaced by one whose ``pthrDelay`` is at
    least ``delay_us``."""
    import nixl._api as api  # noqa: PLC0415 (NIXL is imported only where it is configured)

    bind = api.nixlBind
    base = getattr(bind.nixlAgentConfig, "kv_canary_base", bind.nixlAgentConfig)

    class AgentConfig(base):
        kv_canary_base = base

        @property
        def pthrDelay(self):  # noqa: N802 (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    bind.nixlAgentConfig = AgentConfig
    logger.info("kv-canary: NIXL's progress thread waits %d us between polls in this process (%s)", delay_us, PROGRESS_DELAY)


def check_nixl(vllm_config, extra: dict) -> None:
    """Refuses what the NIXL verification cannot watch: several tensor-parallel ranks
    (each rank's fold covers its own heads; see the module's docstring), and no records port."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies NixlConnector's transfers with one tensor- and pipeline-parallel rank per "
            f"side only (this server has tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}): serve each side on one rank, or NixlConnector "
            f"without {CONNECTOR}"
        )
    if not isinstance(extra.get(RECORDS_PORT), int):
        raise ValueError(
            f"kv-canary: {CONNECTOR} wrapping NixlConnector serves the canary's records of the KV it hands over on a port "
            f'of its own: set "{RECORDS_PORT}": PORT (a free TCP port, one per server) in its kv_connector_extra_config'
        )
