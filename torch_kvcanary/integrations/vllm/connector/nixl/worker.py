"""The worker half of the NIXL transport (`NixlWorker`): P's snapshots and their server, D's
fetches and comparisons."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .....canary import FOLD
from ... import adapter
from ...config import CONNECTOR
from ..delegate import inner_config
from ..port import CanaryPort
from .channel import RecordsClient, RecordsServer, Snapshot
from .config import RECORDS_KEY, RECORDS_PORT
from .orders import LoadOrder, NixlOrders, slots_of
from .sharding import Sharding

logger = logging.getLogger(adapter.LOGGER)


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

    def after_save(self, port: CanaryPort, orders: NixlOrders | None) -> None:
        """P: holds the records and head digests of each request whose prompt the step
        completed (after its forward)."""
        for order in orders.snapshots if orders is not None else ():
            slots = slots_of(order.block_ids, order.tokens, self.block_size)
            digests = port.head_digests(slots, self.heads, self.sharding.num_kv_heads, start=0)
            self.server.hold(order.request_id, Snapshot(port.records_of(slots).cpu(), digests, self.heads))
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

    def on_done(self, port: CanaryPort, sent, landed, failed) -> tuple[set[int], int, int]:
        """P: drops the snapshots of the requests whose blocks NIXL sent (or whose lease
        expired: their blocks are freed). D: verifies the requests whose blocks landed
        (`land`), before vLLM marks their load done."""
        if sent:
            self.server.release(sent)
        return self.land(port, landed, failed) if landed else (set(), 0, 0)

    def after_load(self, port: CanaryPort, *, failed: bool = False) -> tuple[int, int]:
        """Nothing yet: the blocks land later (`on_done`)."""
        return 0, 0

    def before_load(self, port: CanaryPort, orders: NixlOrders | None) -> None:
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

    def land(self, port: CanaryPort, finished_recving, failed_recving) -> tuple[set[int], int, int]:
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
            bad_slots = self._verify(port, pending)
            self.verified_requests += 1
            verified += pending.load.end - pending.load.start
            failed += len(bad_slots)
            errors |= set((bad_slots // self.block_size).tolist())
        self.verify_seconds += time.perf_counter() - begin
        return errors, verified, failed

    def _verify(self, port: CanaryPort, pending: PendingLoad) -> torch.Tensor:
        load = pending.load
        slots = slots_of(load.block_ids, load.end, self.block_size)
        landed_slots = slots[load.start : load.end]
        prev = int(slots[load.start - 1]) if load.start else -1
        tokens = torch.tensor(load.tokens[load.start : load.end], dtype=torch.int64)
        landed = port.record_landed(landed_slots, tokens, start=load.start, prev_slot=prev).cpu()
        port.refold_blocks(landed_slots)  # NIXL wrote whole blocks
        bad = self._differs(port, pending, slots, landed)
        bad_slots = landed_slots[bad]
        if len(bad_slots):
            port.break_records(bad_slots)
            if pending.snapshots is not None:
                logger.warning(
                    "kv-canary: request %s: %d of the %d slots NIXL loaded differ from the prefill side's records "
                    "(first at position %d); their blocks are load errors",
                    load.request_id, len(bad_slots), len(landed_slots), load.start + int(bad.nonzero()[0]),
                )  # fmt: skip
        return bad_slots

    def _differs(self, port: CanaryPort, pending: PendingLoad, slots: torch.Tensor, landed: torch.Tensor) -> torch.Tensor:
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
        mine = port.head_digests(slots[load.start : load.end], self.heads, self.sharding.num_kv_heads, start=load.start)
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
