"""``python -m benchmarks.bench`` (from a checkout): the fold's speed beside its baselines.

Every figure is the median of torch.utils.benchmark's blocked_autorange
measurements (their count is reported), taken in one process, with all the
threads torch uses. Baselines, on the same bytes:

* stream:    a plain read of the whole pool (``pool.view(int64).sum()``; on CUDA a
             device-to-device copy, whose rate counts bytes read plus written);
* gather:    ``torch.index_select`` of the folded bytes (the cost of copying them out);
* reference: the package's eager-torch fold (`reference_fold`), where bearable;
* xxh3_64:   on CPU when the ``xxhash`` package is installed (the ``xxhash`` extra), its
             ``xxh3_64`` over the folded bytes laid out contiguously: a fast hash on
             one thread, for scale;
* upstream:  on CUDA, a kernel written the upstream way (64 blocks of 512 threads, one
             thread per slot looping 16-byte loads), built at run time with nvcc and
             checked to give the fold's fingerprints.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from torch_kvcanary.ops import fold
from torch_kvcanary.reference import reference_fold
from torch_kvcanary.sources import HashMode, read_bytes_in_mode, view_source

from .upstream_baseline import upstream_fold

# A case whose eager reference would read more than this is not timed against it.
_REFERENCE_BUDGET_BYTES = 64 << 20
_POOL_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class Case:
    mode: str
    read_bytes: int  # per source
    num_slots: int
    num_sources: int
    order: str  # "seq" or "random"

    @property
    def folded_bytes(self) -> int:
        """Bytes folded per slot of each source."""
        return read_bytes_in_mode(HashMode[self.mode], self.read_bytes)

    @property
    def bytes_per_slot(self) -> int:
        return self.folded_bytes * self.num_sources


@dataclass
class Result:
    device: str
    case: Case
    seconds: float
    repeats: int
    baselines: dict[str, float] = field(default_factory=dict)  # seconds, same bytes
    baseline_repeats: dict[str, int] = field(default_factory=dict)  # measurements behind each
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_per_s(self) -> float:
        return self.case.num_slots * self.case.bytes_per_slot / self.seconds

    @property
    def slots_per_s(self) -> float:
        return self.case.num_slots / self.seconds

    def ratio(self, baseline: str) -> float | None:
        """How many times faster than the baseline (for stream and xxh3_64: the fold's byte
        rate over the baseline's, on the same bytes)."""
        seconds = self.baselines.get(baseline)
        return None if seconds is None else seconds / self.seconds


def default_cases(quick: bool) -> list[Case]:
    big, n = (4096, 4096) if quick else (1 << 20, 65536)
    cases = [Case("ALL", rb, n, 1, order) for rb in (16, 64, 256, 1024, 4096) for order in ("seq", "random")]
    cases += [Case("ALL", 256, s, 1, "random") for s in (1, 256, 4096, big)]
    cases += [Case("ALL", 256, n, k, "random") for k in (2, 4, 8)]
    cases += [Case("PARTIAL", 64, big, 1, "random"), Case("PARTIAL", 64, big, 4, "random")]
    return list(dict.fromkeys(cases))


def goal_cases(device: str) -> list[Case]:
    """The cases the goals are stated for. CPU: ALL over 64 Ki slots of 1 KiB in random order,
    PARTIAL over 1 Mi slots. CUDA: ALL over 256 Ki slots of 1 KiB, PARTIAL over 4 Mi slots,
    decode sizes."""
    if device == "cpu":
        return [Case("ALL", 1024, 1 << 16, 1, "random"), Case("PARTIAL", 64, 1 << 20, 1, "random")]
    return [
        Case("ALL", 1024, 1 << 18, 1, "random"),
        Case("ALL", 1024, 1 << 18, 1, "seq"),
        Case("PARTIAL", 64, 1 << 22, 1, "random"),
        Case("ALL", 256, 256, 4, "random"),
        Case("ALL", 256, 1, 4, "random"),
        Case("ALL", 1024, 4096, 1, "random"),
    ]


def cuda_graph_decode(replays: int = 2000) -> dict[str, float]:
    """A decode step (256 slots, 4 sources of 256 bytes) captured in a CUDA graph: microseconds
    per replay, beside a graph of one trivial kernel (the launch floor)."""
    gen = torch.Generator().manual_seed(0)
    pools = [torch.randint(0, 256, (1 << 16, 256), dtype=torch.uint8, generator=gen).cuda() for _ in range(4)]
    sources = [view_source(p.unsqueeze(1), read_bytes=256) for p in pools]
    slots = torch.randint(0, 1 << 16, (256,), generator=gen).cuda()
    floor_input = torch.zeros(256, device="cuda")

    def per_replay(body) -> float:
        body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / replays

    return {
        "decode_fold_us": per_replay(lambda: fold(sources, slots, check_bounds=False)),
        "launch_floor_us": per_replay(lambda: floor_input.add_(1)),
    }


def _median(stmt, device: str, min_run_time: float) -> tuple[float, int]:
    from torch.utils import (
        benchmark,  # imported when used: it loads the C++ extension tools
    )

    timer = benchmark.Timer(stmt="fn()", globals={"fn": stmt}, num_threads=torch.get_num_threads())
    measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return measurement.median, len(measurement.times)


def _interleaved_medians(stmts: dict, device: str, min_run_time: float, rounds: int = 5) -> dict[str, float]:
    """Median seconds of each statement, measured in turns (`rounds` blocks each, one
    statement after the other, each round starting one statement later), so that a machine's
    slow phases and the order hit every one alike."""
    from torch.utils import benchmark

    times: dict[str, list[float]] = {name: [] for name in stmts}
    names = list(stmts)
    for turn in range(rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            stmt = stmts[name]
            timer = benchmark.Timer(stmt="fn()", globals={"fn": stmt}, num_threads=torch.get_num_threads())
            times[name] += timer.blocked_autorange(min_run_time=min_run_time / rounds).times
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


# The op library a baseline build registers: its namespace renamed (tools/overhead_ab.sh builds
# one from a git revision), so that it loads beside this build's.
BASELINE_NAMESPACE = "kvcanary_base"


def call_overhead(min_run_time: float, baseline_library: str | None = None) -> dict[str, float]:
    """Microseconds per call of a decode step's fold on the CPU, where the cost of the call
    itself shows: 256 random slots of one source of 256-byte tokens, its 1 MiB pool in
    cache. `fold` is the package's function (its argument checks, the op and the kernel), `op`
    the op called directly; with ``baseline_library`` (another build of the op library whose
    namespace is BASELINE_NAMESPACE), `baseline op` is that build's op on the same arguments,
    checked to fold alike. Medians of measurements taken in turns."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (4096, 1, 256), dtype=torch.uint8, generator=gen)
    source = view_source(pool, read_bytes=256)
    slots = torch.randint(0, 4096, (256,), generator=gen)
    op = torch.ops.kvcanary.fold
    stmts = {
        "fold": lambda: fold(source, slots),
        "op": lambda: op([pool], slots, [256], True),
    }
    if baseline_library is not None:
        torch.ops.load_library(baseline_library)
        baseline_op = getattr(torch.ops, BASELINE_NAMESPACE).fold
        if not torch.equal(baseline_op([pool], slots, [256], True), op([pool], slots, [256], True)):
            raise AssertionError("kv-canary: the baseline library folds differently")
        stmts["baseline op"] = lambda: baseline_op([pool], slots, [256], True)
    return {name: seconds * 1e6 for name, seconds in _interleaved_medians(stmts, "cpu", min_run_time, rounds=10).items()}


# The layers of the sources series of --call-overhead: K and V of each layer of vLLM's packed
# layout, for one layer, the ~150 M model of benchmarks/vllm_bench.py and an 80-layer model.
SOURCE_SERIES_LAYERS = (1, 12, 80)


# The reads of the sources series: each source's read_bytes (ALL: 2 KiB of K or V, whose
# folding grows with the sources), and 16 bytes (PARTIAL), where the kernel's work is small
# beside the call's and what remains is the host's cost per call.
SOURCE_SERIES_READS = {"ALL": None, "PARTIAL": 16}


def call_overhead_by_sources(min_run_time: float) -> dict[str, dict[str, dict[int, float]]]:
    """Microseconds per call of a 1-slot op over K and V of ``layers`` vLLM layers
    (`layouts.vllm`, packed ``[blocks, heads, block, 2 * head]``, 8 KV heads of 128 bf16, in
    cache), by read (SOURCE_SERIES_READS), form and number of sources. The forms:
    ``Tensor[]`` (the `fold` op, the sources passed on every call: its fixed cost grows with
    them, as each crosses into the op as a tensor and is laid out) and ``bound``
    (`fold.bound` over the table `bind_sources` made once). A step of the vLLM plugin makes a
    few such calls over every watched layer. Medians of measurements of all of them taken in
    turns, in one process."""
    from torch_kvcanary import layouts

    layers = [torch.zeros(4, 8, 32, 256, dtype=torch.bfloat16) for _ in range(max(SOURCE_SERIES_LAYERS))]
    slot = torch.tensor([5])
    op, bound_op = torch.ops.kvcanary.fold.default, torch.ops.kvcanary.fold.bound
    stmts = {}
    for read, read_size in SOURCE_SERIES_READS.items():
        for count in SOURCE_SERIES_LAYERS:
            sources = [s for layer in layers[:count] for s in layouts.vllm(layer, layout="LBHNC", backend="CPU_ATTN")]
            views, read_bytes = [s.as_view() for s in sources], [read_size or s.read_bytes for s in sources]
            table = torch.ops.kvcanary.bind_sources(views, read_bytes)
            if not torch.equal(bound_op(table, slot, True), op(views, slot, read_bytes, True)):
                raise AssertionError("kv-canary: the bound fold folds differently")
            stmts[read, "Tensor[]", len(sources)] = lambda views=views, read_bytes=read_bytes: op(views, slot, read_bytes, True)
            stmts[read, "bound", len(sources)] = lambda table=table: bound_op(table, slot, True)
    medians = _interleaved_medians(stmts, "cpu", min_run_time, rounds=10)
    figures: dict[str, dict[str, dict[int, float]]] = {read: {"Tensor[]": {}, "bound": {}} for read in SOURCE_SERIES_READS}
    for (read, form, sources), seconds in medians.items():
        figures[read][form][sources] = seconds * 1e6
    return figures


def format_by_sources(figures: dict[str, dict[str, dict[int, float]]]) -> list[str]:
    lines = []
    for read, by_form in figures.items():
        listed, bound = by_form["Tensor[]"], by_form["bound"]
        read_bytes = "each source's read_bytes" if SOURCE_SERIES_READS[read] is None else f"{SOURCE_SERIES_READS[read]} B"
        lines.append(
            f"fold op of 1 slot by number of sources (K and V of vLLM layers, in cache; {read}: {read_bytes}), us per call, Tensor[] / bound: "
            + ", ".join(f"{n} sources {listed[n]:.2f} / {bound[n]:.2f} ({listed[n] / bound[n]:.1f}x)" for n in listed)
        )
    return lines


def format_call_overhead(times: dict[str, float]) -> str:
    line = "fold of 256 slots (1 source of 256 B, in cache), us per call: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
    if "baseline op" in times:
        line += f"; op - baseline op: {times['op'] - times['baseline op']:+.2f} us"
    return line


def canary_cost(device: str, min_run_time: float) -> list[dict]:
    """`KvCanary.record` and `verify` (positions, tokens and previous slots given) beside a bare
    `fold` of the same slots and sources: K and V of 1 KiB per token over 64 Ki slots, a decode
    step (256 random slots, each its own request) and a big batch (64 Ki slots, 64 requests of
    1 Ki positions in shuffled pages)."""
    from torch_kvcanary.canary import KvCanary

    gen = torch.Generator().manual_seed(0)
    rows = 1 << 16
    pools = [torch.randint(0, 256, (rows, 1024), dtype=torch.uint8, generator=gen).to(device) for _ in range(2)]
    sources = [view_source(p.unsqueeze(1), read_bytes=1024) for p in pools]
    canary = KvCanary(sources, on_violation=None)
    rows_out = []
    for n, requests in ((256, 256), (1 << 16, 64)):
        order = torch.randperm(rows, generator=gen)
        slots = order[:n].view(requests, -1)
        prev = torch.cat([torch.full((requests, 1), -1), slots[:, :-1]], dim=1)
        if n == requests:  # decode: each entry chains through a slot of an earlier step, none this step writes
            prev = order[n : 2 * n].view(n, 1)
        positions = torch.arange(n // requests).expand(requests, -1)
        tokens = torch.randint(0, 1 << 17, (requests, n // requests), generator=gen)
        # Contiguous, as an engine's inputs are: a strided one (the decode step's positions, an
        # expanded view) would add its copy to record and verify, which the fold does not take.
        slots, prev, positions, tokens = (t.reshape(-1).contiguous().to(device) for t in (slots, prev, positions, tokens))
        inputs = {"positions": positions, "tokens": tokens, "prev_slots": prev}
        canary.record(slots, **inputs)
        # The timed calls run within this iteration, so they see its slots and inputs.
        medians = _interleaved_medians(
            {
                "fold": lambda: fold(sources, slots, check_bounds=False),  # noqa: B023
                "record": lambda: canary.record(slots, **inputs),  # noqa: B023
                "verify": lambda: canary.verify(slots, **inputs),  # noqa: B023
            },
            device, min_run_time,
        )  # fmt: skip
        rows_out.append({"device": device, "slots": n, **{f"{k}_us": v * 1e6 for k, v in medians.items()}})
    if canary.poll():
        raise AssertionError("kv-canary: the canary benchmark flagged unchanged slots")
    return rows_out


def format_canary_cost(rows: list[dict]) -> str:
    lines = [f"{'device':6} {'slots':>6} {'fold':>10} {'record':>10} {'verify':>10} {'record/fold':>11} {'verify/fold':>11}"]
    for r in rows:
        lines.append(
            f"{r['device']:6} {r['slots']:6} {r['fold_us']:8.1f}us {r['record_us']:8.1f}us {r['verify_us']:8.1f}us "
            f"{r['record_us'] / r['fold_us']:11.2f} {r['verify_us'] / r['fold_us']:11.2f}"
        )
    return "\n".join(lines)


def _xxh3_64():
    """xxhash's xxh3_64 (bytes-like to int), or None when the package is not installed."""
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest


def _pool_rows(case: Case) -> int:
    row_bytes = max(case.read_bytes, 64)
    return max(1, min(case.num_slots, _POOL_BUDGET_BYTES // (row_bytes * case.num_sources)))


def run_case(case: Case, device: str, min_run_time: float, upstream: bool = False) -> Result:
    gen = torch.Generator().manual_seed(0)
    rows = _pool_rows(case)
    row_bytes = max(case.read_bytes, 64)
    pools = [torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen).to(device) for _ in range(case.num_sources)]
    sources = [view_source(p[:, : case.read_bytes].unsqueeze(1), read_bytes=case.read_bytes) for p in pools]
    index = torch.arange(case.num_slots) % rows
    if case.order == "random":
        index = index[torch.randperm(case.num_slots, generator=gen)]
    slots = index.to(device)
    mode = HashMode[case.mode]
    run = lambda: fold(sources, slots, mode=mode, check_bounds=False)  # noqa: E731
    seconds, repeats = _median(run, device, min_run_time)
    result = Result(device, case, seconds, repeats)

    def baseline(name: str, stmt, scale: float = 1.0) -> None:
        # `scale` turns the baseline's time into its time for the bytes the fold read.
        seconds, repeats = _median(stmt, device, min_run_time)
        result.baselines[name] = seconds * scale
        result.baseline_repeats[name] = repeats

    pool_bytes = rows * row_bytes * case.num_sources
    if device == "cpu":
        stream = lambda: [p.view(torch.int64).sum() for p in pools]  # noqa: E731
    else:
        copies = [torch.empty_like(p) for p in pools]
        stream = lambda: [c.copy_(p) for c, p in zip(copies, pools)]  # noqa: E731
        pool_bytes *= 2  # a copy reads and writes
    folded_total = case.num_slots * case.bytes_per_slot
    baseline("stream", stream, scale=folded_total / pool_bytes)
    prefixes = [p[:, : case.folded_bytes] for p in pools]
    baseline("gather", lambda: [torch.index_select(p, 0, slots) for p in prefixes])
    if folded_total <= _REFERENCE_BUDGET_BYTES:
        baseline("reference", lambda: reference_fold(sources, slots, mode=mode))
    else:
        result.notes.append("reference skipped (too slow at this size)")
    xxh3 = _xxh3_64() if device == "cpu" else None
    if xxh3 is not None:
        contiguous = memoryview(torch.cat([torch.index_select(p, 0, index) for p in prefixes], 1).numpy())
        baseline("xxh3_64", lambda: xxh3(contiguous))
    elif device == "cpu":
        result.notes.append("xxh3_64 skipped (the xxhash package is not installed)")
    if upstream:
        upstream_kernel = upstream_fold(pools, case.folded_bytes)
        if not torch.equal(upstream_kernel(slots), run()):
            raise AssertionError("kv-canary: the upstream baseline disagrees with the fold")
        baseline("upstream", lambda: upstream_kernel(slots))
    return result


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: list[Result]) -> str:
    head = f"{'device':6} {'mode':7} {'rb':>5} {'slots':>8} {'src':>3} {'order':6} {'time':>10} {'GB/s':>7} {'Mslot/s':>8} {'/stream':>7} {'xgather':>7} {'xref':>7} {'/xxh3':>7} {'xupstrm':>7} {'n':>4} {'nb':>4}"
    lines = [head, "-" * len(head)]
    for r in results:
        c = r.case
        lines.append(
            f"{r.device:6} {c.mode:7} {c.read_bytes:5} {c.num_slots:8} {c.num_sources:3} {c.order:6} "
            f"{r.seconds * 1e6:8.1f}us {r.bytes_per_s / 1e9:7.2f} {r.slots_per_s / 1e6:8.1f} "
            f"{_fmt_ratio(r.ratio('stream')):>7} {_fmt_ratio(r.ratio('gather')):>7} {_fmt_ratio(r.ratio('reference')):>7} "
            f"{_fmt_ratio(r.ratio('xxh3_64')):>7} {_fmt_ratio(r.ratio('upstream')):>7} {r.repeats:4} {min(r.baseline_repeats.values()):4}"
        )
    return "\n".join(lines)


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpu_isa": torch.ops.kvcanary.cpu_isa(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def compiled_reference(case: Case, device: str, min_run_time: float) -> str:
    """torch.compile(reference_fold) on one case: its compile time, and its speed beside the
    fold's (compiling the unrolled chain takes minutes at 1 KiB rows)."""
    rows = _pool_rows(case)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (rows, max(case.read_bytes, 64)), dtype=torch.uint8, generator=gen).to(device)
    source = view_source(pool[:, : case.read_bytes].unsqueeze(1), read_bytes=case.read_bytes)
    slots = (torch.randperm(case.num_slots, generator=gen) % rows).to(device)
    mode = HashMode[case.mode]
    compiled = torch.compile(reference_fold)
    start = time.perf_counter()
    expected = compiled(source, slots, mode=mode)
    compile_s = time.perf_counter() - start
    if not torch.equal(expected, fold(source, slots, mode=mode)):
        raise AssertionError("kv-canary: the compiled reference disagrees with the fold")
    compiled_s, _ = _median(lambda: compiled(source, slots, mode=mode), device, min_run_time)
    fold_s, _ = _median(lambda: fold(source, slots, mode=mode), device, min_run_time)
    return (
        f"torch.compile(reference_fold), {case.mode} read_bytes={case.read_bytes}, {case.num_slots} slots on {device}: "
        f"{compile_s:.1f} s to compile, {compiled_s * 1e3:.2f} ms a call against {fold_s * 1e3:.2f} ms for fold "
        f"(fold {compiled_s / fold_s:.1f}x faster)"
    )


def read_bytes_series(results: list[Result], device: str, order: str) -> list[Result]:
    """The ALL-mode, one-source results of `device` and slot `order` that sweep read_bytes, one
    per read_bytes in increasing order, all at the slot count most of them share (the sweep
    also holds other slot counts at some sizes, whose pools and roofs differ)."""
    rows = [r for r in results if r.device == device and r.case.order == order and r.case.num_sources == 1 and r.case.mode == "ALL"]
    if not rows:
        return []
    num_slots = Counter(r.case.num_slots for r in rows).most_common(1)[0][0]
    return sorted((r for r in rows if r.case.num_slots == num_slots), key=lambda r: r.case.read_bytes)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for device in sorted({r.device for r in results}):
        for order in ("seq", "random"):
            rows = read_bytes_series(results, device, order)
            if rows:
                x = [r.case.read_bytes for r in rows]
                label = f"{device} {order}, {rows[0].case.num_slots} slots"
                ax.plot(x, [r.bytes_per_s / 1e9 for r in rows], marker="o", label=f"fold {label}")
                roof = [r.bytes_per_s / r.ratio("stream") / 1e9 for r in rows]
                ax.plot(x, roof, linestyle="--", label=f"stream read {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("read_bytes per slot")
    ax.set_ylabel("GB/s folded")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


@dataclass(frozen=True)
class DigestCase:
    """A paged cache of ``views`` layer halves ``[blocks, 16, heads, head_dim]`` and ``num_slots``
    slots (tokens) in random order: the digest reads each slot's units of every view, the
    fold the same bytes as one token per view."""

    name: str
    views: int
    heads: int
    head_dim: int
    dtype: str
    num_slots: int

    @property
    def unit_bytes(self) -> int:
        return self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def bytes(self) -> int:
        return self.num_slots * self.views * self.heads * self.unit_bytes


_DIGEST_ROUNDS = 3


def digest_cases(quick: bool) -> list[DigestCase]:
    """The issue's request (2048 tokens of a 32-layer, 8-KV-head, 128-dim bf16 cache: 64 K/V
    views) and one view of 64 Ki random slots for each unit size a head takes: bf16 heads of
    128 and 64 dims, fp8 heads of 128 and 64 dims (units of 256, 128 and 64 bytes)."""
    n = 4096 if quick else 1 << 16
    return [
        DigestCase("request 2048 tok x 32 layers", 8 if quick else 64, 8, 128, "bfloat16", 256 if quick else 2048),
        DigestCase("bf16 units of 256 B", 1, 8, 128, "bfloat16", n),
        DigestCase("bf16 units of 128 B", 1, 8, 64, "bfloat16", n),
        DigestCase("fp8 units of 128 B", 1, 8, 128, "float8_e4m3fn", n),
        DigestCase("fp8 units of 64 B", 1, 8, 64, "float8_e4m3fn", n),
    ]


def digest_beside_fold(case: DigestCase, device: str, min_run_time: float) -> dict:
    """The digest's and the fold's byte rates over the same slots and bytes, and on CUDA a
    device copy of as many bytes (its rate counts bytes read plus written, as the fold's
    stream baseline does)."""
    from torch_kvcanary.digest import kv_digest

    gen = torch.Generator().manual_seed(0)
    page = 16
    blocks = -(-case.num_slots // page) + 8  # the request's pages and a few more
    dtype = getattr(torch, case.dtype)
    shape = (blocks, page, case.heads, case.unit_bytes)
    views = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device).view(dtype) for _ in range(case.views)]
    pages = torch.randperm(blocks, generator=gen)[: -(-case.num_slots // page)]
    slots = (pages.repeat_interleave(page) * page + torch.arange(page).repeat(len(pages)))[: case.num_slots]
    slots = slots[torch.randperm(case.num_slots, generator=gen)].to(device)
    positions = torch.arange(case.num_slots, device=device)
    sources = [view_source(v.view(torch.uint8), read_bytes=case.heads * case.unit_bytes) for v in views]
    offsets = [j * case.heads for j in range(case.views)]
    digest = lambda: kv_digest(views, slots, positions, unit_offsets=offsets)  # noqa: E731
    folded = lambda: fold(sources, slots, check_bounds=False)  # noqa: E731
    row = {"case": asdict(case), "device": device, "bytes": case.bytes}
    # alternate the two so that a busy machine slows both alike
    times = {"digest": [], "fold": []}
    for _ in range(_DIGEST_ROUNDS):
        for name, fn in (("digest", digest), ("fold", folded)):
            times[name].append(_median(fn, device, min_run_time / _DIGEST_ROUNDS)[0])
    row["digest_s"], row["fold_s"] = min(times["digest"]), min(times["fold"])
    if device == "cuda":
        src = torch.empty(case.bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        row["copy_s"] = _median(lambda: dst.copy_(src), device, min_run_time)[0]
    return row


def format_digest_table(rows: list[dict]) -> str:
    head = f"{'device':6} {'case':30} {'MiB':>6} {'digest GB/s':>11} {'fold GB/s':>9} {'digest/fold':>11} {'digest/copy':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:

        def rate(seconds: float, r=r) -> float:
            return r["bytes"] / seconds / 1e9

        copy = f"{rate(r['digest_s']) / (2 * rate(r['copy_s'])):.2f}" if "copy_s" in r else "-"
        lines.append(
            f"{r['device']:6} {r['case']['name']:30} {r['bytes'] / 2**20:6.0f} {rate(r['digest_s']):11.2f} {rate(r['fold_s']):9.2f} "
            f"{r['fold_s'] / r['digest_s']:11.2f} {copy:>11}"
        )
    return "\n".join(lines)


def digest_main(args: argparse.Namespace, devices: list[str], info: dict) -> int:
    rows = [digest_beside_fold(case, device, args.min_run_time) for device in devices for case in digest_cases(args.quick)]
    print(format_digest_table(rows))
    print(
        "each time is the least of three medians of blocked_autorange measurements, the digest and the fold taken in turn; "
        "digest/fold is the ratio of their byte rates, digest/copy the digest's rate over a device copy's (bytes read plus written)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "digest": rows}, f, indent=1)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.plot:
        import matplotlib  # noqa: F401  (fail before measuring, not after)
    devices = args.device or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), file=sys.stderr)
    if args.digest:
        return digest_main(args, devices, info)
    if args.call_overhead:
        times = call_overhead(args.min_run_time, args.baseline_library)
        by_sources = call_overhead_by_sources(args.min_run_time)
        print(format_call_overhead(times))
        print("\n".join(format_by_sources(by_sources)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": info, "call_overhead_us": times, "fold_op_us_by_sources": by_sources}, f, indent=1)
        return 0
    plan = [(d, c) for d in devices for c in (goal_cases(d) if args.goals else default_cases(args.quick))]
    results = []
    for device, case in plan:
        print(
            f"[{len(results) + 1}/{len(plan)}] {device} {case.mode} rb={case.read_bytes} slots={case.num_slots} sources={case.num_sources} {case.order}",
            file=sys.stderr,
            flush=True,
        )
        results.append(run_case(case, device, args.min_run_time, upstream=args.upstream and device == "cuda"))
    graph = cuda_graph_decode() if "cuda" in devices else None
    canary = [row for d in devices for row in canary_cost(d, args.min_run_time)] if args.canary else None
    compile_note = None
    if args.compile_reference:
        case = Case("ALL", args.compile_reference, 65536, 1, "random")
        compile_note = compiled_reference(case, devices[0], args.min_run_time)
    print(format_table(results))
    print(
        "each figure is a median of blocked_autorange measurements: n of them for the fold, at least nb for each baseline (each count is in --json); "
        "/stream and /xxh3 are the fold's byte rate over a plain read's and over xxh3_64's (one thread, the same bytes laid out contiguously), x* are speed-ups over the baselines"
    )
    if compile_note:
        print(compile_note)
    if canary:
        print("canary cost: K and V of 1 KiB per token (medians of measurements taken in turns)")
        print(format_canary_cost(canary))
    if graph:
        print(
            f"decode step (256 slots, 4 sources of 256 bytes) replayed from a CUDA graph: {graph['decode_fold_us']:.2f} us; "
            f"a graph of one trivial kernel: {graph['launch_floor_us']:.2f} us"
        )
    if args.json:
        payload = {
            "machine": info,
            "results": [{**asdict(r), "bytes_per_s": r.bytes_per_s, "slots_per_s": r.slots_per_s} for r in results],
            "compile_reference": compile_note,
            "cuda_graph_decode": graph,
            "canary_cost": canary,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", action="append", choices=["cpu", "cuda"], help="default: cpu, and cuda when present")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement (default 0.5)")
    parser.add_argument("--json", metavar="FILE", help="write the raw figures")
    parser.add_argument("--plot", metavar="FILE.png", help="draw GB/s against read_bytes (needs matplotlib)")
    parser.add_argument(
        "--compile-reference", type=int, metavar="READ_BYTES", help="also time torch.compile of the reference at this row size"
    )
    parser.add_argument("--goals", action="store_true", help="measure the cases the goals are stated for instead of the sweep")
    parser.add_argument("--canary", action="store_true", help="also time KvCanary.record and verify beside a bare fold")
    parser.add_argument("--digest", action="store_true", help="instead: the transfer digest beside the fold over the same slots and bytes")
    parser.add_argument("--no-upstream", dest="upstream", action="store_false", help="skip the CUDA upstream-style baseline kernel")
    parser.add_argument(
        "--call-overhead",
        action="store_true",
        help="instead: microseconds per call of a fold of 256 slots on the CPU (in cache), and of a 1-slot fold op by number of sources",
    )
    parser.add_argument(
        "--baseline-library",
        metavar="SO",
        help=f"with --call-overhead: also time the op of this build of the op library (namespace {BASELINE_NAMESPACE}, see tools/overhead_ab.sh)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
