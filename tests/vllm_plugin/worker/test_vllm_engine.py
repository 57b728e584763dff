"""The vLLM plugin on the real engine (vLLM's CPU build), in-process and driven step by step.

One engine serves the module: a tiny random Llama with a KV space of 24 blocks of 32 slots,
prefix caching, and chunked prefill of 64 tokens a step, so a mixed workload shares blocks,
splits prompts and preempts requests. Faults are injected between ``llm_engine.step()``
calls and must be reported at the next step, naming the request.
"""

import logging
import random
import re

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm


import engine_driver  # noqa: E402
from engine_driver import (  # noqa: E402
    BLOCK_SIZE,
    KV_BUDGET,
    KV_BYTES_PER_SLOT,
    NUM_BLOCKS,
    SUMMARY,
    Driver,
    decoding,
    mixed_workload,
    parse_violations,
    random_tokens,
    sampling_params,
    started_engine,
)

import torch_kvcanary as kc  # noqa: E402
from torch_kvcanary.integrations.vllm import adapter, plugin, step_buffers  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with started_engine(tiny_llama) as started:
        yield started


@pytest.mark.every_release
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


@pytest.mark.every_release
def test_the_start_line_is_in_vllms_log(engine):
    llm, _, _ = engine
    state = plugin.active()
    watching = [line for line in llm.startup_log.splitlines() if "kv-canary: watching" in line]
    (line,) = watching  # vLLM's format: process and pid (from 0.32 on), level, time, file and line
    pattern = (
        r"^(?:\(\w+ pid=\d+\) )?INFO \d\d-\d\d \d\d:\d\d:\d\d \[worker\.py:\d+\] kv-canary: watching "
        r"vllm\.v1\.worker\.cpu_model_runner\.CPUModelRunner: 1 KV cache group \(FullAttentionSpec\), 2 layers \(2 caches, LBHNC\), "
        rf"{NUM_BLOCKS * BLOCK_SIZE} slots in blocks of {BLOCK_SIZE}; mode ALL, policy log; "
        r"the canary holds (\d+\.\d) KiB \(40 B per slot\), taken from the (\d+\.\d) KiB this worker found for the KV cache; "
        r"step path: two kvcanary::paged_step calls a step, before and after the forward \(CPU_ATTN packs a block's tokens\), "
        r"over 1 KV cache group; verdicts read at once; "
        r"request identity: no LoRA adapter \(LoRA off\), cache_salt carried from the scheduler; torch_kvcanary \S+$"
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


@pytest.mark.every_release
def test_a_mixed_workload_raises_no_false_alarm(engine):
    mixed_workload(*engine)


@pytest.fixture
def token_copy(engine, monkeypatch):
    """The canary checks tokens against its device copy of the token history
    (`step_buffers.TokenCopy`), as where Model Runner V1 keeps its history on the host (a GPU);
    here the device is the CPU, and vLLM's own history is the oracle."""
    state = plugin.active()
    copy = step_buffers.TokenCopy(*state.runner_view.token_rows, state.canary.device)
    monkeypatch.setattr(state, "_token_copy", copy)
    return copy


def _assert_copy_holds_vllms_history(copy: step_buffers.TokenCopy) -> None:
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


@pytest.mark.every_release
def test_a_flipped_bit_names_its_request(engine):
    llm, lines, _ = engine
    driver, victim = engine_driver.flip_victim(llm, lines, 70)
    block = driver.blocks(victim)[1]
    layer = plugin.active().kv_caches[1]
    layer.view(torch.int16)[block, 1, 5, 77] ^= 1 << 9  # one bit of head 1
    driver.step()
    found = engine_driver.flip_reported(lines, driver, victim, block, BLOCK_SIZE)
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
    driver = decoding(llm, lines, "sampled", [random_tokens(random.Random(11), 5 * BLOCK_SIZE + 3)], [sampling_params(200)])
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
            for _, slot, requests in parse_violations(lines.take()):
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
    driver.add(random_tokens(random.Random(6), 2 * BLOCK_SIZE + 3), sampling_params(200, 2))
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
    found = parse_violations(lines.take())
    assert found and all(slot // BLOCK_SIZE == last and requests == [victim] for _, slot, requests in found)
    driver.finish()


@pytest.mark.every_release
def test_a_block_table_pointing_at_another_requests_block(engine):
    _block_table_pointing_at_another_requests_block(*engine)


def _block_table_pointing_at_another_requests_block(llm, lines, _) -> None:
    rng = random.Random(3)
    prompts = [random_tokens(rng, 75) for _ in range(2)]
    driver = decoding(llm, lines, "table", prompts, [sampling_params(200, 0) for _ in range(2)])
    victim, other = driver.ids
    state = plugin.active()
    row = driver.rows()[driver.internal_id(victim)]
    own = state.block_table.block_table.np[row, 1]
    state.block_table.block_table.np[row, 1] = driver.blocks(other)[1]  # bytes intact
    driver.step()
    found = parse_violations(lines.take())
    state.block_table.block_table.np[row, 1] = own
    engine_driver.assert_a_wrong_block_entry(found, driver.internal_id(victim))
    driver.finish()


def test_a_token_copy_follows_the_requests_and_catches_a_wrong_block(engine, token_copy):
    llm, lines, _ = engine
    driver = Driver(llm, "copy")
    rng = random.Random(21)
    for i in range(4):
        driver.add(random_tokens(rng, 50 + 20 * i), sampling_params(60 + 40 * i, 0))
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
    rng = random.Random(4)
    prompts = [random_tokens(rng, 80) for _ in range(2)]
    driver = decoding(llm, lines, "reuse", prompts, [sampling_params(200, 1) for _ in range(2)])
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
    found = parse_violations(lines.take())
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
    rng = random.Random(7)
    prompts = [random_tokens(rng, 70 + 5 * i) for i in range(2)]
    driver = decoding(llm, lines, "steal", prompts, [sampling_params(200, 0) for i in range(2)])
    victim, writer = (driver.internal_id(r) for r in driver.ids)
    state = plugin.active()
    row = driver.rows()[writer]
    last = state.block_table.num_blocks_per_row[row] - 1
    state.block_table.block_table.np[row, last] = driver.blocks(driver.ids[0])[0]
    driver.step()
    found = parse_violations(lines.take())
    assert found, "the rewritten block was not reported in the step that wrote it"
    named = {r for _, _, requests in found for r in requests}
    assert victim in named and named <= {victim, writer}
    assert any("verify_position" in reasons for reasons, _, requests in found if victim in requests)
    driver.finish()


def test_a_fault_of_its_own_under_log_turns_the_canary_off(engine, monkeypatch):
    llm, lines, _ = engine
    state = plugin.active()
    rng = random.Random(8)
    prompts = [{"prompt_token_ids": random_tokens(rng, 40 + 20 * i)} for i in range(3)]

    def fault(*args, **kwargs):
        raise ZeroDivisionError("a fault injected into the plugin")

    assert lines.take() == []
    monkeypatch.setattr(step_buffers.StepRows, "fill", fault)
    try:
        outputs = llm.generate(prompts, [sampling_params(30, i) for i in range(3)], use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [30, 30, 30]  # the engine kept serving
        assert not state.on and state.faults == 1
        (error,) = lines.records
        assert error.levelno == logging.ERROR and error.getMessage().startswith("kv-canary: the canary's own code failed")
        assert isinstance(error.exc_info[1], ZeroDivisionError)  # with its traceback
        stats = state.canary.stats()
        llm.generate(prompts[:1], sampling_params(10), use_tqdm=False)
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
    prompt = random_tokens(random.Random(11), 100)
    llm.generate([{"prompt_token_ids": prompt}], sampling_params(2), use_tqdm=False)
    records = state.canary.records
    (first,) = ((records[:, 0] == prompt[32]) & (records[:, 1] == 32)).nonzero().flatten().tolist()
    source = first // BLOCK_SIZE
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    (block,) = manager.block_pool.get_new_blocks(1)
    take = manager.take_kv_cache_block_copies
    copies = [[KVCacheBlockCopy(src_block_id=source, dst_block_id=block.block_id)]]
    monkeypatch.setattr(manager, "take_kv_cache_block_copies", lambda: (copies.pop(), []) if copies else take())
    try:
        llm.generate([{"prompt_token_ids": random_tokens(random.Random(12), 20)}], sampling_params(2), use_tqdm=False)
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


@pytest.mark.every_release
def test_raise_stops_the_step(engine):
    llm, lines, _ = engine
    state = plugin.active()
    # First what vLLM's Python API passes on as a cache salt, each rooted in its own text:
    # none stops a step, or turns the canary off.
    _generate_salted_under_raise(llm)
    assert lines.take() == [] and state.on and state.faults == 0
    driver = decoding(llm, lines, "raise", [random_tokens(random.Random(5), 70)], [sampling_params(200)])
    block = driver.blocks(driver.ids[0])[0]
    state.kv_caches[0].view(torch.int16)[block, 0, 3, 3] ^= 1
    raised = _step_under_raise(driver)
    error = _raised_from(raised, kc.KvCorruptionError)
    assert all(driver.internal_id(driver.ids[0]) in line for line in error.lines)


def test_a_fault_of_its_own_under_raise_stops_the_step(engine, monkeypatch):
    llm, lines, _ = engine
    state = plugin.active()
    driver = Driver(llm, "own-fault")
    driver.add(random_tokens(random.Random(9), 40), sampling_params(20))

    def fault(*args, **kwargs):
        raise ZeroDivisionError("a fault injected into the plugin")

    monkeypatch.setattr(step_buffers.StepRows, "fill", fault)
    raised = _step_under_raise(driver)
    _raised_from(raised, ZeroDivisionError)
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
    driver.add(random_tokens(random.Random(12), 40), sampling_params(20))
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


def _generate_salted_under_raise(llm) -> None:
    prompts = [random_tokens(random.Random(seed), 50) for seed in (21, 22)]
    state = plugin.active()
    state.policy = "raise"
    try:
        for salt in ["\ud800", "", "a\x00b", "x" * (1 << 20), 123, b"bytes", ("a", 1)]:
            outputs = llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], sampling_params(6), use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6], repr(salt)[:20]
    finally:
        state.policy = "log"
    llm.reset_prefix_cache()


def _step_under_raise(driver: Driver) -> BaseException:
    """What the driver's next step raises under the raise policy (it must raise)."""
    state = plugin.active()
    state.policy = "raise"
    try:
        with pytest.raises(Exception) as raised:
            driver.step()
    finally:
        state.policy = "log"
    return raised.value


def _raised_from(error: BaseException, kind: type[BaseException]) -> BaseException:
    """The exception of type ``kind`` that ``error`` was raised from, or during."""
    found = [e for e in _chain(error) if isinstance(e, kind)]
    assert found, f"{type(error).__name__} did not come from a {kind.__name__}"
    return found[0]
