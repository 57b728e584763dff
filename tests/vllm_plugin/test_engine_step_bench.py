"""The engine-step benchmark's harness (`benchmarks.engine_step`): the plugin's step code on
buffers shaped as vLLM's runners hold them, without vLLM. Its clean steps must find nothing,
and a byte flipped in a context slot must be found and named, or its figures time a step
that checks nothing."""

import pytest
import torch

from benchmarks import engine_step
from torch_kvcanary.integrations.vllm import worker
from torch_kvcanary.integrations.vllm.config import Settings
from torch_kvcanary.sources import HashMode


def _started(runner: str, requests: int = 3, context: int = 40):
    buffers = engine_step.StepBuffers(runner, layers=2, requests=requests, context=context, decode_steps=4)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=engine_step.BenchRunner(buffers))
    canary.end_step(canary.begin_step(lambda: buffers.step(context)))
    return buffers, canary


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_clean_decode_steps_find_nothing(runner):
    buffers, canary = _started(runner)
    for _ in range(3):
        canary.end_step(canary.begin_step(lambda: buffers.step(1)))
    stats = canary.stats()
    assert stats["violations"] == 0
    assert stats["slots_recorded"] == 3 * 40 + 3 * 3
    assert stats["slots_verified"] >= 3 * 40 * 3  # every context slot of every request, each step


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_flipped_byte_in_a_context_slot_is_found_and_named(runner, caplog):
    buffers, canary = _started(runner)
    request, position = 1, 17
    block = buffers.block_of(request, position)
    bits = buffers.caches[1].view(torch.int16)  # [num_blocks, heads, block_size, 2 * head_size]
    bits[block, 0, position % engine_step.BLOCK_SIZE, 0] ^= 1
    with caplog.at_level("WARNING"):
        canary.end_step(canary.begin_step(lambda: buffers.step(1)))
    assert canary.stats()["violations"] == 1
    lines = [r.getMessage() for r in caplog.records if "kv_canary" in r.getMessage()]
    assert len(lines) == 1 and "request-1" in lines[0] and "request-0" not in lines[0], lines


def test_the_benchmark_prints_its_table(capsys):
    assert (
        engine_step.main(["--runner", "v2", "--layers", "1", "--requests", "2", "--contexts", "20", "--modes", "PARTIAL", "--steps", "1"])
        == 0
    )
    table = capsys.readouterr().out
    assert "| v2 | PARTIAL | 1 | 2 | 20 |" in table
