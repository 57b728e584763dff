"""The vLLM plugin on every kind of attention model vLLM's CPU build serves, in-process and
driven step by step (test_vllm_engine's engine and driver): a sliding window (Mistral), full
and sliding layers in two KV cache groups over one pool (Gemma 2, hybrid KV cache manager),
chunked-local and full layers likewise (Llama 4), MLA (DeepSeek V2) and M-RoPE (Qwen2-VL,
on text prompts), each a tiny random checkpoint made on the spot. Each serves a clean
mixed workload without a report, and names the right request after a flipped byte in a
live block and after a block-table entry pointing at another request's block.

The runner's M-RoPE step inputs are also tested at the unit level, as is the refusal of a
KV cache group the plugin cannot watch.
"""

import random
import types

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

import engine_driver  # noqa: E402
from engine_driver import BLOCK_SIZE, CANARY_BYTES_PER_SLOT, Driver, decoding, parse_violations, sampling_params  # noqa: E402

from torch_kvcanary.integrations.vllm import adapter, config, plugin, worker  # noqa: E402
from torch_kvcanary.testing.random_models import make_model  # noqa: E402

# Each kind: its KV cache groups as the plugin sees them, its layers' attention backends,
# and the KV bytes per slot over its layers, for a budget of `BLOCKS` blocks (a hybrid
# model's groups overlay one pool, a layer's worth per slot, but a request takes blocks in
# each group: the budget holds about `BLOCKS` blocks per group).
MODELS = {
    "mistral": (["SlidingWindowSpec"], {"CPU_ATTN"}, 2 * 2 * 2 * 64 * 2),
    "gemma2": (["SlidingWindowSpec", "FullAttentionSpec"], {"CPU_ATTN"}, 2 * 2 * 2 * 64 * 2),
    "llama4": (["ChunkedLocalAttentionSpec", "FullAttentionSpec"], {"CPU_ATTN"}, 2 * 2 * 2 * 64 * 2),
    "qwen2_vl": (["FullAttentionSpec"], {"CPU_ATTN"}, 2 * 2 * 2 * 64 * 2),
    "deepseek_v2": (["MLAAttentionSpec"], {"AMX_MLA", "CPU_MLA"}, 2 * 576 * 2),
}
# One request of the longest length (512 tokens); ten of them preempt each other even when a
# window frees the blocks below it.
BLOCKS = 16


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_engine(request, tmp_path_factory):
    kind = request.param
    model = make_model(tmp_path_factory.mktemp(kind), kind)
    budget = (BLOCKS + 1) * BLOCK_SIZE * (MODELS[kind][2] + CANARY_BYTES_PER_SLOT) + 1024 * 11 * 8 + 4096  # a block of slack
    with engine_driver.started_engine(model, kv_budget=budget) as (llm, lines, preemptions):
        llm.kv_budget = budget
        yield kind, llm, lines, preemptions


def test_the_plugin_watches_each_group(model_engine):
    kind, llm, _, _ = model_engine
    state = plugin.active()
    # The distinct KV bytes and the canary over them fit in the budget (a hybrid model's
    # groups overlay one pool: its slots are not the sum of every layer's bytes).
    assert sum(kv.nbytes for kv in state.kv_caches) + state.canary.nbytes <= llm.kv_budget
    kinds, backends, _ = MODELS[kind]
    assert [group.kind for group in state.groups] == kinds
    assert {layer.backend for group in state.groups for layer in group.layers} <= backends
    context = state.model_runner.compilation_config.static_forward_context
    # One canary over the distinct bytes: every layer's cache is one the canary watches.
    for group in state.groups:
        for layer in group.layers:
            assert any(context[layer.name].kv_cache.data_ptr() == kv.data_ptr() for kv in state.kv_caches)
    assert state.canary.capacity == state.kv_caches[0].shape[0] * state.block_size
    if kind in ("gemma2", "llama4"):  # both groups' layers lie over one pool
        assert len(state.kv_caches) == 1 and len(state.canary.sources) == 2
    if kind == "qwen2_vl":  # the model gets M-RoPE's [3, tokens] positions, the canary the runner's 1-D ones
        assert state.model_runner.uses_mrope and state.model_runner.mrope_positions.gpu.dim() == 2
    # The start line says what of a request's identity the canary does not read: an image behind its placeholders.
    assert ("; not read: multimodal items;" in llm.startup_log) == (kind == "qwen2_vl")
    if kind == "deepseek_v2":  # the latent, one source per layer
        assert all(kv.dim() == 3 and kv.shape[2] == 576 for kv in state.kv_caches)
        assert len(state.canary.sources) == len(state.kv_caches) == 2


def test_a_mixed_workload_raises_no_false_alarm(model_engine):
    _, llm, lines, preemptions = model_engine
    engine_driver.mixed_workload(llm, lines, preemptions)


def _last_full_block(driver: Driver, request_id: str, group: int) -> tuple[int, int]:
    """(index in the request's block table, block) of its last full block in ``group``: in
    the context, below the block the next token goes to, and within a window of 48 (not
    necessarily within a local chunk)."""
    index = driver.context(request_id) // plugin.active().block_size - 1
    assert index >= 1
    return index, driver.blocks(request_id, group)[index]


def _newest_context_position(driver: Driver, request_id: str, group: int) -> int:
    """The request's newest position in the KV cache, once it is one its tokens attend to in
    ``group`` (a local chunk may have just begun)."""
    for _ in range(3):
        context = driver.context(request_id)
        if context - 1 >= plugin.active().groups[group].first_attended(np.array([context]))[0]:
            return context - 1
        driver.step()
    raise AssertionError(f"{request_id} attends to none of its context")


def test_a_flipped_byte_names_its_request(model_engine):
    _, llm, lines, _ = model_engine
    state = plugin.active()
    driver, victim = engine_driver.flip_victim(llm, lines, 70)
    position = _newest_context_position(driver, victim, 0)  # in the first group: a window's or a chunk's
    block, row = driver.blocks(victim, 0)[position // state.block_size], position % state.block_size
    assert lines.take() == []
    kv = state.groups[0].layers[0].kv_cache.view(torch.int16)
    if kv.dim() == 3:  # MLA: token-major, the slot's latent row
        kv[block, row, 77] ^= 1 << 9
    else:  # K and V planes per head: row `row` of head 1's K plane
        kv[block, 1, row, 77] ^= 1 << 9
    driver.step()
    found = engine_driver.flip_reported(lines, driver, victim, block, state.block_size)
    if kv.dim() == 3:
        assert [slot for _, slot, _ in found] == [block * state.block_size + row]
    driver.finish()


def test_a_block_table_pointing_at_another_requests_block(model_engine):
    _, llm, lines, _ = model_engine
    state = plugin.active()
    group = len(state.groups) - 1  # the full-attention group of Gemma 2 and Llama 4, the only group elsewhere
    rng = random.Random(3)
    prompts = [engine_driver.random_tokens(rng, 75) for _ in range(2)]
    driver = decoding(llm, lines, "table", prompts, [sampling_params(200, 0) for _ in range(2)])
    victim, other = driver.ids
    index, own = _last_full_block(driver, victim, group)
    table = state.groups[group].block_table.block_table.np
    row = driver.rows()[driver.internal_id(victim)]
    table[row, index] = driver.blocks(other, group)[index]  # bytes intact
    driver.step()
    found = parse_violations(lines.take())
    table[row, index] = own
    engine_driver.assert_a_wrong_block_entry(found, driver.internal_id(victim))
    driver.finish()


# Unit level ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window, chunk, computed, first",
    [
        (None, None, [0, 5, 300], [0, 0, 0]),
        (48, None, [0, 47, 48, 49, 300], [0, 0, 1, 2, 253]),  # vLLM's get_num_skipped_tokens(7) == 4 for a window of 4
        (4, None, [7], [4]),
        (None, 8, [7, 8, 13, 16], [0, 8, 8, 16]),
    ],
)
def test_the_positions_a_windowed_group_still_attends_to(window, chunk, computed, first):
    group = adapter.KvCacheGroup(0, "any", [], 32, torch.zeros(1, 1, dtype=torch.int32), sliding_window=window, attention_chunk_size=chunk)
    assert group.first_attended(np.array(computed)).tolist() == first


def _fake_runner(*, multimodal: bool, prompt_embeds: bool = False):
    """The parts of a V1 model runner `adapter.v1._step` reads, for two requests of 3 and 2 tokens."""
    table = types.SimpleNamespace(slot_mapping=types.SimpleNamespace(gpu=torch.arange(100, 110)))
    spec = type("FullAttentionSpec", (), {})()
    return types.SimpleNamespace(
        input_batch=types.SimpleNamespace(
            req_ids=["a", "b"],
            num_computed_tokens_cpu=np.array([7, 4]),
            block_table=types.SimpleNamespace(block_tables=[table]),
        ),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)]),
        positions=torch.tensor([7, 8, 9, 4, 5, 0, 0]),
        input_ids=types.SimpleNamespace(gpu=torch.tensor([11, 12, 13, 14, 15, 0, 0])),
        supports_mm_inputs=multimodal,
        enable_prompt_embeds=prompt_embeds,
        # Which positions the runner's input ids give (the others, embedding rows): all here.
        is_token_ids=types.SimpleNamespace(np=np.ones(7, dtype=bool), gpu=torch.ones(7, dtype=torch.bool)),
    )


def test_an_mrope_models_step_reads_the_runners_sequence_positions_and_input_ids():
    runner = _fake_runner(multimodal=True)
    scheduled = types.SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 2}, kv_cache_block_copies=None)
    mrope_positions = torch.zeros(3, 7, dtype=torch.int64)  # [3, tokens]: what the model gets
    step = adapter.v1._step(runner, scheduled, None, mrope_positions)
    assert step.positions[: step.num_tokens].tolist() == [7, 8, 9, 4, 5]  # the runner's buffers, not sliced
    assert step.input_ids[: step.num_tokens].tolist() == [11, 12, 13, 14, 15]  # a multimodal model runs on their embeddings
    # With prompt embeddings on, positions given as token ids are recorded with them (those
    # given as embedding rows, with the rows' words: test_vllm_prompt_embeds.py).
    step = adapter.v1._step(_fake_runner(multimodal=True, prompt_embeds=True), scheduled, None, mrope_positions)
    assert step.input_ids[: step.num_tokens].tolist() == [11, 12, 13, 14, 15]


def test_a_kv_cache_group_the_plugin_cannot_watch_is_refused_at_start():
    groups = [types.SimpleNamespace(kv_cache_spec=type(name, (), {})()) for name in ("FullAttentionSpec", "CrossAttentionSpec")]
    runner = types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(kv_cache_groups=groups))
    with pytest.raises(
        ValueError,
        match=r"^kv-canary: the vLLM plugin watches KV cache groups of .*; this model has CrossAttentionSpec: unset KVCANARY_VLLM",
    ):
        worker.WorkerCanary(runner, config.Settings("log", config.MODES["all"]))


def test_a_model_without_an_attention_group_is_refused_at_start():
    groups = [types.SimpleNamespace(kv_cache_spec=type("MambaSpec", (), {})())]
    runner = types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(kv_cache_groups=groups))
    with pytest.raises(
        ValueError, match=r"^kv-canary: the vLLM plugin watches attention KV cache groups; this model has \['MambaSpec'\]: unset"
    ):
        worker.WorkerCanary(runner, config.Settings("log", config.MODES["all"]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_token_check_runs_where_the_runners_history_is_current(async_scheduling):
    # V1's history trails the device by a step under async scheduling; V2 writes each sampled
    # token into its history on the device before the next forward.
    v1 = types.SimpleNamespace(use_async_scheduling=async_scheduling)
    v2 = types.SimpleNamespace(vllm_config=types.SimpleNamespace(scheduler_config=types.SimpleNamespace(async_scheduling=async_scheduling)))
    assert adapter.RunnerV1(v1).token_history_current is not async_scheduling
    assert adapter.RunnerV2(v2).async_scheduling is async_scheduling and adapter.RunnerV2(v2).token_history_current


def test_model_runner_v2s_forward_bracket():
    # V2 calls its KV connector's pre_forward and finish_forward around every forward: the
    # bracket runs the watcher's step after each, skips dummy runs (no scheduled token), and
    # leaves everything else to the connector, also in a copy of it.
    import copy

    calls = []

    class Connector:
        def pre_forward(self, scheduler_output, input_batch, **kwargs):
            calls.append(("pre_forward", kwargs))

        def finish_forward(self):
            calls.append(("finish_forward",))

        def set_disabled(self, disabled):
            calls.append(("set_disabled", disabled))

    class Watcher:
        def begin_step(self, read_step):
            calls.append(("begin_step",))
            return "batch"

        def end_step(self, batch):
            calls.append(("end_step", batch))

    runner = types.SimpleNamespace()
    adapter.watch(runner, Watcher())
    bracket = adapter.v2._ForwardBracket(Connector(), runner)
    real, dummy = types.SimpleNamespace(total_num_scheduled_tokens=3), types.SimpleNamespace(total_num_scheduled_tokens=0)
    bracket.pre_forward(real, None, attn_metadata=None)
    bracket.finish_forward()
    bracket.pre_forward(dummy, None)
    bracket.finish_forward()
    copy.copy(bracket).set_disabled(True)
    assert calls == [
        ("pre_forward", {"attn_metadata": None}), ("begin_step",), ("finish_forward",), ("end_step", "batch"),
        ("pre_forward", {}), ("finish_forward",),
        ("set_disabled", True),
    ]  # fmt: skip
