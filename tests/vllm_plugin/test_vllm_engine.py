"""The vLLM plugin on the real engine (vLLM's CPU build), in-process and driven step by step.

One engine serves the module: a tiny random Llama with a KV space of 24 blocks of 32 slots,
prefix caching, and chunked prefill of 64 tokens a step, so a mixed workload shares blocks,
splits prompts and preempts requests. Faults are injected between ``llm_engine.step()``
calls and must be reported at the next step, naming the request.
"""

import contextlib
import io
import logging
import os
import random
import re
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")


import torch_kvcanary as kc  # noqa: E402
from torch_kvcanary.integrations.vllm import adapter, config, plugin, worker  # noqa: E402

BLOCK_SIZE = 32
NUM_BLOCKS = 24
PER_STEP = 64
LINE = re.compile(r"^kv_canary violation: launch_tag=vllm fail_reason=(\S+) slot_idx=(\d+) .* request_id=(\S+)$")
SUMMARY = re.compile(
    r"^kv_canary summary: launch_tag=vllm seconds=\S+ repeated_detections=(\d+) repeated_slots=(\d+) slots_logged=(\d+) ring_dropped=(\d+)$"
)

# The KV cache budget: NUM_BLOCKS blocks of K and V (2 layers, 2 KV heads of 64 bf16) and the
# canary over them (a record of four int64 and an int64 owner tag per slot; a ring of 1024
# rows of eight int64, and its counters, which need far less than a block of slack).
KV_BYTES_PER_SLOT = 2 * 2 * 2 * 64 * 2
CANARY_BYTES_PER_SLOT = 5 * 8
KV_BUDGET = NUM_BLOCKS * BLOCK_SIZE * (KV_BYTES_PER_SLOT + CANARY_BYTES_PER_SLOT) + 1024 * 8 * 8 + 4096


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


@contextlib.contextmanager
def vllm_log():
    """What vLLM's own log handler writes meanwhile. vLLM configures its logging when an
    engine starts, with a handler named "vllm" on ``sys.stdout``, or has done so already
    (pytest's capture handlers, which it attaches to the non-propagating ``vllm`` logger
    too, keep their streams)."""
    log = io.StringIO()
    streams = {handler: handler.setStream(log) for handler in logging.getLogger("vllm").handlers if handler.name == "vllm"}
    try:
        with contextlib.redirect_stdout(log):
            yield log
    finally:
        for handler in logging.getLogger("vllm").handlers:
            if handler.stream is log:
                handler.setStream(streams.get(handler, sys.stdout))


@contextlib.contextmanager
def started_engine(model, *, kv_budget: int = KV_BUDGET, policy: str = "log", environ: dict[str, str] | None = None, **options):
    """An in-process engine on ``model`` with the plugin on under ``policy`` (and the
    plugin's other variables of ``environ`` set while it starts), and the plugin's
    WARNING and ERROR lines (`Lines`) and the requests vLLM preempts meanwhile: (llm, lines,
    preemptions). ``options`` override the engine's (prefix caching and chunked prefill of
    `PER_STEP` tokens a step in blocks of `BLOCK_SIZE`); ``llm.startup_log`` is what vLLM
    logged while it started."""
    from vllm.v1.core.sched.scheduler import Scheduler

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
        with vllm_log() as startup_log:
            llm = vllm.LLM(model=str(model), **{**settings, **options})
        llm.startup_log = startup_log.getvalue()
        plugin.logger.addHandler(lines)  # once vLLM has configured its logging, which clears its children's handlers
        yield llm, lines, preemptions
    finally:
        Scheduler._preempt_request = preempt
        plugin.logger.removeHandler(lines)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # Another engine may start in this process: this one's state goes, also after a start that failed.
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ensure_kv_transfer_shutdown()  # vLLM builds a worker's KV connector once per process
        cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with started_engine(tiny_llama) as started:
        yield started


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def _params(max_tokens: int, kind: int = 0):
    settings = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.3, top_k=20, repetition_penalty=1.2)]
    return vllm.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **settings[kind % 3])


def _parse(lines):
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


def test_the_plugin_watches_every_layer(engine):
    llm, _, _ = engine
    state = plugin.active()
    assert state is not None and state.policy == "log"
    runner = state.model_runner
    context = runner.compilation_config.static_forward_context
    names = [n for n in context if hasattr(context[n], "kv_cache") and isinstance(context[n].kv_cache, torch.Tensor)]
    assert len(state.kv_caches) == 2 and {t.data_ptr() for t in state.kv_caches} == {context[n].kv_cache.data_ptr() for n in names}
    assert state.canary.capacity == NUM_BLOCKS * BLOCK_SIZE
    # K and V of each layer, views of vLLM's tensors (no copy).
    assert len(state.canary.sources) == 4
    for source, kv in zip(state.canary.sources, [t for t in state.kv_caches for _ in "KV"]):
        assert source.as_view().untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    assert runner.cache_config.get_resolved_kv_cache_layout().name == "LBHNC"


def test_the_canary_memory_is_taken_from_the_kv_cache_budget(engine):
    # KV_BUDGET holds NUM_BLOCKS blocks and their canary; without the canary it would hold
    # more blocks, and vLLM would size the cache by them.
    llm, _, _ = engine
    state = plugin.active()
    assert KV_BUDGET // (BLOCK_SIZE * KV_BYTES_PER_SLOT) > NUM_BLOCKS
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == NUM_BLOCKS
    assert sum(kv.nbytes for kv in state.kv_caches) == NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_SLOT
    assert sum(kv.nbytes for kv in state.kv_caches) + state.canary.nbytes <= KV_BUDGET


def test_the_start_line_is_in_vllms_log(engine):
    llm, _, _ = engine
    state = plugin.active()
    watching = [line for line in llm.startup_log.splitlines() if "kv-canary: watching" in line]
    (line,) = watching  # vLLM's format: process and pid, level, time, file and line
    pattern = (
        r"^\(\w+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[worker\.py:\d+\] kv-canary: watching "
        r"vllm\.v1\.worker\.cpu_model_runner\.CPUModelRunner: 1 KV cache group \(FullAttentionSpec\), 2 layers \(2 caches, LBHNC\), "
        rf"{NUM_BLOCKS * BLOCK_SIZE} slots in blocks of {BLOCK_SIZE}; mode ALL, policy log; "
        r"the canary holds (\d+\.\d) KiB \(40 B per slot\), taken from the (\d+\.\d) KiB this worker found for the KV cache$"
    )
    match = re.match(pattern, line)
    assert match, line
    assert float(match[1]) == round(state.canary.nbytes / 1024, 1) and float(match[2]) == round(KV_BUDGET / 1024, 1)


def test_the_runners_the_plugin_watches(engine):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert adapter.unwatchable(plugin.active().model_runner) is None

    class OwnSteps(CPUModelRunner):  # the hooks are the instance's own: they wrap overrides too
        def _model_forward(self, *args, **kwargs):
            return super()._model_forward(*args, **kwargs)

        def sample_tokens(self, *args, **kwargs):
            return super().sample_tokens(*args, **kwargs)

    assert adapter.unwatchable(object.__new__(OwnSteps)) is None
    assert "cannot watch builtins.object: it watches vLLM's Model Runner V1" in adapter.unwatchable(object())


def mixed_workload(llm, lines, preemptions, params=_params) -> None:
    """Ten requests sharing a prefix of two blocks, with prompts longer than a step's tokens
    and more KV than the cache holds: the canary verifies every step and reports nothing,
    while the prefix cache is hit (where vLLM keeps prefix caching on for the model), prompts
    are chunked and requests preempted. ``params``
    gives request ``i``'s sampling (`_params` by default: greedy and random, in turns)."""
    state = plugin.active()
    before = state.canary.stats()
    shared = []
    begin_step = state.begin_step

    def watching(*args, **kwargs):
        batch = begin_step(*args, **kwargs)
        for group in state.groups:
            tables, counts = group.block_table.block_table.np, group.block_table.num_blocks_per_row
            # Block 0 is vLLM's null block, which stands for the blocks a window has freed.
            seen = [set(tables[r, : max(counts[r] - 1, 0)].tolist()) - {0} for r in range(len(batch.req_ids))]
            shared.append(max((len([s for s in seen if b in s]) for s in seen for b in s), default=0))
        return batch

    state.begin_step = watching
    try:
        rng = random.Random(1)
        prefix = _tokens(rng, 2 * BLOCK_SIZE + 5)  # two full blocks shared by every request
        prompts = [prefix + _tokens(rng, 10 + 23 * i) for i in range(10)]
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


def test_a_mixed_workload_raises_no_false_alarm(engine):
    mixed_workload(*engine)


@pytest.fixture
def token_copy(engine, monkeypatch):
    """The canary checks tokens against its device copy of the token history
    (`worker.TokenCopy`), as where Model Runner V1 keeps its history on the host (a GPU);
    here the device is the CPU, and vLLM's own history is the oracle."""
    state = plugin.active()
    copy = worker.TokenCopy(*state.runner_view.token_rows, state.canary.device)
    monkeypatch.setattr(state, "_token_copy", copy)
    return copy


def _assert_copy_holds_vllms_history(copy: worker.TokenCopy) -> None:
    """Each running request's context in the copy is what vLLM's host history holds."""
    batch = plugin.active().model_runner.input_batch
    rows = [row for row, request_id in enumerate(batch.req_ids) if request_id is not None]
    assert rows
    for row in rows:
        context = int(batch.num_computed_tokens_cpu[row])
        assert copy.tokens[row, :context].tolist() == batch.token_ids_cpu_tensor[row, :context].tolist(), row


def test_a_mixed_workload_checked_against_a_token_copy_raises_no_false_alarm(engine, token_copy):
    # Requests join, finish and move rows (vLLM condenses its batch), are preempted and resumed.
    mixed_workload(*engine)
    assert (token_copy.tokens >= 0).any()


def test_a_flipped_bit_names_its_request(engine):
    llm, lines, _ = engine
    driver = Driver(llm, "flip")
    rng = random.Random(2)
    for i in range(3):
        driver.add(_tokens(rng, 70 + 9 * i), _params(200, i))
    driver.run_until_decoding()
    assert lines.take() == []
    victim = driver.ids[1]
    block = driver.blocks(victim)[1]
    layer = plugin.active().kv_caches[1]
    layer.view(torch.int16)[block, 1, 5, 77] ^= 1 << 9  # one bit of head 1
    driver.step()
    found = _parse(lines.take())
    assert found, "the flipped bit was not reported"
    for reasons, slot, requests in found:
        assert reasons == ["verify_real_kv_hash"] and slot // BLOCK_SIZE == block and requests == [driver.internal_id(victim)]
    # Read again at every later step: counted, and summed up in a summary line, not repeated.
    state = plugin.active()
    later_steps = 6
    for _ in range(later_steps):
        driver.step()
    assert lines.take() == []
    interval, state.reports.interval = state.reports.interval, 0.0
    try:
        driver.step()
    finally:
        state.reports.interval = interval
    (summary,) = lines.take()
    repeated, slots, logged, dropped = map(int, SUMMARY.match(summary).groups())
    assert (repeated, slots, dropped) == ((later_steps + 1) * len(found), len(found), 0) and logged >= len(found)
    driver.finish()


def test_sampled_verification_finds_a_flipped_bit_within_every_steps(engine):
    # KVCANARY_VLLM_EVERY=4: bits flipped at once in 4 older blocks of a decoding request are
    # each found within 4 steps, one block in its turn at each step.
    llm, lines, _ = engine
    state = plugin.active()
    driver = Driver(llm, "sampled")
    driver.add(_tokens(random.Random(11), 5 * BLOCK_SIZE + 3), _params(200))
    driver.run_until_decoding()
    assert lines.take() == []
    every = 4
    blocks = driver.blocks(driver.ids[0])[:every]  # not the newest block, which every step verifies
    cells = [state.kv_caches[0].view(torch.int16)[block, 0, 3] for block in blocks]
    latencies: dict[int, int] = {}
    state.every = every
    try:
        for cell in cells:
            cell[3] ^= 1
        for step in range(1, 2 * every + 1):
            driver.step()
            for _, slot, requests in _parse(lines.take()):
                assert slot // BLOCK_SIZE in blocks and requests == [driver.internal_id(driver.ids[0])]
                latencies.setdefault(slot // BLOCK_SIZE, step)
    finally:
        state.every = 1
        for cell in cells:
            cell[3] ^= 1  # restored: the slots read clean again
    assert sorted(latencies) == sorted(blocks), f"reported blocks {sorted(latencies)} of {blocks}"
    assert sorted(latencies.values()) == list(range(1, every + 1)), latencies
    driver.step()
    assert lines.take() == []
    driver.finish()


def test_a_flipped_bit_in_the_unwritten_rows_of_a_last_block(engine):
    # CPU_ATTN packs a block's tokens across its rows: the rows of slots not yet written
    # already hold bytes of the written ones, and are watched too.
    llm, lines, _ = engine
    driver = Driver(llm, "tail")
    driver.add(_tokens(random.Random(6), 2 * BLOCK_SIZE + 3), _params(200, 2))
    state = plugin.active()
    for _ in range(4):  # the prompt's two chunks, then a decode step or two
        driver.step()
        victim = driver.internal_id(driver.ids[0])
        length = state.model_runner.input_batch.num_computed_tokens_cpu[driver.rows()[victim]]
        if length > 2 * BLOCK_SIZE:
            break
    assert 2 * BLOCK_SIZE < length < 3 * BLOCK_SIZE - 4
    last = driver.blocks(driver.ids[0])[-1]
    assert lines.take() == []
    state.kv_caches[0].view(torch.int16)[last, 0, BLOCK_SIZE - 1, 3] ^= 1 << 14
    driver.step()
    found = _parse(lines.take())
    assert found and all(slot // BLOCK_SIZE == last and requests == [victim] for _, slot, requests in found)
    driver.finish()


def test_a_block_table_pointing_at_another_requests_block(engine):
    _block_table_pointing_at_another_requests_block(*engine)


def _block_table_pointing_at_another_requests_block(llm, lines, _) -> None:
    driver = Driver(llm, "table")
    rng = random.Random(3)
    for _ in range(2):
        driver.add(_tokens(rng, 75), _params(200, 0))
    driver.run_until_decoding()
    assert lines.take() == []
    victim, other = driver.ids
    state = plugin.active()
    row = driver.rows()[driver.internal_id(victim)]
    own = state.block_table.block_table.np[row, 1]
    state.block_table.block_table.np[row, 1] = driver.blocks(other)[1]  # bytes intact
    driver.step()
    found = _parse(lines.take())
    state.block_table.block_table.np[row, 1] = own
    assert found, "the wrong block table entry was not reported"
    assert {r for reasons, _, requests in found for r in requests} == {driver.internal_id(victim)}
    reasons = {r for found_reasons, _, _ in found for r in found_reasons}
    assert "verify_token" in reasons and "verify_chain_hash" in reasons
    assert "verify_real_kv_hash" not in reasons  # every byte is intact
    driver.finish()


def test_a_token_copy_follows_the_requests_and_catches_a_wrong_block(engine, token_copy):
    llm, lines, _ = engine
    driver = Driver(llm, "copy")
    rng = random.Random(21)
    for i in range(4):
        driver.add(_tokens(rng, 50 + 20 * i), _params(60 + 40 * i, 0))
    driver.run_until_decoding()
    for _ in range(3):
        driver.step()
        _assert_copy_holds_vllms_history(token_copy)
    driver.engine.abort_request([driver.ids[0]])  # its row empties; vLLM moves a later request into it
    for _ in range(3):
        driver.step()
        _assert_copy_holds_vllms_history(token_copy)
    assert lines.take() == []
    driver.finish()
    _block_table_pointing_at_another_requests_block(*engine)


def test_a_block_freed_and_rewritten_while_still_read(engine):
    llm, lines, _ = engine
    driver = Driver(llm, "reuse")
    rng = random.Random(4)
    for _ in range(2):
        driver.add(_tokens(rng, 80), _params(200, 1))
    driver.run_until_decoding()
    assert lines.take() == []
    victim = driver.ids[0]
    state = plugin.active()
    block = driver.blocks(victim)[0]
    # Another request's prefill lands in the block: new bytes, recorded as its tokens.
    slots = torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
    for kv in state.kv_caches:
        kv[block] = torch.randn_like(kv[block])
    positions = torch.arange(BLOCK_SIZE)
    state.canary.record(
        slots, positions=positions, tokens=torch.full_like(slots, 7), prev_slots=torch.cat([torch.tensor([-1]), slots[:-1]])
    )
    driver.step()
    found = _parse(lines.take())
    assert found, "the rewritten block was not reported"
    assert {r for _, _, requests in found for r in requests} == {driver.internal_id(victim)}
    assert {slot // BLOCK_SIZE for _, slot, _ in found} == {block, driver.blocks(victim)[1]}  # and the chain into the next block
    assert "verify_token" in {r for reasons, _, _ in found for r in reasons}
    driver.finish()


def test_a_block_another_request_writes_while_still_read(engine):
    # The engine itself rewrites the block: the writer's block table points its current
    # block at the victim's first block, so the writer's next token lands there in the same
    # forward that reads it for the victim.
    llm, lines, _ = engine
    driver = Driver(llm, "steal")
    rng = random.Random(7)
    for i in range(2):
        driver.add(_tokens(rng, 70 + 5 * i), _params(200, 0))
    driver.run_until_decoding()
    assert lines.take() == []
    victim, writer = (driver.internal_id(r) for r in driver.ids)
    state = plugin.active()
    row = driver.rows()[writer]
    last = state.block_table.num_blocks_per_row[row] - 1
    state.block_table.block_table.np[row, last] = driver.blocks(driver.ids[0])[0]
    driver.step()
    found = _parse(lines.take())
    assert found, "the rewritten block was not reported in the step that wrote it"
    named = {r for _, _, requests in found for r in requests}
    assert victim in named and named <= {victim, writer}
    assert any("verify_position" in reasons for reasons, _, requests in found if victim in requests)
    driver.finish()


def test_a_fault_of_its_own_under_log_turns_the_canary_off(engine, monkeypatch):
    llm, lines, _ = engine
    state = plugin.active()
    rng = random.Random(8)
    prompts = [{"prompt_token_ids": _tokens(rng, 40 + 20 * i)} for i in range(3)]

    def fault(*args, **kwargs):
        raise ZeroDivisionError("a fault injected into the plugin")

    assert lines.take() == []
    monkeypatch.setattr(worker, "step_plan", fault)
    try:
        outputs = llm.generate(prompts, [_params(30, i) for i in range(3)], use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [30, 30, 30]  # the engine kept serving
        assert not state.on and state.faults == 1
        (error,) = lines.records
        assert error.levelno == logging.ERROR and error.getMessage().startswith("kv-canary: the canary's own code failed")
        assert isinstance(error.exc_info[1], ZeroDivisionError)  # with its traceback
        stats = state.canary.stats()
        llm.generate(prompts[:1], _params(10), use_tqdm=False)
        assert state.canary.stats() == stats and len(lines.records) == 1  # off from here on
    finally:
        lines.take()
        monkeypatch.undo()
        llm.reset_prefix_cache()  # blocks written while the canary was off have no records
        state.on, state.faults = True, 0
        adapter.watch(state.model_runner, state)


def test_a_block_vllm_copies_carries_its_records(engine, monkeypatch):
    """vLLM's copy-on-write of a partially hit block (`scheduler_output.kv_cache_block_copies`,
    copied by the runner before the forward) moves the block's records with its bytes. No
    model here gets a partial hit from vLLM's scheduler (with one KV cache group vLLM
    refuses a `prefix_match_unit` below the block size), so the scheduler is made to
    schedule one copy, into a block taken from vLLM's own pool; the copy itself is vLLM's."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    llm, lines, _ = engine
    state = plugin.active()
    prompt = _tokens(random.Random(11), 100)
    llm.generate([{"prompt_token_ids": prompt}], _params(2), use_tqdm=False)
    records = state.canary.records
    (first,) = ((records[:, 0] == prompt[32]) & (records[:, 1] == 32)).nonzero().flatten().tolist()
    source = first // BLOCK_SIZE
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    (block,) = manager.block_pool.get_new_blocks(1)
    take = manager.take_kv_cache_block_copies
    copies = [[KVCacheBlockCopy(src_block_id=source, dst_block_id=block.block_id)]]
    monkeypatch.setattr(manager, "take_kv_cache_block_copies", lambda: (copies.pop(), []) if copies else take())
    try:
        llm.generate([{"prompt_token_ids": _tokens(random.Random(12), 20)}], _params(2), use_tqdm=False)
        assert copies == []  # the scheduler took the copy
        src = torch.arange(BLOCK_SIZE) + source * BLOCK_SIZE
        dst = torch.arange(BLOCK_SIZE) + block.block_id * BLOCK_SIZE
        for kv_cache in state.kv_caches:
            assert torch.equal(kv_cache[block.block_id], kv_cache[source])  # vLLM copied the bytes
        assert torch.equal(state.canary.records[dst], state.canary.records[src])
        positions = torch.arange(32, 32 + BLOCK_SIZE)
        tokens = torch.tensor(prompt[32:64])
        (before,) = ((records[:, 0] == prompt[31]) & (records[:, 1] == 31)).nonzero().flatten().tolist()
        prev = torch.cat([torch.tensor([before]), dst[:-1]])  # position 31 stays in the prompt's first block
        assert not state.canary.verify(dst, positions=positions, tokens=tokens, prev_slots=prev).any()
        assert state.canary.poll() == [] and lines.take() == []
    finally:
        manager.block_pool.free_blocks([block])


def test_raise_stops_the_step(engine):
    llm, lines, _ = engine
    state = plugin.active()
    driver = Driver(llm, "raise")
    driver.add(_tokens(random.Random(5), 70), _params(200))
    driver.run_until_decoding()
    block = driver.blocks(driver.ids[0])[0]
    state.kv_caches[0].view(torch.int16)[block, 0, 3, 3] ^= 1
    state.policy = "raise"
    try:
        with pytest.raises(Exception) as raised:
            driver.step()
    finally:
        state.policy = "log"
    error = raised.value
    while error is not None and not isinstance(error, kc.KvCorruptionError):
        error = error.__cause__ or error.__context__
    assert isinstance(error, kc.KvCorruptionError), f"{type(raised.value).__name__} did not come from a KvCorruptionError"
    assert all(driver.internal_id(driver.ids[0]) in line for line in error.lines)


def test_a_fault_of_its_own_under_raise_stops_the_step(engine, monkeypatch):
    llm, lines, _ = engine
    state = plugin.active()
    driver = Driver(llm, "own-fault")
    driver.add(_tokens(random.Random(9), 40), _params(20))

    def fault(*args, **kwargs):
        raise ZeroDivisionError("a fault injected into the plugin")

    monkeypatch.setattr(worker, "step_plan", fault)
    state.policy = "raise"
    try:
        with pytest.raises(Exception) as raised:
            driver.step()
    finally:
        state.policy = "log"
    error = raised.value
    while error is not None and not isinstance(error, ZeroDivisionError):
        error = error.__cause__ or error.__context__
    assert isinstance(error, ZeroDivisionError), f"{type(raised.value).__name__} did not come from the injected fault"
    assert state.on and state.faults == 0 and lines.take() == []


def test_a_forward_the_hooks_do_not_see_stops_the_step(engine):
    # A runner whose execute_model runs the model past the instance's _model_forward (here
    # by dropping the hook for the call): the step stops, naming the runner. The engine is
    # left between its forward and its sampling, so this test comes last in the module.
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class PastTheHook(CPUModelRunner):
        def execute_model(self, scheduler_output, *args, **kwargs):
            hooked = self.__dict__.pop("_model_forward")
            try:
                return super().execute_model(scheduler_output, *args, **kwargs)
            finally:
                self._model_forward = hooked

    llm, lines, _ = engine
    runner = plugin.active().model_runner
    driver = Driver(llm, "past")
    driver.add(_tokens(random.Random(12), 40), _params(20))
    driver.step()  # watched
    runner.__class__ = PastTheHook
    try:
        with pytest.raises(Exception) as raised:
            driver.step()
    finally:
        runner.__class__ = CPUModelRunner
    assert lines.take() == []
    message = "\n".join(str(e) for e in _chain(raised.value))
    assert (
        f"kv-canary: the vLLM plugin did not see the model forward of an engine step of {__name__}."
        "test_a_forward_the_hooks_do_not_see_stops_the_step.<locals>.PastTheHook: its execute_model ran the step's tokens "
        f"without {adapter.V1_RUNNER}._model_forward"
    ) in message, message


def _chain(error: BaseException):
    """``error`` and the exceptions it was raised from, or during."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
