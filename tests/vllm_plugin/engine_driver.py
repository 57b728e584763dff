"""The vLLM tests' engine driver: a tiny engine of vLLM's CPU build started in-process with the
plugin and a KV space small enough to share, split and preempt (`started_engine`), kept for the
next test of the same configuration (`ENGINES`), the plugin's log lines (`Lines`,
`parse_violations`), requests stepped one engine step at a time with faults injected between
steps (`Driver`), and the mixed workload every engine kind must serve without a report
(`mixed_workload`)."""

import contextlib
import io
import logging
import os
import random
import re
import sys

import vllm

from torch_kvcanary.integrations.vllm import config, plugin

BLOCK_SIZE = 32
NUM_BLOCKS = 24
PER_STEP = 64
# A violation line's reasons, slot and requests, anywhere in a line (`VIOLATION`) or as the whole message (`LINE`).
VIOLATION = re.compile(r"kv_canary violation: launch_tag=vllm fail_reason=(\S+) slot_idx=(\d+) .* request_id=(\S+)$")
LINE = re.compile("^" + VIOLATION.pattern)
SUMMARY = re.compile(
    r"^kv_canary summary: launch_tag=vllm seconds=\S+ repeated_detections=(\d+) repeated_slots=(\d+) slots_logged=(\d+) ring_dropped=(\d+)$"
)

# The KV cache budget: NUM_BLOCKS blocks of K and V (2 layers, 2 KV heads of 64 bf16) and the
# canary over them (a record of four int64 and an int64 owner tag per slot; a ring of 1024
# rows of eight int64 with an origin of three each, and its counters, which need far less
# than a block of slack).
KV_BYTES_PER_SLOT = 2 * 2 * 2 * 64 * 2
CANARY_BYTES_PER_SLOT = 5 * 8
KV_BUDGET = NUM_BLOCKS * BLOCK_SIZE * (KV_BYTES_PER_SLOT + CANARY_BYTES_PER_SLOT) + 1024 * 11 * 8 + 4096


class Lines(logging.Handler):
    """The plugin's WARNING and ERROR records."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [record.getMessage() for record in self.records]

    def take(self) -> list[str]:
        lines, self.records = self.lines, []
        return lines


class _LogStream(io.StringIO):
    """A captured ``sys.stdout`` whose file descriptor is the process's: vLLM 0.30 and 0.31
    silence C libraries at that descriptor (``suppress_stdout``) while they start."""

    def fileno(self) -> int:
        return sys.__stdout__.fileno()


@contextlib.contextmanager
def vllm_log():
    """What vLLM's own log handler writes meanwhile. vLLM configures its logging when an
    engine starts, with a handler named "vllm" on ``sys.stdout``, or has done so already
    (pytest's capture handlers, which it attaches to the non-propagating ``vllm`` logger
    too, keep their streams)."""
    log = _LogStream()
    streams = {handler: handler.setStream(log) for handler in logging.getLogger("vllm").handlers if handler.name == "vllm"}
    try:
        with contextlib.redirect_stdout(log):
            yield log
    finally:
        for handler in logging.getLogger("vllm").handlers:
            if getattr(handler, "stream", None) is log:
                handler.setStream(streams.get(handler, sys.stdout))


class EnginePool:
    """In-process engines kept across tests, one at a time: vLLM keeps one engine's state per
    process (its worker's KV connector, its distributed state), so a pooled engine is shut
    down before any other starts. `get` hands the running engine to a test that asks for the
    same configuration, and starts the one asked for otherwise; tests that share one take
    request ids and prompts of their own and read counters as deltas."""

    def __init__(self):
        self._key = None
        self._engine = None
        self._stack: contextlib.ExitStack | None = None

    def get(self, key, start):
        """The engine of configuration ``key`` (any equality-comparable value that names
        everything the engine is started with), started by the context manager ``start()``
        where another (or none) runs."""
        if self._stack is None or key != self._key:
            self.close()
            stack = contextlib.ExitStack()
            self._engine = stack.enter_context(start())
            self._key, self._stack = key, stack
        return self._engine

    def close(self) -> None:
        """Shuts the pooled engine down, if one runs."""
        stack, self._stack, self._key, self._engine = self._stack, None, None, None
        if stack is not None:
            stack.close()


ENGINES = EnginePool()


@contextlib.contextmanager
def started_engine(model, *, kv_budget: int = KV_BUDGET, policy: str = "log", environ: dict[str, str] | None = None, **options):
    """An in-process engine on ``model`` with the plugin on under ``policy`` (it, the
    plugin's other variables of ``environ`` and vLLM's in-process switch set while it
    starts, and only then), and the plugin's WARNING and ERROR lines (`Lines`) and the
    requests vLLM preempts meanwhile: (llm, lines, preemptions). ``options`` override the engine's (prefix caching and chunked prefill of
    `PER_STEP` tokens a step in blocks of `BLOCK_SIZE`); ``llm.startup_log`` is what vLLM
    logged while it started."""
    from vllm.v1.core.sched.scheduler import Scheduler

    ENGINES.close()  # no pooled engine runs beside this one
    preemptions = []
    preempt = Scheduler._preempt_request

    def counting_preempt(self, request, *args, **kwargs):
        preemptions.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    environ = environ or {}
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", config.POLICY_ENV, config.SUMMARY_ENV, *environ)}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ[config.POLICY_ENV] = policy
    # A summary line only where a test asks for one (`Reports.interval`): with the default
    # of 60 s one would come whenever a slow run of a test passed a minute.
    os.environ[config.SUMMARY_ENV] = "86400"
    os.environ.update(environ)
    Scheduler._preempt_request = counting_preempt
    lines = Lines()
    llm = None
    settings = dict(
        dtype="bfloat16",
        max_model_len=512,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_budget,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=PER_STEP,
        max_num_seqs=8,
    )
    try:
        try:
            with vllm_log() as startup_log:
                llm = vllm.LLM(model=str(model), **{**settings, **options})
        finally:
            # Read at the start alone: a pooled engine that goes on running must not hand them
            # to the servers and processes the next tests start.
            _restore(saved)
        llm.startup_log = startup_log.getvalue()
        plugin.logger.addHandler(lines)  # once vLLM has configured its logging, which clears its children's handlers
        yield llm, lines, preemptions
    finally:
        Scheduler._preempt_request = preempt
        plugin.logger.removeHandler(lines)
        # Another engine may start in this process: this one's state goes, also after a start that failed.
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ensure_kv_transfer_shutdown()  # vLLM builds a worker's KV connector once per process
        cleanup_dist_env_and_memory()


def _restore(saved: dict[str, str | None]) -> None:
    """Sets each variable of ``saved`` back to its value (None: unset)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def sampling_params(max_tokens: int, kind: int = 0):
    settings = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.3, top_k=20, repetition_penalty=1.2)]
    return vllm.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **settings[kind % 3])


def parse_violations(lines):
    parsed = []
    for line in lines:
        match = LINE.match(line)
        assert match, f"not a violation line: {line}"
        parsed.append((match.group(1).split("+"), int(match.group(2)), match.group(3).split(",")))
    return parsed


class Driver:
    """Adds requests and steps the engine, one step at a time."""

    def __init__(self, llm, name: str):
        self.llm, self.name = llm, name
        self.engine = llm.llm_engine
        self.ids: list[str] = []

    def add(self, prompt: list[int], params) -> str:
        request_id = f"{self.name}-{len(self.ids)}"
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        self.ids.append(request_id)
        return request_id

    def step(self) -> list:
        return self.engine.step()

    def run_until_decoding(self, max_steps: int = 40) -> None:
        """Steps until every request of this driver is running and has decoded a few tokens."""
        state = plugin.active()
        for _ in range(max_steps):
            self.step()
            rows = self.rows()
            if len(rows) == len(self.ids) and all(
                state.model_runner.input_batch.num_computed_tokens_cpu[row] >= 2 * BLOCK_SIZE + 4 for row in rows.values()
            ):
                return
        raise AssertionError(f"requests {self.ids} did not all reach decoding")

    def rows(self) -> dict[str, int]:
        """vLLM's internal id (ours plus a suffix) -> input-batch row, for our running requests."""
        batch = plugin.active().model_runner.input_batch
        return {rid: row for row, rid in enumerate(batch.req_ids) if rid is not None and rid.rsplit("-", 1)[0] in self.ids}

    def internal_id(self, request_id: str) -> str:
        return next(rid for rid in self.rows() if rid.rsplit("-", 1)[0] == request_id)

    def blocks(self, request_id: str, group: int = 0) -> list[int]:
        """The request's blocks in watched KV cache group ``group``."""
        table = plugin.active().groups[group].block_table
        row = self.rows()[self.internal_id(request_id)]
        return table.block_table.np[row, : table.num_blocks_per_row[row]].tolist()

    def context(self, request_id: str) -> int:
        """The tokens of the request in the KV cache."""
        return int(plugin.active().model_runner.input_batch.num_computed_tokens_cpu[self.rows()[self.internal_id(request_id)]])

    def finish(self) -> None:
        self.engine.abort_request(self.ids)
        for _ in range(3):
            self.step()
        self.llm.reset_prefix_cache()


def mixed_workload(llm, lines, preemptions, params=sampling_params) -> None:
    """Ten requests sharing a prefix of two blocks, with prompts longer than a step's tokens
    and more KV than the cache holds: the canary verifies every step and reports nothing,
    while the prefix cache is hit (where vLLM keeps prefix caching on for the model), prompts
    are chunked and requests preempted. ``params``
    gives request ``i``'s sampling (`sampling_params` by default: greedy and random, in turns)."""
    state = plugin.active()
    before = state.canary.stats()
    shared = []
    begin_step = state.begin_step

    def watching(*args, **kwargs):
        batch = begin_step(*args, **kwargs)
        for group in state.groups:
            tables, counts = group.block_table.block_table.np, group.block_table.num_blocks_per_row
            # Block 0 is vLLM's null block, which stands for the blocks a window has freed.
            seen = [set(tables[r, : max(counts[r] - 1, 0)].tolist()) - {0} for r in range(len(batch.forward.request_ids))]
            shared.append(max((len([s for s in seen if b in s]) for s in seen for b in s), default=0))
        return batch

    state.begin_step = watching
    try:
        rng = random.Random(1)
        prefix = random_tokens(rng, 2 * BLOCK_SIZE + 5)  # two full blocks shared by every request
        prompts = [prefix + random_tokens(rng, 10 + 23 * i) for i in range(10)]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], [params(60 + 25 * (i % 4), i) for i in range(10)], use_tqdm=False
        )
    finally:
        state.begin_step = begin_step
    assert [len(o.outputs[0].token_ids) for o in outputs] == [60 + 25 * (i % 4) for i in range(10)]
    after = state.canary.stats()
    assert lines.take() == []
    assert after["violations"] == before["violations"] == 0
    assert after["slots_verified"] - before["slots_verified"] > 10_000
    assert preemptions, "the KV space was meant to be small enough to preempt"
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        assert max(shared) >= 2, "the shared prefix was meant to hit the prefix cache"
    else:  # vLLM turns it off for some models on some hosts (tests/helpers.py, ISA_SKIP_REASONS)
        assert max(shared) == 1, "without prefix caching no block lies in two requests' tables"
    assert max(len(p) for p in prompts) > PER_STEP  # chunked prefill


def decoding(llm, lines: Lines, label: str, prompts: list[list[int]], params: list) -> Driver:
    """A driver whose requests (a prompt and a sampling each) all run and decode, with no
    report on the way: where a test injects its fault."""
    driver = Driver(llm, label)
    for prompt, sampling in zip(prompts, params, strict=True):
        driver.add(prompt, sampling)
    driver.run_until_decoding()
    assert lines.take() == []
    return driver


def flip_victim(llm, lines: Lines, length: int) -> tuple[Driver, str]:
    """Three requests (prompts of ``length`` tokens and more; greedy and random sampling)
    decoding, and the one whose KV a test flips a bit of: the second."""
    rng = random.Random(2)
    prompts = [random_tokens(rng, length + 9 * i) for i in range(3)]
    driver = decoding(llm, lines, "flip", prompts, [sampling_params(200, i) for i in range(3)])
    return driver, driver.ids[1]


def flip_reported(lines: Lines, driver: Driver, victim: str, block: int, block_size: int) -> list:
    """The violations (`parse_violations`) of the step after a bit of ``victim``'s block
    ``block`` was flipped: at least one, each by the bytes alone, in that block, naming the
    victim alone."""
    found = parse_violations(lines.take())
    assert found, "the flipped bit was not reported"
    for reasons, slot, requests in found:
        assert reasons == ["verify_real_kv_hash"] and slot // block_size == block, (reasons, slot)
        assert requests == [driver.internal_id(victim)], requests
    return found


def assert_a_wrong_block_entry(found, request_id: str) -> None:
    """``found`` (`parse_violations`) after a block-table entry of ``request_id`` pointed at
    another request's block, bytes intact: named by that request alone, by token and chain,
    never by the bytes."""
    assert found, "the wrong block table entry was not reported"
    assert {r for _, _, requests in found for r in requests} == {request_id}
    reasons = {r for found_reasons, _, _ in found for r in found_reasons}
    assert "verify_token" in reasons and "verify_chain_hash" in reasons
    assert "verify_real_kv_hash" not in reasons  # every byte is intact
