"""``python -m torch_kvcanary demo``: a paged KV cache, five classic corruption bugs, and
the canary catching each at the slot, layer and K/V half where it happened, with the
checks that caught it.

A small Llama-like model's cache (grouped-query heads, bf16, pages of 16 slots, vLLM
layout per layer) serves a few requests for some decode steps. The engine records each
slot after writing it (token, position, the request's previous slot) and verifies every
slot before attention reads it; a second canary in PARTIAL mode runs beside the ALL one
to show what reading 16 bytes would miss. The injected bugs: a page freed and reused
while a request still reads it, a block-table entry pointing at another request's page
(every byte intact), a single flipped bit, a write that lands one page off, and an
offload/restore round trip that puts K and V back the wrong way round. Exits 1 if a bug
goes unreported or a clean slot is flagged.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from ..canary import KvCanary
from ..layouts import vllm
from ..sources import HashMode
from ..violations import FailReason

HALVES = ("K", "V")


@dataclass(frozen=True)
class Config:
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    num_pages: int = 64
    dtype: torch.dtype = torch.bfloat16


@dataclass
class Request:
    rid: int
    pages: list[int] = field(default_factory=list)  # the block table
    tokens: list[int] = field(default_factory=list)  # the token id at each position

    @property
    def length(self) -> int:
        return len(self.tokens)

    def slots(self, page_size: int) -> list[int]:
        return [self.pages[i // page_size] * page_size + i % page_size for i in range(self.length)]


@dataclass(frozen=True)
class Catch:
    step: int
    rid: int
    slot: int
    layer: int
    half: str
    mode: str
    reasons: FailReason


class PagedCache:
    """Per layer a vLLM-style ``[2, num_pages, page_size, kv_heads, head_dim]`` tensor, a
    LIFO page allocator, and one canary per (layer, half) and mode."""

    def __init__(self, cfg: Config, device: str):
        self.cfg, self.device = cfg, device
        shape = (2, cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        self.layers = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.layers)]
        self.free_pages = list(range(cfg.num_pages - 1, -1, -1))
        self.canaries = {
            (mode, layer, half): KvCanary(source, mode=mode, on_violation=None)
            for mode in (HashMode.ALL, HashMode.PARTIAL)
            for layer, kv in enumerate(self.layers)
            for half, source in zip(HALVES, vllm(kv, layout="NHD"))
        }

    def write(self, request: Request, count: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Writes `count` new tokens' K and V (the model's output) for `request`; the record
        inputs of their slots (slots, positions, token ids, previous slots)."""
        first = request.length
        for _ in range(count):
            if request.length % self.cfg.page_size == 0:
                request.pages.append(self.free_pages.pop())
            request.tokens.append(int(torch.randint(0, 32000, (), generator=gen)))
        entries = context_entries(request, self.cfg.page_size, self.device, first=first)
        slots = entries["slots"]
        shape = (count, self.cfg.kv_heads, self.cfg.head_dim)
        for kv in self.layers:
            pages, offsets = slots // self.cfg.page_size, slots % self.cfg.page_size
            for half in range(2):
                kv[half, pages, offsets] = torch.randn(shape, generator=gen).to(self.cfg.dtype).to(self.device)
        return entries

    def record(self, entries: dict[str, torch.Tensor]) -> None:
        for canary in self.canaries.values():
            canary.record(**entries)

    def token_view(self, layer: int, half: int, slot: int) -> torch.Tensor:
        return self.layers[layer][half, slot // self.cfg.page_size, slot % self.cfg.page_size]


def context_entries(request: Request, page_size: int, device: str, first: int = 0) -> dict[str, torch.Tensor]:
    """The record and verify inputs of positions [first, length) of `request`, as its block
    table gives them; `tag` is the request id."""
    slots = request.slots(page_size)
    positions = list(range(first, request.length))
    return {
        "slots": torch.tensor([slots[p] for p in positions], dtype=torch.int64, device=device),
        "positions": torch.tensor(positions, dtype=torch.int64, device=device),
        "tokens": torch.tensor(request.tokens[first:], dtype=torch.int64, device=device),
        "prev_slots": torch.tensor([slots[p - 1] if p else -1 for p in positions], dtype=torch.int64, device=device),
        "tag": torch.full((len(positions),), request.rid, dtype=torch.int64, device=device),
    }


def _concat(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([entries[key] for entries in batch]) for key in batch[0]}


class Demo:
    def __init__(self, device: str, steps: int, seed: int = 0):
        self.cfg = Config()
        self.cache = PagedCache(self.cfg, device)
        self.device, self.steps = device, steps
        self.gen = torch.Generator().manual_seed(seed)
        self.requests: list[Request] = []
        self.active: list[Request] = []  # a request with a caught violation is aborted
        self.catches: list[Catch] = []
        self.expected: dict[str, set[tuple[int, int, int, str]]] = {}  # bug -> {(rid, slot, layer, half)}
        self.injected_at: dict[str, int] = {}
        self.canary_seconds = 0.0
        self.work_seconds = 0.0

    # -- the engine -------------------------------------------------------------------------

    def admit(self, prompt: int) -> Request:
        request = Request(rid=len(self.requests))
        self.requests.append(request)
        self.active.append(request)
        self.cache.record(self.cache.write(request, prompt, self.gen))
        return request

    def _sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def _verify(self, step: int, entries: dict[str, torch.Tensor]) -> set[int]:
        """Verifies the slots the batch is about to read and polls each canary; the requests
        with a flagged slot."""
        broken = set()
        for (mode, layer, half), canary in self.cache.canaries.items():
            flagged = canary.verify(**entries)
            reasons: dict[int, FailReason] = {}
            for violation in canary.poll():
                reasons[violation.slot] = reasons.get(violation.slot, FailReason(0)) | violation.reasons
            for slot, rid in zip(entries["slots"][flagged].tolist(), entries["tag"][flagged].tolist()):
                self.catches.append(Catch(step, rid, slot, layer, half, mode.name, reasons[slot]))
                broken.add(rid)
        return broken

    def _attention(self, request: Request, slots: torch.Tensor) -> None:
        cfg = self.cfg
        pages, offsets = slots // cfg.page_size, slots % cfg.page_size
        q = torch.randn(cfg.q_heads, cfg.head_dim, generator=self.gen).to(cfg.dtype).to(self.device)
        for kv in self.cache.layers:
            k = kv[0, pages, offsets].repeat_interleave(cfg.q_heads // cfg.kv_heads, dim=1)  # [n, q_heads, d]
            v = kv[1, pages, offsets].repeat_interleave(cfg.q_heads // cfg.kv_heads, dim=1)
            scores = torch.einsum("hd,nhd->hn", q.float(), k.float()) / cfg.head_dim**0.5
            torch.einsum("hn,nhd->hd", scores.softmax(-1), v.float())

    def step(self, step: int) -> None:
        """One decode step of the batch: verify every slot it reads, attend, write one token
        per request, record the new slots."""
        page_size = self.cfg.page_size
        contexts = [context_entries(r, page_size, self.device) for r in self.active]
        reads = [c["slots"] for c in contexts]
        self._sync()
        start = time.perf_counter()
        broken = self._verify(step, _concat(contexts))
        self._sync()
        verified = time.perf_counter()
        batch = [(r, s) for r, s in zip(self.active, reads) if r.rid not in broken]
        self.active = [r for r, _ in batch]  # never attend over corrupted KV: abort the request
        written = []
        for request, read in batch:
            self._attention(request, read)
            written.append(self.cache.write(request, 1, self.gen))
        self._sync()
        computed = time.perf_counter()
        if batch:
            self.cache.record(_concat(written))
        self._sync()
        self.canary_seconds += verified - start + time.perf_counter() - computed
        self.work_seconds += computed - verified

    # -- the bugs ---------------------------------------------------------------------------

    def _expect(self, bug: str, step: int, entries) -> None:
        self.injected_at[bug] = step
        self.expected[bug] = set(entries)

    def free_page_still_read(self, step: int) -> None:
        """The scheduler frees a running request's last page; a new request gets it."""
        victim = self.active[1]
        page = victim.pages[-1]
        self.cache.free_pages.append(page)  # the bug: victim still holds the page
        newcomer = self.admit(prompt=self.cfg.page_size + 4)
        assert newcomer.pages[0] == page
        reused = [s for s in victim.slots(self.cfg.page_size) if s // self.cfg.page_size == page]
        self._expect(
            "page freed while still read",
            step,
            ((victim.rid, s, layer, h) for s in reused for layer in range(self.cfg.layers) for h in HALVES),
        )

    def block_table_points_elsewhere(self, step: int) -> None:
        """Two requests arrive; one's block table entry is overwritten with the other's page:
        it now reads that page's KV, every byte of which is intact."""
        victim, other = self.admit(prompt=2 * self.cfg.page_size + 3), self.admit(prompt=2 * self.cfg.page_size + 7)
        victim.pages[1] = other.pages[1]  # the bug
        page_size = self.cfg.page_size
        slots = victim.slots(page_size)
        read = [s for s in slots if s // page_size == other.pages[1]]
        read.append(slots[2 * page_size])  # the next position chains through the wrong page
        self._expect("block table pointing at another request's page", step,
                     ((victim.rid, s, layer, h) for s in read for layer in range(self.cfg.layers) for h in HALVES))  # fmt: skip

    def flip_bit(self, step: int) -> None:
        """One bit of one V element of one slot flips (past the slot's first 16 bytes)."""
        victim = self.active[1]
        slot, layer = victim.slots(self.cfg.page_size)[5], 2
        token = self.cache.token_view(layer, 1, slot)
        token.view(torch.int16)[1, 9] ^= 1 << 3
        self._expect("single flipped bit", step, [(victim.rid, slot, layer, "V")])

    def write_one_page_off(self, step: int) -> None:
        """A kernel writes a request's newest token of layer 1 one page past its slot,
        into a slot that another running request has written."""
        page_size = self.cfg.page_size
        victim, slot, target = next(
            (v, s, s + page_size)
            for w in self.active
            for s in w.slots(page_size)[-1:]
            for v in self.active
            if v is not w and s + page_size in v.slots(page_size)
        )
        for half in range(2):
            self.cache.token_view(1, half, target).copy_(self.cache.token_view(1, half, slot) + 1)
        self._expect("write one page off", step, [(victim.rid, target, 1, h) for h in HALVES])

    def offload_restore_swapped(self, step: int) -> None:
        """Request 2's pages go to host memory and come back with K and V swapped in layer 3."""
        victim, layer = self.active[-1], 3
        pages = torch.tensor(victim.pages, device=self.device)
        host = self.cache.layers[layer][:, pages].cpu()  # offload [2, n, P, H, D]
        self.cache.layers[layer][:, pages] = host.flip(0).to(self.device)  # restore, halves swapped
        self._expect(
            "offload/restore with K and V swapped",
            step,
            ((victim.rid, s, layer, h) for s in victim.slots(self.cfg.page_size) for h in HALVES),
        )

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> int:
        for prompt in (40, 23, 35, 17):
            self.admit(prompt)
        bugs = {
            2: self.free_page_still_read,
            3: self.block_table_points_elsewhere,
            4: self.flip_bit,
            6: self.write_one_page_off,
            8: self.offload_restore_swapped,
        }
        for step in range(self.steps):
            if step in bugs:
                bugs[step](step)
            self.step(step)
        return self.report()

    def report(self) -> int:
        cfg = self.cfg
        print(
            f"paged KV cache: {cfg.layers} layers, {cfg.q_heads} query / {cfg.kv_heads} KV heads x {cfg.head_dim}, "
            f"{str(cfg.dtype).removeprefix('torch.')}, pages of {cfg.page_size} slots, on {self.device}"
        )
        print(
            f"{len(self.requests)} requests, {self.steps} batched decode steps; every slot recorded after its write and verified before each read\n"
        )
        caught = {(c.rid, c.slot, c.layer, c.half) for c in self.catches if c.mode == "ALL"}
        partial = {(c.rid, c.slot, c.layer, c.half) for c in self.catches if c.mode == "PARTIAL"}
        unreported = []
        for bug, expected in self.expected.items():
            hits = sorted(expected & caught)
            first = [c for c in self.catches if c.mode == "ALL" and (c.rid, c.slot, c.layer, c.half) in expected]
            when = f"caught at step {min(c.step for c in first)}" if first else "NOT CAUGHT"
            print(
                f"{bug} (injected before step {self.injected_at[bug]}): {when}, {len(hits)}/{len(expected)} flagged (request, slot, layer, half)"
            )
            checks = FailReason(0)
            for c in first:
                checks |= c.reasons
            if first:
                print(f"    caught by: {' + '.join(checks.labels)}")
            for rid in sorted({h[0] for h in hits}):
                mine = [h for h in hits if h[0] == rid]
                print(
                    f"    request {rid}: slots {_ranges(h[1] for h in mine)}, layers {_ranges(h[2] for h in mine)}, "
                    f"{' and '.join(sorted({h[3] for h in mine}))}"
                )
            missed = sorted(expected & caught - partial)
            if missed:
                print(f"    PARTIAL (first 16 bytes) missed {len(missed)} of them: ALL caught what PARTIAL could not")
            if not hits:
                unreported.append(bug)
        expected_all = set().union(*self.expected.values())
        false_alarms = sorted(caught - expected_all)
        overhead = self.canary_seconds / self.work_seconds if self.work_seconds else float("nan")
        print(f"\nfalse alarms: {len(false_alarms)}" + (f" {false_alarms[:5]}" if false_alarms else ""))
        calls = 2 * len(self.cache.canaries) * self.steps  # a verify and a record per canary and step
        print(
            f"cost: canary {self.canary_seconds * 1e3:.1f} ms against {self.work_seconds * 1e3:.1f} ms of the steps' own work "
            f"(attention over every layer and the writes of this toy model), {overhead:.0%}; "
            f"{calls} canary calls ({len(self.cache.canaries)} canaries: ALL and PARTIAL per layer and half), "
            f"{self.canary_seconds / calls * 1e6:.0f} us each"
        )
        if unreported or false_alarms:
            print(f"FAILED: unreported bugs {unreported}, false alarms {len(false_alarms)}")
            return 1
        print("every injected bug was reported at its slot, layer and half")
        return 0


def _ranges(values) -> str:
    """1,2,3,7 -> '1-3, 7'."""
    ordered = sorted(set(values))
    spans: list[list[int]] = []
    for v in ordered:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kv-canary: --device cuda needs a CUDA device")
        return 2
    return Demo(args.device, args.steps).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10, help="decode steps (the bugs land in steps 2 to 8)")
