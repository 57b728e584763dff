"""Verified transfers through vLLM's ``NixlConnector``: prefill/decode disaggregation, the
``NixlConnector`` transport of `verifier.TRANSPORTS` (`NixlScheduler`, `NixlWorker`).

The prefill side (P) computes a request's prompt and hands its blocks to the decode side
(D), which reads them over NIXL. The canary's records are relocation-invariant (token,
position, chain and fold do not depend on the slot), so:

- P, in the step that completes a request's prompt, snapshots what its rank holds of the
  prompt's slots (`NixlWorker.snapshot`, after the forward recorded them): their records
  and each slot's transfer digest over each of the rank's KV heads (`channel.Snapshot`).
  It holds the snapshot until NIXL reports the request's blocks sent or their lease expired
  (`release`): a block freed and reused after the snapshot cannot change what is compared.
  A small TCP server on the loopback (`RecordsServer`) serves the snapshots, one per rank on
  consecutive ports; the address of rank 0's and P's tensor-parallel size ride in the
  request's ``kv_transfer_params`` (`RECORDS_KEY`), since vLLM builds those params before
  the worker's results of the step reach the scheduler.
- D fetches the snapshots of the P ranks holding its heads before NIXL starts reading the
  blocks (`NixlWorker.fetch`), and when NIXL reports the read done (before vLLM marks the
  request's load done) records what landed with the request's prompt tokens and positions
  and compares (`NixlWorker.land`): every block holding a slot whose records differ, or
  whose snapshot is missing (no address, no snapshot, a timeout, another request's
  snapshot), is a load error of that step, which vLLM recomputes (``"recompute"``) or fails
  the request for (``"fail"``); the bad slots' records are broken, so a forward reading them
  first is flagged too.

What is compared depends on how the two sides shard the KV heads (`Sharding`). Where a D
rank holds the heads of one P rank exactly (the same tensor-parallel size on both sides,
or MLA's latent, which every rank holds), the fold of each slot is a fingerprint of the
same bytes on both sides and the whole records compare. Where they split the heads
differently (NIXL's heterogeneous TP: a D rank reads part of a P rank's heads, or parts of
several), the token, position and chain compare, and in place of the fold the digest of
each of the D rank's heads, which `digest.kv_digest` numbers by global head so that a head
digests alike wherever it is held.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .....canary import RECORD_FIELDS
from ... import adapter
from ...config import CONNECTOR
from ..delegate import inner_config
from .channel import RecordsClient, RecordsServer, Snapshot

logger = logging.getLogger(adapter.LOGGER)

CONNECTORS = ("NixlConnector",)
RECORDS_KEY = "kv_canary_records"
"""The key of ``kv_transfer_params`` holding P's records servers, ``{"address": "host:port", "tp_size": n}``:
rank ``r`` of P's ``n`` tensor-parallel ranks serves on ``port + r``."""
RECORDS_PORT = "records_port"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` naming the port of this
server's records server (of its tensor-parallel rank 0; rank ``r`` serves on ``port + r``)."""
PROGRESS_DELAY = "nixl_progress_delay_us"
"""The key of KvCanaryConnector's ``kv_connector_extra_config`` setting the delay of NIXL's progress thread."""
FOLD = RECORD_FIELDS.index("fold")
"""The records' fold column; those before it (token, position, chain) do not depend on the sharding."""


@dataclass(frozen=True)
class Sharding:
    """How a server's ``tp_size`` tensor-parallel ranks hold the model's ``num_kv_heads``
    KV heads, as vLLM shards them: evenly where there are at least as many heads as ranks,
    else each head on ``tp_size // num_kv_heads`` consecutive ranks (MLA's latent is one
    head, on every rank)."""

    tp_size: int
    num_kv_heads: int

    def heads(self, rank: int) -> range:
        """The global heads rank ``rank`` holds."""
        if self.num_kv_heads >= self.tp_size:
            per_rank = self.num_kv_heads // self.tp_size
            return range(rank * per_rank, (rank + 1) * per_rank)
        head = rank // (self.tp_size // self.num_kv_heads)
        return range(head, head + 1)

    def holder(self, head: int) -> int:
        """The first rank holding global head ``head``."""
        if self.num_kv_heads >= self.tp_size:
            return head // (self.num_kv_heads // self.tp_size)
        return head * (self.tp_size // self.num_kv_heads)

    def sources(self, heads: range) -> list[int]:
        """The ranks whose snapshots hold ``heads``: for each head, its first holder."""
        return sorted({self.holder(head) for head in heads})


# The orders the scheduler side hands the workers each step ----------------------------------


@dataclass
class SnapshotOrder:
    """P: a request whose prompt the step completes; its records of positions [0, tokens) are held."""

    request_id: str
    block_ids: list[int]
    tokens: int


@dataclass
class LoadOrder:
    """D: a request whose prompt positions [start, end) NIXL loads into ``block_ids``
    (all of the request's blocks), from P's request ``remote_request_id`` whose records
    P's ``remote_tp_size`` ranks serve from ``address`` on (`RECORDS_KEY`)."""

    request_id: str
    remote_request_id: str | None
    address: str | None
    remote_tp_size: int
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class NixlOrders:
    """What the scheduler side orders the workers to do this step: snapshot on P, load on D."""

    snapshots: list[SnapshotOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)


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

    def __init__(self, block_size: int, address: str, tp_size: int):
        self.block_size = block_size
        self.address = address
        self.tp_size = tp_size
        self.kv_cache_manager = None
        self._prefills: dict[str, object] = {}  # P: requests whose prompt is not yet complete
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
        orders = NixlOrders(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._prefills.items()):
            count = scheduled.get(request_id, 0)
            if count and request.num_computed_tokens + count >= request.num_prompt_tokens:
                block_ids = list(self.kv_cache_manager.get_block_ids(request_id)[0])
                orders.snapshots.append(SnapshotOrder(request_id, block_ids, request.num_prompt_tokens))
                del self._prefills[request_id]
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


# Worker side ----------------------------------------------------------------------------


@dataclass
class PendingLoad:
    """D: a load and the snapshots of the P ranks holding this rank's heads, by rank (None: why not)."""

    load: LoadOrder
    remote: Sharding  # the prefill side's
    snapshots: dict[int, Snapshot] | None
    why: str
    same_heads: bool  # this rank holds exactly the heads of its one source rank: the folds compare


class NixlWorker:
    """The worker side of tensor-parallel rank ``rank`` of a server whose ranks hold the
    model's KV heads as ``sharding`` says: P's snapshots and server (on ``port + rank``),
    D's fetches and verification."""

    LOADS_IN_STEP = False  # NIXL reads the blocks asynchronously: get_finished reports them landed

    def __init__(self, block_size: int, host: str, port: int, max_age_s: float, *, sharding: Sharding, rank: int):
        self.block_size = block_size
        self.sharding = sharding
        self.rank = rank
        self.heads = sharding.heads(rank)
        try:
            self.server = RecordsServer(host, port + rank, max_age_s)
        except OSError as error:
            raise ValueError(
                f"kv-canary: tensor-parallel rank {rank} serves the canary's records on {RECORDS_PORT} + {rank} = "
                f"{port + rank}, and {host}:{port + rank} cannot be listened on ({error}): give each server a {RECORDS_PORT} "
                f"whose {sharding.tp_size} ports from there on are free"
            ) from error
        self.client = RecordsClient()
        self._pending: dict[str, PendingLoad] = {}
        self._said: set[int] = set()  # the prefill tensor-parallel sizes `_say_comparison` logged
        self.verify_seconds = 0.0  # D: spent recording and comparing landed requests
        self.fetch_seconds = 0.0  # D: spent fetching P's records
        self.verified_requests = 0
        self._handed_over = 0  # P: slots snapshotted since `take_counts`

    @classmethod
    def build(cls, vllm_config, inner, block_size: int) -> NixlWorker:
        """The worker half of this tensor-parallel rank: P's snapshots are held for twice
        NixlConnector's lease (``kv_lease_duration``)."""
        lease_s = adapter.nixl.lease_seconds(inner_config(vllm_config).kv_transfer_config)
        port = vllm_config.kv_transfer_config.kv_connector_extra_config[RECORDS_PORT]
        sharding = Sharding(vllm_config.parallel_config.tensor_parallel_size, adapter.total_kv_heads(vllm_config))
        host = adapter.nixl.side_channel_host()
        return cls(block_size, host, port, max_age_s=2 * lease_s, sharding=sharding, rank=adapter.tensor_parallel_rank())

    def after_save(self, canary, orders: NixlOrders | None) -> None:
        """P: holds the records and head digests of each request whose prompt the step
        completed (after its forward)."""
        for order in orders.snapshots if orders is not None else ():
            slots = slots_of(order.block_ids, order.tokens, self.block_size)
            digests = canary.head_digests(slots, self.heads, self.sharding.num_kv_heads, start=0)
            self.server.hold(order.request_id, Snapshot(canary.records(slots).cpu(), digests, self.heads))
            self._handed_over += order.tokens

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

    def on_done(self, canary, sent, landed, failed) -> tuple[set[int], int, int]:
        """P: drops the snapshots of the requests whose blocks NIXL sent (or whose lease
        expired: their blocks are freed). D: verifies the requests whose blocks landed
        (`land`), before vLLM marks their load done."""
        if sent:
            self.server.release(sent)
        return self.land(canary, landed, failed) if landed else (set(), 0, 0)

    def after_load(self, canary, *, failed: bool = False) -> tuple[int, int]:
        """Nothing yet: the blocks land later (`on_done`)."""
        return 0, 0

    def before_load(self, canary, orders: NixlOrders | None) -> None:
        """D: the snapshots of each load held by the P ranks holding this rank's heads,
        before NIXL starts reading its blocks: P holds them until it learns the blocks were
        read, so a question sent later could find them gone. One round trip per prefill
        rank and step."""
        if orders is None:
            return
        begin = time.perf_counter()
        questions, asked = [], []
        for load in orders.loads:
            remote = Sharding(load.remote_tp_size, self.sharding.num_kv_heads)
            sources = remote.sources(self.heads)
            pending = PendingLoad(load, remote, {}, "", same_heads=len(sources) == 1 and remote.heads(sources[0]) == self.heads)
            self._say_comparison(remote, sources, pending.same_heads)
            self._pending[load.request_id] = pending
            if load.address is None or load.remote_request_id is None:
                pending.snapshots = None
                pending.why = f"its kv_transfer_params carry no {RECORDS_KEY} (the prefill side runs no {CONNECTOR})"
                continue
            host, _, port = load.address.rpartition(":")
            for rank in sources:
                questions.append((f"{host}:{int(port) + rank}", load.remote_request_id))
                asked.append((pending, rank))
        for (pending, rank), (snapshot, why) in zip(asked, self.client.fetch(questions)):
            if snapshot is None:
                pending.snapshots, pending.why = None, pending.why or why
            elif pending.snapshots is not None:
                pending.snapshots[rank] = snapshot
        self.fetch_seconds += time.perf_counter() - begin

    def _say_comparison(self, remote: Sharding, sources: list[int], same_heads: bool) -> None:
        """Logs, once per prefill tensor-parallel size, what this rank compares with which prefill ranks."""
        if remote.tp_size in self._said:
            return
        self._said.add(remote.tp_size)
        heads = f"heads {self.heads.start}-{self.heads.stop - 1} of {self.sharding.num_kv_heads}"
        compared = "each slot's records" if same_heads else "each slot's token, position and chain, and its digest of each head,"
        logger.info(
            "kv-canary: this rank (%s) compares %s with prefill ranks %s of a prefill side of %d tensor-parallel ranks",
            heads, compared, sources, remote.tp_size,
        )  # fmt: skip

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

    def _verify(self, canary, pending: PendingLoad) -> torch.Tensor:
        load = pending.load
        slots = slots_of(load.block_ids, load.end, self.block_size)
        landed_slots = slots[load.start : load.end]
        prev = int(slots[load.start - 1]) if load.start else -1
        tokens = torch.tensor(load.tokens[load.start : load.end], dtype=torch.int64)
        landed = canary.record_loaded(landed_slots, tokens, start=load.start, prev_slot=prev).cpu()
        canary.refold_blocks(landed_slots)  # NIXL wrote whole blocks
        bad = self._differs(canary, pending, slots, landed)
        bad_slots = landed_slots[bad]
        if len(bad_slots):
            canary.invalidate(bad_slots)
            if pending.snapshots is not None:
                logger.warning(
                    "kv-canary: request %s: %d of the %d slots NIXL loaded differ from the prefill side's records "
                    "(first at position %d); their blocks are load errors",
                    load.request_id, len(bad_slots), len(landed_slots), load.start + int(bad.nonzero()[0]),
                )  # fmt: skip
        return bad_slots

    def _differs(self, canary, pending: PendingLoad, slots: torch.Tensor, landed: torch.Tensor) -> torch.Tensor:
        """Which landed slots differ from P's snapshots (all of them where there are none):
        the whole records where the heads are sharded alike, else the token, position and
        chain, and the digest of each of this rank's heads."""
        load, remote = pending.load, pending.remote
        if pending.snapshots is not None:
            pending.why = self._unusable(pending.snapshots, remote, load.end)
            if pending.why:
                pending.snapshots = None
        if pending.snapshots is None:
            logger.warning("kv-canary: request %s: no records of its prefilled KV to compare with: %s", load.request_id, pending.why)
            return torch.ones(len(landed), dtype=torch.bool)
        theirs = pending.snapshots[min(pending.snapshots)].records[load.start : load.end]
        if pending.same_heads:
            return (landed != theirs).any(dim=1)
        bad = (landed[:, :FOLD] != theirs[:, :FOLD]).any(dim=1)
        mine = canary.head_digests(slots[load.start : load.end], self.heads, self.sharding.num_kv_heads, start=load.start)
        for index, head in enumerate(self.heads):
            held = pending.snapshots[remote.holder(head)]
            bad |= mine[:, index] != held.digest_of(head)[load.start : load.end]
        return bad

    def _unusable(self, snapshots: dict[int, Snapshot], remote: Sharding, end: int) -> str:
        """Why P's snapshots cannot be compared with a load of positions [0, end) (empty: they can)."""
        for rank, snapshot in sorted(snapshots.items()):
            if len(snapshot.records) < end:
                return f"the prefill side's records cover {len(snapshot.records)} positions, not {end}"
            if snapshot.heads != remote.heads(rank):
                return (
                    f"prefill rank {rank} holds KV heads {list(snapshot.heads)}, not the {list(remote.heads(rank))} of "
                    f"{remote.num_kv_heads} heads over {remote.tp_size} ranks (do both sides serve one model?)"
                )
        return ""

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


def prepare_worker(vllm_config) -> None:
    """Before NixlConnector's worker is built (and with it NIXL's agent): slows NIXL's
    progress thread where KvCanaryConnector's config asks to (`PROGRESS_DELAY`)."""
    delay = vllm_config.kv_transfer_config.kv_connector_extra_config.get(PROGRESS_DELAY)
    if delay is not None:
        adapter.nixl.delay_progress_thread(int(delay))


def check_nixl(vllm_config) -> None:
    """Refuses what the NIXL verification cannot watch: several pipeline-parallel stages
    (a stage holds some layers, and the snapshots are the whole model's per rank) or
    decode-context-parallel ranks (a rank holds some of a request's positions), and no
    records port."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    parallel = vllm_config.parallel_config
    stages, dcp = parallel.pipeline_parallel_size, getattr(parallel, "decode_context_parallel_size", 1)
    if stages != 1 or dcp != 1:
        raise ValueError(
            f"kv-canary: {CONNECTOR} verifies NixlConnector's transfers with one pipeline stage and one decode-context-parallel "
            f"rank per side (this server has pipeline_parallel_size={stages}, decode_context_parallel_size={dcp}): serve "
            f"each side without them (tensor parallelism is verified), or NixlConnector without {CONNECTOR}"
        )
    if not isinstance(extra.get(RECORDS_PORT), int):
        raise ValueError(
            f"kv-canary: {CONNECTOR} wrapping NixlConnector serves the canary's records of the KV it hands over on ports "
            f'of its own: set "{RECORDS_PORT}": PORT in its kv_connector_extra_config (tensor-parallel rank r serves on '
            "PORT + r: ports free for each rank, a range per server)"
        )
