"""``python -m benchmarks.paged_step_device [--device cuda]``: one engine step's canary call
(`PagedStep`, ``kvcanary::paged_step``) on a device, the checks of the step that need one
(``build_tools/device_check.sh`` runs it where a GPU is lent):

* ``host us``: the call's host time, from its start to its return (no synchronize): what
  the host spends per step where the device runs the call asynchronously; median over the
  decode steps;
* ``queued us``: the same, for calls issued back to back with the device still busy with
  the ones before (as an engine issues its steps), and ``trivial us``: the host time of as
  many of torch's smallest kernels (``add_`` on one value) as the call launches, issued
  back to back in the same process: the floor a call of that many launches stands on;
  medians;
* ``device us``: the call's device time (CUDA events around it); median;
* ``kernels``: the kernels and memsets one call launches (torch's profiler), the same for
  every step of a shape: the count depends on the number of sources alone;
* ``syncs``: whether a call waited on the device (``torch.cuda.set_sync_debug_mode("error")``
  raises on a synchronizing call; "none" when every call ran under it);
* ``graph``: a decode call captured in a CUDA graph, then replayed on later steps with the
  step's buffers refilled in place, against the same steps run eagerly on a twin canary
  over the same KV cache: "equal" when the records, owner tags and counters agree after
  every step (a replay keeps the step number it was captured with, so the mailbox's step
  is not compared).

The workload: ``--requests`` requests of ``--context`` tokens over ``--layers`` layers of
vLLM's ``[2, num_blocks, block_size, heads, head_size]`` layout (bf16), one KV cache group,
each request's context recorded in a prefill step, then ``--steps`` decode steps of one
token per request. With ``--device cpu`` the host time includes the call's work (the CPU
is the device) and the device-only checks print "-".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_kvcanary as kc
from benchmarks.rows import parse_args, write_rows
from torch_kvcanary import layouts
from torch_kvcanary.paged_step import PagedStep

BLOCK_SIZE = 16
HEADS, HEAD_SIZE = 8, 128


class DecodeWorkload:
    """A pool, a canary over it and the step buffers an engine refills in place, on ``device``."""

    def __init__(self, device: str, layers: int, requests: int, context: int, steps: int, mode: str):
        self.device, self.requests = device, requests
        self.blocks_per_request = -(-(context + steps + 1) // BLOCK_SIZE)
        num_blocks = 1 + requests * self.blocks_per_request  # block 0: vLLM's null block
        gen = torch.Generator().manual_seed(0)
        shape = (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE)
        self.caches = [torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16).to(device)]
        self.caches += [torch.empty_like(self.caches[0]).copy_(self.caches[0]) for _ in range(layers - 1)]
        self.sources = [s for cache in self.caches for s in layouts.vllm(cache, layout="NHD")]
        self.mode = kc.HashMode[mode]
        table = 1 + torch.arange(requests)[:, None] * self.blocks_per_request + torch.arange(self.blocks_per_request)
        self.block_table = table.to(torch.int32).to(device)
        self.slot_mapping = torch.full((requests * context,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(requests + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(requests, dtype=torch.int32, device=device)
        self.positions = torch.zeros(requests * context, dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(requests * context, dtype=torch.int32, device=device)
        self.computed = torch.zeros(requests, dtype=torch.int64)

    def canary_step(self) -> PagedStep:
        """A fresh canary over the pool and its step, bound to the buffers."""
        canary = kc.KvCanary(self.sources, mode=self.mode, on_violation=None, padding_slot=0)
        return PagedStep(canary, [self.block_table], [self.slot_mapping], block_size=BLOCK_SIZE)

    def fill(self, scheduled: int) -> int:
        """The buffers of the next forward, ``scheduled`` tokens of every request (host work
        of the runner, not timed); the number of tokens."""
        rows = torch.arange(self.requests).repeat_interleave(scheduled)
        positions = (self.computed[:, None] + torch.arange(scheduled)).reshape(-1)
        blocks = self.block_table.cpu().to(torch.int64)[rows, positions // BLOCK_SIZE]
        tokens = len(positions)
        self.positions[:tokens] = positions.to(self.device)
        self.input_ids[:tokens] = (positions * 7919 % 32000).to(torch.int32).to(self.device)
        self.slot_mapping[:tokens] = (blocks * BLOCK_SIZE + positions % BLOCK_SIZE).to(self.device)
        self.slot_mapping[tokens:] = -1
        self.query_start_loc[1:] = torch.arange(1, self.requests + 1, dtype=torch.int32, device=self.device) * scheduled
        self.seq_lens[:] = (self.computed + scheduled).to(torch.int32).to(self.device)
        self.computed += scheduled
        return tokens

    def buffers(self) -> tuple:
        return self.query_start_loc, self.seq_lens, self.positions, self.input_ids


def _state(step: PagedStep) -> list:
    canary = step.canary
    return [canary._records.tolist(), canary._owner_tags.tolist(), canary._counters.tolist()]


def _kernels(call) -> int:
    """The device kernels and memsets one call launches."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        call()
        torch.cuda.synchronize()
    return sum(1 for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def _queued_host(call, calls: int, first: int) -> float:
    """The median host time of ``call(n)`` for ``calls`` calls issued back to back (``n``
    from ``first`` on), the device left to run behind them."""
    torch.cuda.synchronize()
    times = []
    for number in range(first, first + calls):
        start = time.perf_counter()
        call(number)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times)


def run(device: str, layers: int, requests: int, context: int, steps: int, mode: str) -> dict:
    work = DecodeWorkload(device, layers, requests, context, steps, mode)
    step, twin = work.canary_step(), work.canary_step()
    on_cuda = device.startswith("cuda")
    tokens = work.fill(context)
    for bound in (step, twin):  # the prefill: every request's context recorded
        bound(*work.buffers(), num_reqs=requests, num_tokens=tokens, step=0)
    host, device_times, kernels, graph_equal = [], [], None, None
    graph = None
    for number in range(1, steps + 1):
        tokens = work.fill(1)

        def call(bound=step, number=number, tokens=tokens):
            bound(*work.buffers(), num_reqs=requests, num_tokens=tokens, step=number)

        if not on_cuda:
            start = time.perf_counter()
            call()
            host.append(time.perf_counter() - start)
            continue
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            begin.record()
            start = time.perf_counter()
            call()
            host.append(time.perf_counter() - start)
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        end.synchronize()
        device_times.append(begin.elapsed_time(end) / 1e3)
        # The twin: the first decode step eagerly, then captured once and replayed.
        if graph is None:
            call(twin, 1)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(twin, 1)
        else:
            graph.replay()
        torch.cuda.synchronize()
        graph_equal = graph_equal is not False and _state(step) == _state(twin)
    queued = trivial = None
    if on_cuda:
        tokens = work.fill(1)
        kernels = _kernels(lambda: step(*work.buffers(), num_reqs=requests, num_tokens=tokens, step=steps + 1))
        queued = _queued_host(
            lambda number: step(*work.buffers(), num_reqs=requests, num_tokens=tokens, step=number), steps, first=steps + 2
        )
        one = torch.zeros(1, device=device)
        trivial = _queued_host(lambda number: [one.add_(1) for _ in range(kernels)], steps, first=0)
    return {
        "device": device, "layers": layers, "requests": requests, "context": context, "mode": mode,
        "host_us": statistics.median(host) * 1e6,
        "queued_us": None if queued is None else queued * 1e6,
        "trivial_us": None if trivial is None else trivial * 1e6,
        "device_us": statistics.median(device_times) * 1e6 if device_times else None,
        "kernels": kernels,
        "syncs": "none" if on_cuda else None,
        "graph": None if graph_equal is None else ("equal" if graph_equal else "DIFFERS"),
        "violations": step.canary.stats()["violations"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="ALL", choices=["PARTIAL", "ALL"])
    args = parse_args(parser, argv, host_line=False)
    rows = [run(args.device, layers, requests, args.context, args.steps, args.mode) for layers in args.layers for requests in args.requests]
    print("| device | layers | requests | context | host us | queued us | trivial us | device us | kernels | syncs | graph | violations |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")

    def us(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in rows:
        print(
            f"| {r['device']} | {r['layers']} | {r['requests']} | {r['context']} | {r['host_us']:.1f} | {us(r['queued_us'])} | "
            f"{us(r['trivial_us'])} | {us(r['device_us'], 0)} | "
            f"{r['kernels'] if r['kernels'] is not None else '-'} | {r['syncs'] or '-'} | {r['graph'] or '-'} | {r['violations']} |"
        )
    write_rows(args.json, rows)
    bad = [r for r in rows if r["violations"] or r["graph"] == "DIFFERS"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
