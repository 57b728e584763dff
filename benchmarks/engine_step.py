"""``python -m benchmarks.engine_step`` (from a checkout): the vLLM plugin's host work per
engine step, without vLLM, as the number of layers, requests and context tokens grows.

The plugin's own step code (`worker.WorkerCanary.begin_step` and ``end_step``) runs on
buffers shaped as vLLM's model runners hold them, which the tests' fake runner
(`FakeRunner`, torch_kvcanary/testing/fake_runner.py) hands it in place of a runner: per watched
layer a packed ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` cache (FLASH_ATTN's
split of K and V, so no block-packed work), one KV cache group with its block table, and per
step the rows' scheduled and computed tokens, positions, input ids and
slot mapping. ``--runner v1`` keeps the token history by input-batch row with a mask of the
positions it holds (V1 on vLLM's CPU build); ``v2`` by request-state row through an index
mapping, with every position known (V2).

Each cell first records every request's context in one prefill step, then times decode
steps (one token per request). Printed per cell, as medians over the steps:

* ``wall``: the plugin's step (before and after the forward), in microseconds;
* ``host``: the wall time less that of the canary's op call (`TimedOp`, its dispatch and
  kernel): the Python and NumPy work around it, what the host adds per step where a GPU
  runs the op asynchronously (the call's own argument passing, about 9 us, is in
  docs/figures_cpu.md, "The fixed cost of a call");
* ``host alone``: the same steps with the op's work taken off the CPU (a no-op in its place),
  as where a GPU runs it: the plugin's host work without the op's evictions of the CPU's
  caches, which inflate the ``host`` column as the op's data grow;
* ``host hot``: the same host work alone repeated on one step at once (the least of a few
  rounds), with the CPU's caches hot: the plugin's own work, without the misses that the
  runner's work on the step between two steps leaves in ``host alone`` (its data grow with
  the requests);
* ``ops``: the number of torch ops the plugin calls per step, the canary's and others (a
  second pass, under torch's profiler).

A cell whose step would read more than ``--budget-gib`` of the pool is left out (it says so).
``--turns N`` runs the grid N times and prints each cell's median over the turns, and per
dimension the largest cell's figure over the smallest's (its worst over the other
dimensions). Cells run one after another, so a machine whose speed drifts (a shared guest)
moves these ratios; last come the ratios in turns: per dimension, its smallest and largest
cell built side by side and their steps alternated (`paired_ratios`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
import timeit

import torch

from benchmarks.rows import parse_args, write_rows
from torch_kvcanary.integrations.vllm import worker
from torch_kvcanary.integrations.vllm.config import Settings
from torch_kvcanary.sources import HashMode
from torch_kvcanary.testing.fake_runner import HEAD_SIZE, NUM_KV_HEADS, FakeRunner, StepBuffers

PLUGIN_RANGE = "kvcanary_engine_step"
# The host work alone is cheap to time: more steps, after some that warm the caches up again.
ALONE_WARMUP, ALONE_STEPS = 20, 100
# The host work with hot caches: one step's calls repeated at once, the least of a few rounds.
HOT_CALLS, HOT_REPEATS = 200, 5


class TimedOp:
    """The canary's step op, timed call by call (its dispatch and kernel), so that a step's
    host work is its wall time less its op's, both from the same step."""

    def __init__(self, op):
        self.op, self.seconds = op, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        self.op(*args)
        self.seconds += time.perf_counter() - start


def run_cell(runner: str, layers: int, requests: int, context: int, mode: str, steps: int) -> dict:
    buffers = StepBuffers(runner, layers, requests, context, decode_steps=2 * steps + ALONE_WARMUP + ALONE_STEPS + 2)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode[mode]), runner_view=FakeRunner(buffers))
    timed = canary._paged._op = TimedOp(canary._paged._op)

    def plugin_step(scheduled: int) -> tuple[float, float]:
        forward = buffers.step(scheduled)  # the runner's work, not the plugin's
        timed.seconds = 0.0
        start = time.perf_counter()
        step = canary.begin_step(lambda: forward)
        canary.end_step(step)
        wall = time.perf_counter() - start
        return wall, wall - timed.seconds

    def profiled_step() -> None:
        forward = buffers.step(1)
        with torch.profiler.record_function(PLUGIN_RANGE):
            step = canary.begin_step(lambda: forward)
        with torch.profiler.record_function(PLUGIN_RANGE):
            canary.end_step(step)

    plugin_step(context)  # the prefill: every request's context, recorded
    plugin_step(1)  # warms up
    timings = [plugin_step(1) for _ in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            profiled_step()
    events = profile.events()
    ops = sum(1 for event in events if event.cpu_parent is not None and event.cpu_parent.name == PLUGIN_RANGE) / steps
    violations = canary.stats()["violations"]
    if violations:
        raise SystemExit(f"the clean workload found {violations} violations: the benchmark's buffers are wrong")
    timed.op = lambda *args: None  # the op's work elsewhere, as on a GPU: the plugin's host work alone
    alone = [plugin_step(1)[0] for _ in range(ALONE_WARMUP + ALONE_STEPS)][ALONE_WARMUP:]
    forward = buffers.step(1)
    hot = timeit.repeat(lambda: canary.end_step(canary.begin_step(lambda: forward)), number=HOT_CALLS, repeat=HOT_REPEATS)
    return {
        "runner": runner, "layers": layers, "requests": requests, "context": context, "mode": mode,
        "wall_us": statistics.median(w for w, _ in timings) * 1e6, "host_us": statistics.median(h for _, h in timings) * 1e6,
        "host_alone_us": statistics.median(alone) * 1e6, "host_hot_us": min(hot) / HOT_CALLS * 1e6, "ops_per_step": ops,
    }  # fmt: skip


# The goal's flatness measured in turns: per dimension, its smallest and largest cell (the
# other dimensions at their smallest), built side by side, their steps alternated.
PAIR_STEPS = 200


class HostOnlyStep:
    """A cell's plugin step with the op's work taken off the CPU (`run_cell`'s host work
    alone): `after_runner` times a step after the runner's work on it, `hot` one step's
    calls repeated at once."""

    def __init__(self, runner: str, mode: str, layers: int, requests: int, context: int):
        self.buffers = StepBuffers(runner, layers, requests, context, decode_steps=2 * PAIR_STEPS + 2)
        self.canary = worker.WorkerCanary(self.buffers, Settings("log", HashMode[mode]), runner_view=FakeRunner(self.buffers))
        forward = self.buffers.step(context)
        self.canary.end_step(self.canary.begin_step(lambda: forward))
        self.canary._paged._op = lambda *args: None

    def after_runner(self) -> float:
        forward = self.buffers.step(1)
        start = time.perf_counter()
        self.canary.end_step(self.canary.begin_step(lambda: forward))
        return time.perf_counter() - start

    def hot(self) -> float:
        forward = self.buffers.step(1)
        return min(timeit.repeat(lambda: self.canary.end_step(self.canary.begin_step(lambda: forward)), number=HOT_CALLS, repeat=1))


def pairs(layers: list[int], requests: list[int], contexts: list[int]) -> dict[str, tuple[tuple, tuple]]:
    """Per dimension with two values or more: its smallest and its largest cell, (layers,
    requests, context) with the other dimensions at their smallest."""
    values = {"layers": sorted(layers), "requests": sorted(requests), "context": sorted(contexts)}
    smallest = tuple(v[0] for v in values.values())
    found = {}
    for index, (dimension, ordered) in enumerate(values.items()):
        if len(ordered) > 1:
            found[dimension] = smallest, smallest[:index] + (ordered[-1],) + smallest[index + 1 :]
    return found


def paired_ratios(runner: str, mode: str, cell_pairs: dict[str, tuple[tuple, tuple]]) -> dict[str, tuple[float, float]]:
    """Per dimension of ``cell_pairs`` (`pairs`): the host work alone at its largest cell
    over its smallest, the two cells' steps in turns (the median of each over `PAIR_STEPS`
    steps after 20), and the median over rounds in turns of the hot host work's ratio."""
    ratios = {}
    for dimension, cells in cell_pairs.items():
        small, large = (HostOnlyStep(runner, mode, *cell) for cell in cells)
        alone: tuple[list[float], list[float]] = ([], [])
        hot = []
        for turn in range(PAIR_STEPS):
            order = (small, large) if turn % 2 == 0 else (large, small)
            times = {id(step): step.after_runner() for step in order}
            alone[0].append(times[id(small)])
            alone[1].append(times[id(large)])
            if turn % 10 == 0:
                times = {id(step): step.hot() for step in order}
                hot.append(times[id(large)] / times[id(small)])
        ratios[dimension] = statistics.median(alone[1][20:]) / statistics.median(alone[0][20:]), statistics.median(hot)
    return ratios


def _step_bytes(layers: int, requests: int, context: int) -> int:
    return 2 * layers * requests * context * HEAD_SIZE * 2 * NUM_KV_HEADS


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| runner | mode | layers | requests | context | wall us | host us | host alone us | host hot us | torch ops per step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['runner']} | {row['mode']} | {row['layers']} | {row['requests']} | {row['context']} | "
            f"{row['wall_us']:.0f} | {row['host_us']:.0f} | {row['host_alone_us']:.0f} | {row['host_hot_us']:.1f} | "
            f"{row['ops_per_step']:.0f} |"
        )
    return "\n".join(lines)


# The goal's flatness: the host work alone at the largest of a dimension over its smallest.
DIMENSIONS = ("layers", "requests", "context")


def _cell(row: dict) -> tuple:
    return row["runner"], row["mode"], row["layers"], row["requests"], row["context"]


def median_rows(turns: list[list[dict]]) -> list[dict]:
    """Each cell's figures, the median over the turns (a cell left out of a turn is left out)."""
    by_cell: dict[tuple, list[dict]] = {}
    for rows in turns:
        for row in rows:
            by_cell.setdefault(_cell(row), []).append(row)
    medians = []
    for cell_rows in by_cell.values():
        row = dict(cell_rows[0])
        for key in ("wall_us", "host_us", "host_alone_us", "host_hot_us", "ops_per_step"):
            row[key] = statistics.median(r[key] for r in cell_rows)
        row["turns"] = len(cell_rows)
        medians.append(row)
    return medians


def flatness(turns: list[list[dict]], column: str = "host_alone_us") -> dict[str, float]:
    """Per dimension, the largest over the other dimensions' cells of the median over the
    turns of that turn's ``column`` at the dimension's largest value over its smallest."""
    worst = {}
    for dimension in DIMENSIONS:
        ratios: dict[tuple, list[float]] = {}
        for rows in turns:
            values = sorted({row[dimension] for row in rows})
            if len(values) < 2:
                continue
            lowest = {_cell(r): r for r in rows if r[dimension] == values[0]}
            for row in rows:
                if row[dimension] != values[-1]:
                    continue
                base = lowest.get(_cell({**row, dimension: values[0]}))
                if base is not None:
                    ratios.setdefault(_cell(row), []).append(row[column] / base[column])
        if ratios:
            worst[dimension] = max(statistics.median(r) for r in ratios.values())
    return worst


def least_flatness(turns: list[list[dict]], column: str) -> dict[str, float]:
    """As `flatness`, of each cell's least ``column`` over the turns: noise on a shared
    machine only adds time, so the least is the work's own."""
    least: dict[tuple, dict] = {}
    for rows in turns:
        for row in rows:
            kept = least.get(_cell(row))
            if kept is None or row[column] < kept[column]:
                least[_cell(row)] = row
    return flatness([list(least.values())], column)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", nargs="+", choices=["v1", "v2"], default=["v1", "v2"])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 12, 80])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--modes", nargs="+", choices=["PARTIAL", "ALL"], default=["PARTIAL", "ALL"])
    parser.add_argument("--steps", type=int, default=7, help="decode steps timed per cell (and as many profiled)")
    parser.add_argument("--turns", type=int, default=1, help="run the whole grid this many times, in turns")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="leave out a cell whose pool exceeds this")
    args = parse_args(parser, argv)
    cells = list(itertools.product(args.runner, args.modes, args.layers, args.requests, args.contexts))
    turns = []
    for turn in range(args.turns):
        rows = []
        for runner, mode, layers, requests, context in cells:
            if _step_bytes(layers, requests, context) > args.budget_gib * (1 << 30):
                if turn == 0:
                    print(f"left out: {runner} {mode} {layers} layers x {requests} requests x {context} tokens (pool over --budget-gib)")
                continue
            rows.append({"turn": turn, **run_cell(runner, layers, requests, context, mode, args.steps)})
            print(json.dumps(rows[-1]), flush=True)
        turns.append(rows)
    print(format_rows(median_rows(turns)))
    for column, name in (("host_alone_us", "host alone"), ("host_hot_us", "host hot")):
        for dimension, ratio in flatness(turns, column).items():
            least = least_flatness(turns, column)[dimension]
            print(
                f"{name}, largest {dimension} over smallest: at most {ratio:.2f} (median over {args.turns} turns), "
                f"{least:.2f} (each cell's least)"
            )
    print("In turns, the largest cell of a dimension against its smallest:")
    cell_pairs = pairs(args.layers, args.requests, args.contexts)
    for runner, mode in itertools.product(args.runner, args.modes):
        for dimension, (alone, hot) in paired_ratios(runner, mode, cell_pairs).items():
            print(f"  {runner} {mode} {dimension}: host alone {alone:.2f}, host hot {hot:.2f}")
    write_rows(args.json, [row for rows in turns for row in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
