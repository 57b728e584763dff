"""``python -m benchmarks.pd_transfer`` (from a checkout): the host's work per request of the
verified P/D transfer through NIXL, without vLLM or NIXL, as the requests per call grow.

The connector's NIXL worker (`nixl.NixlWorker`) runs on buffers shaped as vLLM's runner
holds them, which the tests' fake runner hands the plugin's canary in place of a runner
(torch_kvcanary/testing/fake_runner.py), the records region beside them:

* P, ``after_save``: the records and the head digests of the prompts a step completed,
  written into the region;
* D, ``land``: the loads NIXL reported landed in one call, recorded, compared with the
  region's rows (P's, as NIXL moved them: the comparison finds nothing) and the records of
  those that differ broken.

Each cell gives ``requests`` prompts of ``tokens`` tokens to one call, and prints, as medians
over the calls, per request:

* ``wall``: the call's wall time, in microseconds: the host's work and the canary's ops'
  (on the CPU build the device is the host);
* ``host alone``: the same calls with the canary's ops (its record and refold, the digest)
  taken off the CPU (no-ops in their place), as where a GPU runs them: the Python, NumPy
  and torch dispatch the call costs the host;
* ``ops``: the torch ops the call dispatches (what a GPU launches, at most), per call.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.rows import parse_args, write_rows
from torch_kvcanary import digest
from torch_kvcanary.integrations.vllm import worker
from torch_kvcanary.integrations.vllm.config import Settings
from torch_kvcanary.integrations.vllm.connector import nixl
from torch_kvcanary.integrations.vllm.connector.nixl.region import RecordsRegion
from torch_kvcanary.sources import HashMode
from torch_kvcanary.testing.fake_runner import BLOCK_SIZE, NUM_KV_HEADS, FakeRunner, StepBuffers

WARMUP = 3


class OpCount(TorchDispatchMode):
    """Counts the torch ops dispatched within it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class TransferCell:
    """``requests`` prompts of ``tokens`` tokens over ``layers`` layers, recorded by the
    plugin's canary, and a NIXL worker whose region holds their rows."""

    def __init__(self, layers: int, requests: int, tokens: int):
        self.buffers = StepBuffers("v1", layers, requests, tokens, decode_steps=1)
        self.canary = worker.WorkerCanary(self.buffers, Settings("log", HashMode.ALL), runner_view=FakeRunner(self.buffers))
        forward = self.buffers.step(tokens)
        self.canary.end_step(self.canary.begin_step(lambda: forward))
        self.port = self.canary.port
        self.worker = nixl.NixlWorker(BLOCK_SIZE, sharding=nixl.Sharding(1, NUM_KV_HEADS), rank=0)
        num_blocks = self.buffers.caches[0].shape[0]
        self.worker.region = RecordsRegion(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, BLOCK_SIZE, self.canary.canary.device)
        self.blocks = [
            [self.buffers.block_of(request, position) for position in range(0, tokens, BLOCK_SIZE)] for request in range(requests)
        ]
        self.handovers = nixl.NixlOrders(handovers=[nixl.HandOverOrder(f"r{r}", blocks, tokens) for r, blocks in enumerate(self.blocks)])
        records = self.canary.canary.records
        self.loads = nixl.NixlOrders(
            loads=[
                nixl.LoadOrder(f"r{r}", 1, records[torch.from_numpy(nixl.slots_of(blocks, tokens, BLOCK_SIZE)), 0].tolist(), blocks, 0, tokens)
                for r, blocks in enumerate(self.blocks)
            ]
        )  # fmt: skip
        self.request_ids = {load.request_id for load in self.loads.loads}

    def write(self) -> float:
        """P's call: its wall time."""
        start = time.perf_counter()
        self.worker.after_save(self.port, self.handovers)
        return time.perf_counter() - start

    def land(self) -> float:
        """D's call (NIXL noted the loads first, untimed): its wall time."""
        self.worker.before_load(self.port, self.loads)
        start = time.perf_counter()
        self.worker.land(self.port, self.request_ids, ())
        seconds = time.perf_counter() - start
        self.worker.forget(self.request_ids)
        return seconds

    def ops(self, call) -> int:
        with OpCount() as count:
            call()
        return count.ops

    @contextlib.contextmanager
    def without_canary_ops(self):
        """While entered, the canary's ops are no-ops and the digest's are zeros: the host's work alone."""
        canary, digest_call = self.canary.canary, digest._digest
        canary._call = lambda op, *args: None
        digest._digest = lambda views, slots, positions, groups, offsets, num_groups, check_bounds: torch.zeros(
            num_groups, dtype=torch.int64
        )
        try:
            yield
        finally:
            del canary._call  # the class's own again
            digest._digest = digest_call


def _timed(cell: TransferCell, calls: int) -> tuple[list[float], list[float]]:
    """After `WARMUP` calls of each side, ``calls`` timed writes on P, then as many lands on D."""
    for _ in range(WARMUP):
        cell.write(), cell.land()
    return [cell.write() for _ in range(calls)], [cell.land() for _ in range(calls)]


def run_cell(layers: int, requests: int, tokens: int, calls: int) -> dict:
    cell = TransferCell(layers, requests, tokens)
    write, land = _timed(cell, calls)
    violations = cell.canary.stats()["violations"]
    cell.canary.canary.poll()
    failed = int(cell.canary.canary.verify(torch.from_numpy(nixl.slots_of(cell.blocks[0], tokens, BLOCK_SIZE))).sum())
    if violations or failed:
        raise SystemExit(f"the clean transfer found {violations} violations and {failed} broken slots: the benchmark's buffers are wrong")
    write_ops, land_ops = cell.ops(cell.write), cell.ops(cell.land)
    with cell.without_canary_ops():
        write_alone, land_alone = _timed(cell, calls)
    per_request = lambda seconds: statistics.median(seconds) / requests * 1e6  # noqa: E731
    return {
        "layers": layers, "requests": requests, "tokens": tokens,
        "p_wall_us": per_request(write), "p_host_alone_us": per_request(write_alone), "p_ops": write_ops,
        "d_wall_us": per_request(land), "d_host_alone_us": per_request(land_alone), "d_ops": land_ops,
    }  # fmt: skip


COLUMNS = (
    ("layers", "layers", "{}"), ("requests", "requests per call", "{}"), ("tokens", "tokens each", "{}"),
    ("p_wall_us", "P wall (us/request)", "{:.1f}"), ("p_host_alone_us", "P host alone (us/request)", "{:.1f}"), ("p_ops", "P ops/call", "{}"),
    ("d_wall_us", "D wall (us/request)", "{:.1f}"), ("d_host_alone_us", "D host alone (us/request)", "{:.1f}"), ("d_ops", "D ops/call", "{}"),
)  # fmt: skip


def format_rows(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + " ---: |" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--calls", type=int, default=15, help="calls timed per cell and side")
    args = parse_args(parser, argv)
    rows = []
    for layers, requests, tokens in itertools.product(args.layers, args.requests, args.tokens):
        rows.append(run_cell(layers, requests, tokens, args.calls))
        print(json.dumps(rows[-1]), flush=True)
    print(format_rows(rows))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
