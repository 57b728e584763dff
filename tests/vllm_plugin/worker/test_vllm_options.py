"""The vLLM plugin under the engine options a server may be started with (vLLM's CPU build,
in-process, one engine per option set): an fp8 KV cache, float16 and float32 models, blocks
of 64 and 128 slots, prefix caching off, chunked prefill off. Each serves a clean workload
(parallel sampling and beam search included) without a report, and names the right request
after a flipped bit in a live block. (Async scheduling is not among them: vLLM's CPU platform
turns it off, vllm/platforms/cpu.py.)
"""

import random

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from engine_driver import KV_BUDGET, flip_reported, flip_victim, random_tokens, sampling_params, started_engine  # noqa: E402
from helpers import HOST_AMX, HOST_AVX512, needs_isa  # noqa: E402

from torch_kvcanary.integrations.vllm import plugin  # noqa: E402

# Each option set: the engine's options over test_vllm_engine's, the KV budget's factor (a
# float32 cache holds twice the bytes per slot), and what shows it in effect, from the
# plugin's canary (`worker.WorkerCanary`) and vLLM's config.
OPTIONS = {
    "fp8 KV cache": (dict(kv_cache_dtype="fp8"), 1, lambda state, config: state.kv_caches[0].element_size() == 1),
    "float16": (dict(dtype="float16"), 1, lambda state, config: state.kv_caches[0].dtype == torch.float16),
    "float32": (dict(dtype="float32"), 2, lambda state, config: state.kv_caches[0].dtype == torch.float32),
    "blocks of 64": (dict(block_size=64), 1, lambda state, config: state.block_size == 64),
    "blocks of 128": (dict(block_size=128), 2, lambda state, config: state.block_size == 128),
    "no prefix caching": (dict(enable_prefix_caching=False), 1, lambda state, config: not config.cache_config.enable_prefix_caching),
    "no chunked prefill": (
        dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
        1,
        lambda state, config: not config.scheduler_config.enable_chunked_prefill,
    ),
}


# vLLM's CPU build refuses an fp8 KV cache on a host without AVX-512 or AMX.
ISA_MARKS = {"fp8 KV cache": needs_isa("fp8 KV cache", HOST_AVX512 or HOST_AMX)}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=ISA_MARKS.get(name, ())) for name in sorted(OPTIONS)])
def options_engine(request, tiny_llama):
    options, budget_factor, in_effect = OPTIONS[request.param]
    with started_engine(tiny_llama, kv_budget=KV_BUDGET * budget_factor, **options) as started:
        assert in_effect(plugin.active(), started[0].llm_engine.vllm_config), f"{request.param} did not take effect"
        yield started


def test_a_clean_workload_raises_no_false_alarm(options_engine):
    llm, lines, _ = options_engine
    before = plugin.active().canary.stats()
    rng = random.Random(1)
    prefix = random_tokens(rng, 150)
    prompts = [{"prompt_token_ids": prefix + random_tokens(rng, 10 + 23 * i)} for i in range(8)]
    outputs = llm.generate(prompts, [sampling_params(40 + 20 * (i % 3), i) for i in range(8)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40 + 20 * (i % 3) for i in range(8)]
    several = llm.generate(prompts[:3], vllm.SamplingParams(n=3, max_tokens=24, temperature=1.0, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs) for o in several] == [3, 3, 3]
    beams = llm.beam_search(prompts[3:5], vllm.sampling_params.BeamSearchParams(beam_width=3, max_tokens=8))
    assert len(beams) == 2
    after = plugin.active().canary.stats()
    assert lines.take() == []
    assert after["violations"] == before["violations"] == 0
    assert after["slots_verified"] - before["slots_verified"] > 10_000


def test_a_flipped_bit_names_its_request(options_engine):
    llm, lines, _ = options_engine
    state = plugin.active()
    driver, victim = flip_victim(llm, lines, 140)
    block = driver.blocks(victim)[0]
    state.kv_caches[1].view(torch.uint8)[block, 1, 5, 100] ^= 1 << 6  # one bit of head 1, in bf16, fp16, fp32 or fp8
    driver.step()
    flip_reported(lines, driver, victim, block, state.block_size)
    driver.finish()
