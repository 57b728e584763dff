"""``python -m torch_kvcanary demo --transfer``: KV pages moved from a prefill group to a decode
rank, and the transfer digests catching what goes wrong on the way.

Real processes on this machine talk over torch.distributed (gloo): a tensor-parallel
prefill group (TP=2 by default: each rank holds half the KV heads, in vLLM-style blocks
of 4 tokens, fp8 with fp32 scales per token and head) sends each block of each request,
rank by rank, with send/recv, to a decode rank that holds all heads in SGLang-style rows
(one slot per token, other slot numbers). The prefill ranks digest what they send, per
request and per block (chunk), and all_reduce(SUM) the digests over their group; the
decode rank digests what landed in its pool and calls `verify_transfer`. Each scenario
injects one bug on the way: a flipped bit, two positions written to each other's slots,
a page reported sent that never landed (stale bytes), scales that never travelled, and
two top-bit flips in one unit (invisible to a linear checksum). Exits 1 if a bug is not
caught, is pinned to the wrong request or chunk, or the clean transfer is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

FAULTS = (
    "none",
    "one flipped bit",
    "two positions swapped",
    "one page never sent",
    "scales lost",
    "two top-bit flips in one unit",
)


@dataclass(frozen=True)
class TransferConfig:
    layers: int = 2
    kv_heads: int = 4
    head_dim: int = 64  # fp8: 64 bytes per unit
    prefill_tp: int = 2
    block_size: int = 4  # prefill pages (vLLM blocks)
    prefill_blocks: int = 16
    decode_slots: int = 64  # decode rows (SGLang, one slot per token)
    request_lengths: tuple[int, ...] = (13, 7, 10)
    first_positions: tuple[int, ...] = (0, 32, 5)  # requests may continue earlier transfers
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.prefill_tp + 1

    @property
    def decode_rank(self) -> int:
        return self.prefill_tp

    def blocks_of(self, request: int) -> int:
        return -(-self.request_lengths[request] // self.block_size)

    def chunk_of(self, request: int, block: int) -> int:
        """Chunks are the blocks of the requests, numbered in order."""
        return sum(self.blocks_of(r) for r in range(request)) + block

    @property
    def num_chunks(self) -> int:
        return self.chunk_of(len(self.request_lengths), 0)


# Where each bug lands: (request, block of the request) of the chunk it corrupts.
FAULT_CHUNKS = {
    "one flipped bit": (0, 1),
    "two positions swapped": (1, 0),
    "one page never sent": (2, 1),
    "scales lost": (0, 0),
    "two top-bit flips in one unit": (2, 0),
}


@dataclass
class RequestKv:
    """One request's logical KV per layer: K and V [tokens, heads, head_dim] fp8 and their
    scales [tokens, heads] fp32."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor]
    v_scale: list[torch.Tensor]


def make_requests(config: TransferConfig) -> list[RequestKv]:
    """The requests' KV, the same in every process (drawn from config.seed)."""
    gen = torch.Generator().manual_seed(config.seed)

    def fp8(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, config.kv_heads, config.head_dim), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)

    def scales(n: int) -> torch.Tensor:
        return torch.rand(n, config.kv_heads, generator=gen) + 0.5

    return [
        RequestKv([fp8(n) for _ in range(config.layers)], [fp8(n) for _ in range(config.layers)],
                  [scales(n) for _ in range(config.layers)], [scales(n) for _ in range(config.layers)])
        for n in config.request_lengths
    ]  # fmt: skip


def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_block_tables(config: TransferConfig) -> list[list[int]]:
    free = _permutation(config.prefill_blocks, config.seed + 1)
    tables = []
    for r in range(len(config.request_lengths)):
        tables.append(free[: config.blocks_of(r)])
        free = free[config.blocks_of(r) :]
    return tables


def decode_slot_maps(config: TransferConfig) -> list[list[int]]:
    free = _permutation(config.decode_slots, config.seed + 2)
    maps = []
    for n in config.request_lengths:
        maps.append(free[:n])
        free = free[n:]
    return maps


def entries(config: TransferConfig, slots_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, positions, request groups, chunk groups) of every token of every request;
    ``slots_of(request, token)`` is the token's slot in this side's pool."""
    slots, positions, requests, chunks = [], [], [], []
    for r, n in enumerate(config.request_lengths):
        for i in range(n):
            slots.append(slots_of(r, i))
            positions.append(config.first_positions[r] + i)
            requests.append(r)
            chunks.append(config.chunk_of(r, i // config.block_size))
    return tuple(torch.tensor(v) for v in (slots, positions, requests, chunks))


def _digests(units, config: TransferConfig, slots_of) -> torch.Tensor:
    """Per-request digests followed by per-chunk digests, in one int64 tensor."""
    from ..digest import kv_digest

    slots, positions, requests, chunks = entries(config, slots_of)
    by_request = kv_digest(
        units.views, slots, positions, unit_offsets=units.unit_offsets, groups=requests, num_groups=len(config.request_lengths)
    )
    by_chunk = kv_digest(units.views, slots, positions, unit_offsets=units.unit_offsets, groups=chunks, num_groups=config.num_chunks)
    return torch.cat([by_request, by_chunk])


class PrefillRank:
    """A prefill TP rank's cache: per layer vLLM ``[2, blocks, block_size, local_heads, dim]``
    and fp32 scales ``[blocks, block_size, local_heads]`` for K and V."""

    def __init__(self, config: TransferConfig, rank: int, requests: list[RequestKv]):
        self.config, self.rank = config, rank
        local = config.kv_heads // config.prefill_tp
        heads = slice(rank * local, (rank + 1) * local)
        shape = (config.prefill_blocks, config.block_size, local)
        self.kv = [torch.zeros(2, *shape, config.head_dim, dtype=torch.float8_e4m3fn) for _ in range(config.layers)]
        self.scales = [[torch.zeros(shape) for _ in range(config.layers)] for _ in range(2)]
        self.tables = prefill_block_tables(config)
        for r, req in enumerate(requests):
            for i in range(config.request_lengths[r]):
                block, offset = self.tables[r][i // config.block_size], i % config.block_size
                for layer in range(config.layers):
                    self.kv[layer][0, block, offset] = req.k[layer][i, heads]
                    self.kv[layer][1, block, offset] = req.v[layer][i, heads]
                    self.scales[0][layer][block, offset] = req.k_scale[layer][i, heads]
                    self.scales[1][layer][block, offset] = req.v_scale[layer][i, heads]

    def units(self):
        from ..digest import vllm_units

        return vllm_units(self.kv, k_scales=self.scales[0], v_scales=self.scales[1], tp_rank=self.rank, tp_size=self.config.prefill_tp)

    def digests(self) -> torch.Tensor:
        bs = self.config.block_size
        return _digests(self.units(), self.config, lambda r, i: self.tables[r][i // bs] * bs + i % bs)

    def block_payload(self, request: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What goes on the wire for one block: KV bytes [layers, 2, block_size, local_heads,
        dim] and scales [layers, 2, block_size, local_heads]."""
        b = self.tables[request][block]
        kv = torch.stack([layer[:, b] for layer in self.kv]).view(torch.uint8).contiguous()
        scales = torch.stack(
            [torch.stack([self.scales[h][layer][b] for h in range(2)]) for layer in range(self.config.layers)]
        ).contiguous()
        return kv, scales


class DecodeRank:
    """The decode rank's cache: per layer SGLang rows ``[slots, heads, dim]`` for K and V and
    fp32 scales ``[slots, heads]``, all heads (TP=1), starting with stale bytes."""

    def __init__(self, config: TransferConfig):
        self.config = config
        gen = torch.Generator().manual_seed(config.seed + 3)
        shape = (config.decode_slots, config.kv_heads)

        def stale_rows() -> torch.Tensor:
            return torch.randint(0, 256, (*shape, config.head_dim), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)

        self.k = [stale_rows() for _ in range(config.layers)]
        self.v = [stale_rows() for _ in range(config.layers)]
        self.k_scale = [torch.rand(shape, generator=gen) for _ in range(config.layers)]
        self.v_scale = [torch.rand(shape, generator=gen) for _ in range(config.layers)]
        self.slot_maps = decode_slot_maps(config)

    def units(self):
        from ..digest import sglang_mha_units

        return sglang_mha_units(self.k, self.v, k_scales=self.k_scale, v_scales=self.v_scale)

    def digests(self) -> torch.Tensor:
        return _digests(self.units(), self.config, lambda r, i: self.slot_maps[r][i])

    def land(self, request: int, block: int, rank: int, kv: torch.Tensor, scales: torch.Tensor, fault: str) -> None:
        """Writes a received block of prefill rank ``rank`` into this pool, with ``fault``'s
        bug where it lands (FAULT_CHUNKS)."""
        config = self.config
        hit = FAULT_CHUNKS.get(fault) == (request, block)
        if hit and fault == "one page never sent" and rank == 0:
            return  # reported done, never written: the rows keep their stale bytes
        kv = kv.clone()
        if hit and fault == "one flipped bit" and rank == config.prefill_tp - 1:
            kv[1, 1, 2, 0, 5] ^= 1 << 3  # layer 1, V, token 2 of the block, local head 0
        if hit and fault == "two top-bit flips in one unit" and rank == 0:
            kv[0, 0, 1, 0, 7] ^= 0x80  # the top bits of words 0 and 1 of one K unit
            kv[0, 0, 1, 0, 15] ^= 0x80
        kv = kv.view(torch.float8_e4m3fn)
        local = config.kv_heads // config.prefill_tp
        heads = slice(rank * local, (rank + 1) * local)
        slot_map = list(self.slot_maps[request])
        if hit and fault == "two positions swapped":
            first = block * config.block_size + 2
            slot_map[first], slot_map[first + 1] = slot_map[first + 1], slot_map[first]
        for j in range(config.block_size):
            token = block * config.block_size + j
            if token >= config.request_lengths[request]:
                break
            slot = slot_map[token]
            for layer in range(config.layers):
                self.k[layer][slot, heads] = kv[layer, 0, j]
                self.v[layer][slot, heads] = kv[layer, 1, j]
                if not (hit and fault == "scales lost"):
                    self.k_scale[layer][slot, heads] = scales[layer, 0, j]
                    self.v_scale[layer][slot, heads] = scales[layer, 1, j]


def _transfer(config: TransferConfig, rank: int, requests: list[RequestKv], prefill_group, fault: str) -> dict | None:
    import torch.distributed as dist

    from ..transfer import verify_transfer

    decode = config.decode_rank
    if rank < config.prefill_tp:
        side = PrefillRank(config, rank, requests)
        for r in range(len(requests)):
            for b in range(config.blocks_of(r)):
                for tensor in side.block_payload(r, b):
                    dist.send(tensor, dst=decode)
        digests = side.digests()
        dist.all_reduce(digests, op=dist.ReduceOp.SUM, group=prefill_group)  # wrapping int64 sums
        if rank == 0:
            dist.send(digests, dst=decode)
        return None
    side = DecodeRank(config)
    local = config.kv_heads // config.prefill_tp
    kv = torch.empty(config.layers, 2, config.block_size, local, config.head_dim, dtype=torch.uint8)
    scales = torch.empty(config.layers, 2, config.block_size, local)
    for r in range(len(requests)):
        for b in range(config.blocks_of(r)):
            for p in range(config.prefill_tp):
                dist.recv(kv, src=p)
                dist.recv(scales, src=p)
                side.land(r, b, p, kv, scales, fault)
    sent = torch.empty(len(requests) + config.num_chunks, dtype=torch.int64)
    dist.recv(sent, src=0)
    received = side.digests()
    n = len(requests)
    check = verify_transfer(sent[:n], received[:n], sent_chunks=sent[n:], received_chunks=received[n:], on_mismatch=None)
    return {"fault": fault, "requests": list(check.requests), "chunks": list(check.chunks), "lines": list(check.lines),
            "sent": sent.tolist(), "received": received.tolist()}  # fmt: skip


def _rank_main(rank: int, config: TransferConfig, init_method: str, out_dir: str, faults: tuple[str, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one process per rank shares the machine's cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=config.world_size, timeout=timedelta(seconds=60))
    try:
        prefill_group = dist.new_group(list(range(config.prefill_tp)))
        requests = make_requests(config)
        results = [_transfer(config, rank, requests, prefill_group, fault) for fault in faults]
        if rank == config.decode_rank:
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_transfers(config: TransferConfig = TransferConfig(), faults: tuple[str, ...] = FAULTS, timeout: float = 120.0) -> list[dict]:
    """Runs every scenario of ``faults`` in ``config.world_size`` processes; the decode rank's
    findings per scenario: the requests and chunks `verify_transfer` flagged, its lines, and
    the digests sent (the prefill group's) and received, per request then per chunk."""
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvcanary-transfer-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        procs = [
            ctx.Process(target=_rank_main, args=(rank, config, init_method, tmp, faults), daemon=True) for rank in range(config.world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        if stuck:
            raise RuntimeError(f"kv-canary: transfer ranks {stuck} did not finish within {timeout:.0f} s")
        failed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"kv-canary: transfer ranks exited with codes {failed} (their tracebacks are above)")
        with open(os.path.join(tmp, "results.json")) as f:
            return json.load(f)


@dataclass
class Verdict:
    fault: str
    caught: bool
    pinned: bool  # flagged exactly the request and chunk the bug hit
    requests: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)


def judge(config: TransferConfig, results: list[dict]) -> list[Verdict]:
    verdicts = []
    for result in results:
        fault = result["fault"]
        caught = bool(result["requests"] or result["chunks"])
        if fault == "none":
            pinned = not caught
        else:
            request, block = FAULT_CHUNKS[fault]
            pinned = result["requests"] == [request] and result["chunks"] == [config.chunk_of(request, block)]
        verdicts.append(Verdict(fault, caught, pinned, result["requests"], result["chunks"]))
    return verdicts


def main(args: argparse.Namespace) -> int:
    config = TransferConfig()
    print(
        f"prefill: {config.prefill_tp} TP ranks, {config.kv_heads // config.prefill_tp} of {config.kv_heads} KV heads each, "
        f"vLLM blocks of {config.block_size} tokens, fp8 K/V with fp32 scales, {config.layers} layers"
    )
    print(f"decode:  1 rank with all heads in SGLang rows (one slot per token); requests of {list(config.request_lengths)} tokens, "
          f"{config.num_chunks} chunks (blocks) in all, sent with torch.distributed (gloo) send/recv")  # fmt: skip
    start = time.perf_counter()
    verdicts = judge(config, run_transfers(config))
    elapsed = time.perf_counter() - start
    ok = True
    for v in verdicts:
        if v.fault == "none":
            status = "clean: digests equal" if v.pinned else f"FALSE ALARM: requests {v.requests} chunks {v.chunks}"
        elif not v.caught:
            status = "NOT CAUGHT"
        else:
            status = f"caught: request {v.requests}, chunk {v.chunks}" + ("" if v.pinned else " (NOT the chunk it hit)")
        ok &= v.pinned
        print(f"  {v.fault:32} {status}")
    print(f"{len(verdicts)} transfers in {elapsed:.1f} s")
    print(
        "every transfer bug was caught at its request and chunk"
        if ok
        else "FAILED: a bug went uncaught, was misplaced, or a clean transfer was flagged"
    )
    return 0 if ok else 1
