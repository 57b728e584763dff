"""The worker half of the NIXL transport (`NixlWorker`): P writes the records of the prompts
it hands over into the region NIXL moves with the KV (`region.RecordsRegion`); D compares
what landed with the region's rows that landed with it.

Neither side waits on the device, and each handles all the requests of a call at once: P
the prompts the step completed, D the loads NIXL reported landed together (`landing.LandingBatch`),
with one copy of the host's arrays to the device (`port.to_device`). D's comparison
runs where NIXL reports the blocks landed, and its verdict stays on the device: the records
of the slots that differ are broken there (`RecordPort.break_records` with ``where``), so
the step that first reads them has verify flag them, and its verdict, which the connector
reads in each step anyway, names their blocks as that step's load errors (`on_flagged`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .....records import FOLD
from ... import adapter
from ..port import RecordPort, to_device
from ..stats import FAILED, FAILED_KINDS, UNVERIFIED, UNVERIFIED_REASONS
from ..verifier import WorkerVerifier
from .claim import FirstSeen
from .config import RECORDS_KEY, STRICT, check_nixl, prepare_worker, strict_transfers
from .landing import LandedLoad, LandingBatch, PendingLoad, fault_kind
from .orders import LoadOrder, NixlOrders, slots_of
from .region import DIGEST, FIELDS, LAYER_NAME, RecordsRegion
from .sharding import Sharding

logger = logging.getLogger(adapter.LOGGER)

TIMES_EVERY = 100


class HostTime:
    """The host time one side spends on its requests (D recording and comparing what landed,
    P writing the records it hands over), said in ``line`` (the requests, then the time of
    each in us) at every `TIMES_EVERY` requests and when the worker closes."""

    def __init__(self, line: str):
        self.line, self.seconds, self.requests = line, 0.0, 0

    def add(self, begin: float, requests: int) -> None:
        """``requests`` more, done since ``begin`` (`time.perf_counter`)."""
        self.seconds += time.perf_counter() - begin
        before, self.requests = self.requests, self.requests + requests
        if before // TIMES_EVERY != self.requests // TIMES_EVERY:
            self.say()

    def say(self) -> None:
        if self.requests:
            logger.info(self.line, self.requests, 1e6 * self.seconds / self.requests)


"""Each side logs its host time per request after every this many requests, and at shutdown."""


@dataclass
class HandedOver:
    """P: the prompts a step handed over, until that step's verdict (`NixlWorker.on_flagged`):
    their slots, the index of each slot's prompt, and the records their rows were written
    from (on the device), with each prompt's blocks (on the host)."""

    slots: torch.Tensor
    prompts: torch.Tensor
    records: torch.Tensor
    blocks: list[list[int]]


class NixlWorker(WorkerVerifier):
    """The worker side of tensor-parallel rank ``rank`` of a server whose ranks hold the
    model's KV heads as ``sharding`` says: P's records written into the region NIXL moves
    (`after_save`), D's comparison of what landed (`land`). NIXL reads the blocks
    asynchronously, so D verifies them where NixlConnector reports them landed (`on_done`)."""

    def __init__(self, block_size: int, *, sharding: Sharding, rank: int, inner=None, strict: bool = False):
        self.block_size = block_size
        self.strict = strict  # `config.STRICT`: a load D cannot verify fails rather than being taken unverified
        self.sharding = sharding
        self.rank = rank
        self.heads = sharding.heads(rank)
        self.inner = inner  # NixlConnector, whose worker registers the region (`transfer_caches`)
        self.region: RecordsRegion | None = None
        self._pending: dict[str, PendingLoad] = {}
        self._landed: dict[str, LandedLoad] = {}  # D: loads landed and not yet read, by request id
        self._awaiting: list[PendingLoad] = []  # D: loads landed of requests whose root the worker cannot derive yet
        self._compared_later = 0  # D: slots of such loads compared since `take_counts`
        self._said = FirstSeen("prefill tensor-parallel sizes")  # those `_say_comparison` logged
        self.verify_time = HostTime(
            "kv-canary: verified the KV of %d requests landed through NIXL: %.0f us of host time each recording and comparing"
        )
        self.write_time = HostTime("kv-canary: wrote the records of %d requests handed over through NIXL: %.0f us of host time each")
        self._handed_over = 0  # P: slots written since `take_counts`
        self._handed: HandedOver | None = None  # P: the prompts of the step, until its verdict
        self._unverified = dict.fromkeys(UNVERIFIED_REASONS, 0)  # D: loads judged unverified since `take_counts`, by reason
        self._loaded = self._unknown_keys = 0  # D: loads ordered and their unknown params keys since `take_counts`
        self._unclaimed = 0  # D: loads ordered whose params carried no claim since `take_counts`, compared all the same
        self._failed = dict.fromkeys(FAILED_KINDS, 0)  # D: landed slots a step found bad since `take_counts`, by kind

    @classmethod
    def check(cls, vllm_config) -> None:
        """`config.check_nixl`."""
        check_nixl(vllm_config)

    @classmethod
    def prepare(cls, vllm_config) -> None:
        """`config.prepare_worker`: NIXL's progress thread slowed where KvCanaryConnector's config asks to."""
        prepare_worker(vllm_config)

    @classmethod
    def build(cls, vllm_config, inner, block_size: int) -> NixlWorker:
        sharding = Sharding(vllm_config.parallel_config.tensor_parallel_size, adapter.total_kv_heads(vllm_config))
        rank = adapter.tensor_parallel_rank()
        return cls(block_size, sharding=sharding, rank=rank, inner=inner, strict=strict_transfers(vllm_config))

    def transfer_caches(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The caches NixlConnector registers: the KV and the records region, which it
        moves as one more layer of the request's blocks."""
        num_blocks, heads, kernel_block_size = adapter.nixl.transfer_geometry(self.inner)
        if heads != len(self.heads):
            raise ValueError(
                f"kv-canary: NixlConnector moves {heads} KV heads per block on tensor-parallel rank {self.rank}, and the "
                f"canary expects {len(self.heads)} ({list(self.heads)} of {self.sharding.num_kv_heads}): report this layout"
            )
        device = next(iter(kv_caches.values())).device
        self.region = RecordsRegion(num_blocks, heads, self.block_size, kernel_block_size, device)
        page_bytes = self.region.page_bytes * (self.block_size // kernel_block_size)
        adapter.nixl.add_transfer_layer(self.inner, LAYER_NAME, cell_bytes=8 * len(FIELDS), page_bytes=page_bytes)
        return {**kv_caches, LAYER_NAME: self.region.tensor}

    def after_save(self, port: RecordPort, orders: NixlOrders | None) -> None:
        """P: writes the records and head digests of the requests whose prompts the step
        completed (after its forward) into the region, all of them at once, on the device.
        The step's verdict marks those of a prompt whose step had a violation (`on_flagged`)."""
        if orders is None or not orders.handovers:
            return
        begin = time.perf_counter()
        handovers = orders.handovers
        host_slots = np.concatenate([slots_of(order.block_ids, order.tokens, self.block_size) for order in handovers])
        host_positions = np.concatenate([np.arange(order.tokens) for order in handovers])
        host_prompts = np.repeat(np.arange(len(handovers)), [order.tokens for order in handovers])
        slots, positions, prompts = to_device(port.device, host_slots, host_positions, host_prompts)
        digests = port.head_digests(slots, self.heads, self.sharding.num_kv_heads, positions=positions)
        records = port.records_of(slots)
        self.region.write(slots, records, digests)
        self._handed = HandedOver(slots, prompts, records, [order.block_ids for order in handovers])
        self._handed_over += len(host_slots)
        self.write_time.add(begin, len(handovers))

    def _mark_spoiled(self, port: RecordPort, flagged: set[int]) -> None:
        """P, at the verdict of the step that handed prompts over: marks the rows of each
        prompt whose step had a violation (`RecordsRegion.mark`), so that D finds every slot
        of it bad and fails or recomputes it as its policy says: a prompt with a slot of its
        blocks in ``flagged``, or with records of its slots changed since they were written
        (the misread rule breaks what a request that read through a wrong mapping wrote,
        `CanaryPort.misread_blocks`). The verdict comes after the write (`after_save` runs
        in vLLM's ``wait_for_save``, the verdict in ``get_block_ids_with_load_errors``),
        before the request is handed over (its params leave with the step's output).
        Nothing waits on the device."""
        handed, self._handed = self._handed, None
        flagged_blocks = {slot // self.block_size for slot in flagged}
        host_hit = np.array([not flagged_blocks.isdisjoint(blocks) for blocks in handed.blocks], dtype=np.int64)
        (hit,) = to_device(port.device, host_hit)
        changed = (port.records_of(handed.slots) != handed.records).any(dim=1).to(torch.int64)
        hit = hit.index_add(0, handed.prompts, changed)
        self.region.mark(handed.slots, (hit > 0)[handed.prompts])

    def take_counts(self) -> dict:
        """The counters since the last call, by their names in `stats`: P's prompt slots whose
        records it wrote for a decode side, D's landed slots that failed by kind (`on_flagged`),
        and D's loads, those it could not verify by reason, those whose params carried no claim,
        and their unknown params keys (counted by rank 0 alone: vLLM sums the ranks' counters,
        and each rank sees each load)."""
        counts = {"transfer_slots_handed_over": self._handed_over, FAILED: self._failed, UNVERIFIED: self._unverified}
        counts |= {"transfers_loaded": self._loaded, "transfer_params_unknown_keys": self._unknown_keys}
        counts["transfers_unclaimed"] = self._unclaimed
        self._loaded = self._unknown_keys = self._unclaimed = 0
        counts["transfer_slots_verified"] = self._compared_later  # loads compared in `before_forward`, past `on_done`
        self._handed_over = self._compared_later = 0
        self._failed = dict.fromkeys(FAILED_KINDS, 0)
        self._unverified = dict.fromkeys(UNVERIFIED_REASONS, 0)
        return counts

    def on_done(self, port: RecordPort, sent, landed, failed) -> tuple[int, int]:
        """D: compares the requests whose blocks landed (`land`), before vLLM marks their
        load done; the slots that failed are counted where a step reads them (`on_flagged`).
        (P: nothing; the records live as long as the blocks.)"""
        return (self.land(port, landed, failed) if landed else 0), 0

    def before_forward(self, port: RecordPort) -> None:
        """D: compares the loads that landed awaiting their request's root (`land`) whose
        request the runner now holds: a step that reads them starts, and its forward comes next."""
        if self._awaiting:
            self._land_awaiting(port)

    def before_load(self, port: RecordPort, orders: NixlOrders | None) -> None:
        """D: notes each load NIXL starts reading, with how the prefill side holds its heads.
        A load whose params carry no claim (`LoadOrder.unclaimed`) is compared by token,
        position, chain and head digests (``same_heads`` false), which depend neither on P's
        fold mode nor on its tensor-parallel size: neither is known but from the claim."""
        if orders is None:
            return
        if self.rank == 0:
            self._loaded += len(orders.loads)
            self._unknown_keys += sum(load.unknown_keys for load in orders.loads)
            self._unclaimed += sum(load.unclaimed for load in orders.loads)
        for load in orders.loads:
            if load.remote_tp_size is None:
                self._pending[load.request_id] = self._unverifiable(load)
                continue
            remote = Sharding(load.remote_tp_size, self.sharding.num_kv_heads)
            if load.unclaimed:
                self._pending[load.request_id] = PendingLoad(load, remote, "", same_heads=False)
                continue
            sources = remote.sources(self.heads)
            same_heads = len(sources) == 1 and remote.heads(sources[0]) == self.heads
            self._say_comparison(remote, sources, same_heads)
            self._pending[load.request_id] = PendingLoad(load, remote, "", same_heads)

    def land_unwatched(self, orders: NixlOrders | None) -> None:
        """D, on a rank whose canary has turned itself off: the loads NIXL starts reading land
        without this rank's comparison, while the ranks still watching compare their heads of
        them; each is counted unverified (``canary_off``) by this rank, and none fails for it."""
        if orders is not None:
            self._unverified["canary_off"] += len(orders.loads)

    def _unverifiable(self, load: LoadOrder) -> PendingLoad:
        """A load without records of P's to compare with: taken unverified where the scheduler
        judged why (`claim.Claims`), unless `strict`; counted by reason."""
        if load.unverified is None:
            why = f"this side's scheduler judged no claim of {RECORDS_KEY} for it (its canary off there, on in this worker)"
            return PendingLoad(load, None, why, same_heads=False)
        if self.rank == 0:
            self._unverified[load.unverified] += 1
        why = f"P's claim of records cannot be compared with ({load.unverified}) and {STRICT} is true"
        return PendingLoad(load, None, why, same_heads=False, trusted=not self.strict)

    def _say_comparison(self, remote: Sharding, sources: list[int], same_heads: bool) -> None:
        """Logs, once per prefill tensor-parallel size, what this rank compares with which prefill ranks."""
        if not self._said.first(remote.tp_size):
            return
        heads = f"heads {self.heads.start}-{self.heads.stop - 1} of {self.sharding.num_kv_heads}"
        compared = "each slot's records" if same_heads else "each slot's token, position and chain, and its digest of each head,"
        logger.info(
            "kv-canary: this rank (%s) compares %s with prefill ranks %s of a prefill side of %d tensor-parallel ranks",
            heads, compared, sources, remote.tp_size,
        )  # fmt: skip

    def land(self, port: RecordPort, finished_recving, failed_recving) -> int:
        """D: records the slots of the requests NIXL finished loading, compares them with the
        rows of P's records that landed with them and breaks the records of those that
        differ, all of them at once and on the device; returns how many slots it compared.
        A load NIXL itself failed is NIXL's load error and is not recorded. A load of a
        request with an identity (`LoadOrder.identified`) waits for its root, compared in
        the `before_forward` of the request's first step (counted in `take_counts`)."""
        failed = set(failed_recving or ())
        landing = [self._pending.pop(request_id) for request_id in finished_recving if request_id in self._pending]
        landing = [pending for pending in landing if pending.load.request_id not in failed]
        # A request with an identity is compared under its own root, which the worker derives
        # from the request once the runner holds it: from its first step on (`before_forward`).
        self._awaiting += [pending for pending in landing if pending.load.identified]
        return self._land(port, [pending for pending in landing if not pending.load.identified])

    def _land_awaiting(self, port: RecordPort) -> None:
        """Compares, under their requests' roots, the awaiting loads whose request the runner holds."""
        roots = [port.request_root(pending.load.request_id) for pending in self._awaiting]
        ready = [(pending, root) for pending, root in zip(self._awaiting, roots) if root is not None]
        self._awaiting = [pending for pending, root in zip(self._awaiting, roots) if root is None]
        if ready:
            self._compared_later += self._land(port, [pending for pending, _ in ready], [root for _, root in ready])

    def _land(self, port: RecordPort, landing: list[PendingLoad], roots: list[int] | None = None) -> int:
        """`land` of the loads ``landing``, each of a request whose chain starts at its root
        in ``roots`` (the anchor where not given): how many slots it compared."""
        if not landing:
            return 0
        begin = time.perf_counter()
        for pending in landing:
            if pending.remote is None and not pending.trusted:
                logger.warning(
                    "kv-canary: request %s: no records of its prefilled KV to compare with: %s", pending.load.request_id, pending.why
                )
        batch = LandingBatch(landing, self.block_size, roots)
        self._verify(port, batch)
        for pending, slots in zip(landing, batch.request_slots):
            load = pending.load
            self._landed[load.request_id] = LandedLoad(slots, load.tokens, load.start, pending.remote is not None)
        self.verify_time.add(begin, len(landing))
        return int(batch.compared.sum())  # a load taken unverified is landed and recorded, not compared

    def _verify(self, port: RecordPort, batch: LandingBatch) -> None:
        """Records the batch's slots, compares them with the rows that landed with them and
        breaks the records of those that differ: one copy to the device, no wait on it."""
        host_unrecorded = batch.unrecorded_block_slots() if port.blocks_packed else np.empty(0, dtype=np.int64)
        rooted = batch.roots is not None
        slots, tokens, positions, prev_slots, whole_records, compared, no_records, digest_rows, unrecorded, *roots = to_device(
            port.device, batch.slots, batch.tokens, batch.positions, batch.prev_slots,
            batch.whole_records, batch.compared, batch.no_records, batch.digest_rows, host_unrecorded, *([batch.roots] if rooted else []),
        )  # fmt: skip
        if len(host_unrecorded):
            port.refold(unrecorded)  # NIXL wrote whole blocks, these slots' bytes too
        landed = port.record_landed(slots, tokens=tokens, positions=positions, prev_slots=prev_slots, roots=roots[0] if rooted else None)
        theirs = self.region.read(slots)  # [n, heads, FIELDS]
        bad = (landed[:, :FOLD] != theirs[:, 0, :FOLD]).any(dim=1)
        bad |= (landed[:, FOLD] != theirs[:, 0, FOLD]) & whole_records.bool()
        bad &= compared.bool()  # a load taken unverified has whatever rows its blocks held
        bad |= no_records.bool()
        if len(batch.digest_rows):
            mine = port.head_digests(slots[digest_rows], self.heads, self.sharding.num_kv_heads, positions=positions[digest_rows])
            bad[digest_rows] |= (mine != theirs[digest_rows, :, DIGEST]).any(dim=1)
        port.break_records(slots, where=bad, just_recorded=True)

    def on_flagged(self, port: RecordPort, flagged: set[int]) -> int:
        """D, after each forward: the landed slots the step's verify flagged (``flagged``, the
        step's verdict) among those of the loads it read for the first time, each such load
        logged; those loads are then no longer tracked. Returns how many slots failed, and
        counts them under the kind of their load's first differing slot (`fault_kind`; a load
        without records of P's: ``no_records``). P: marks the rows of the step's prompts
        whose step had a violation (`_mark_spoiled`)."""
        if self._handed is not None:
            self._mark_spoiled(port, flagged)
        failed = 0
        for request_id in port.step_requests():
            landed = self._landed.pop(request_id, None)
            if landed is None or not flagged:
                continue
            bad = np.flatnonzero(np.isin(landed.slots, np.fromiter(flagged, dtype=np.int64, count=len(flagged))))
            failed += len(bad)
            if not len(bad):
                continue
            if not landed.compared:  # a load without records was logged as it landed
                self._failed["no_records"] += len(bad)
                continue
            kind, said = self._first_difference(port, landed, int(bad[0]))
            self._failed[kind] += len(bad)
            logger.warning(
                "kv-canary: request %s: %d of the %d slots NIXL loaded differ from the prefill side's records "
                "at their first read (first at position %d); their blocks are load errors; %s (counted as %s)",
                request_id, len(bad), len(landed.slots), landed.start + int(bad[0]), said, kind,
            )  # fmt: skip
        return failed

    def _first_difference(self, port: RecordPort, landed: LandedLoad, index: int) -> tuple[str, str]:
        """The `fault_kind` of the load's ``index``-th landed slot, and what the request
        expects there and what P's rows that landed there say: a block landed shifted reads as
        another position, another request's KV as another token (read on the host: a
        failure's path alone)."""
        slot = int(landed.slots[index])
        row = self.region.read(torch.tensor([slot]))[0]
        theirs = row[0, :FOLD].tolist()
        token, position = theirs[FIELDS.index("token")], theirs[FIELDS.index("position")]
        offset = position - landed.start  # P's position among the load's slots, where D holds its own record
        slots = [slot, int(landed.slots[offset])] if 0 <= offset < len(landed.slots) else [slot]
        mine = port.records_of(torch.tensor(slots))[:, :FOLD].tolist()
        kind = fault_kind(mine[0], theirs, landed.tokens, mine[1] if len(mine) > 1 else None, first=index == 0)
        if kind == "bytes" and self._marked(port, slot, landed.start + index, row[:, DIGEST]):
            return "unknown", (
                "the prefill side marked its rows of this KV: its own canary flagged the step that computed it "
                "(its log names the violation)"
            )
        if kind == "identity":
            return kind, (
                f"at slot {slot} the request has token {token} at position {position}, as the prefill side's records that "
                "landed say, and their chain is not the request's: its identity differs, the prefill side computed this KV "
                "under another LoRA adapter or cache salt"
            )
        said = (
            f"there the request has token {landed.tokens[landed.start + index]}, and the prefill side's records that landed "
            f"say token {token} at position {position}"
        )
        return kind, said

    def _marked(self, port: RecordPort, slot: int, position: int, digests: torch.Tensor) -> bool:
        """Whether P's row of ``slot`` (holding ``position``), whose head digests that landed
        are ``digests``, is marked (`RecordsRegion.mark`): each differs from this side's
        digest of the head's landed KV in the lowest bit alone."""
        slots, positions = to_device(port.device, np.array([slot]), np.array([position]))
        mine = port.head_digests(slots, self.heads, self.sharding.num_kv_heads, positions=positions)
        return bool(((mine[0] ^ 1) == digests).all())

    def forget(self, request_ids) -> None:
        """D: requests vLLM finished (or aborted) before a step read what landed for them."""
        for request_id in request_ids or ():
            self._landed.pop(request_id, None)
            self._pending.pop(request_id, None)
        if request_ids and self._awaiting:
            self._awaiting = [pending for pending in self._awaiting if pending.load.request_id not in request_ids]

    def close(self) -> None:
        self.verify_time.say()
        self.write_time.say()
