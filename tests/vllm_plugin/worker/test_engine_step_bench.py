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
from torch_kvcanary.testing import fake_runner


def _started(runner: str, requests: int = 3, context: int = 40):
    buffers = fake_runner.StepBuffers(runner, layers=2, requests=requests, context=context, decode_steps=4)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers))
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
    bits[block, 0, position % fake_runner.BLOCK_SIZE, 0] ^= 1
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


def test_the_benchmark_takes_turns_and_prints_each_dimensions_flatness(capsys):
    argv = ["--runner", "v1", "--layers", "1", "--requests", "2", "4", "--contexts", "20", "--modes", "ALL", "--steps", "1"]
    assert engine_step.main([*argv, "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count('"turn": 0') == 2 and out.count('"turn": 1') == 2
    assert "| v1 | ALL | 1 | 4 | 20 |" in out
    assert "host alone, largest requests over smallest: at most " in out
    assert "host hot, largest requests over smallest: at most " in out
    assert "largest layers" not in out  # one value of layers: nothing to compare
    assert "  v1 ALL requests: host alone " in out and " layers: " not in out


def test_the_pairs_in_turns_are_each_dimensions_extremes():
    found = engine_step.pairs([12, 1, 80], [8, 256], [200])
    assert found == {"layers": ((1, 8, 200), (80, 8, 200)), "requests": ((1, 8, 200), (1, 256, 200))}


def _row(turn, requests, context, host_alone_us):
    return {"turn": turn, "runner": "v1", "mode": "ALL", "layers": 1, "requests": requests, "context": context,
            "wall_us": 1.0, "host_us": 1.0, "host_alone_us": host_alone_us, "host_hot_us": 1.0, "ops_per_step": 1.0}  # fmt: skip


def test_flatness_is_the_worst_cells_median_ratio_over_the_turns():
    turns = [
        [_row(0, 8, 200, 10.0), _row(0, 256, 200, 12.0), _row(0, 8, 2000, 10.0), _row(0, 256, 2000, 10.0)],
        [_row(1, 8, 200, 10.0), _row(1, 256, 200, 15.0), _row(1, 8, 2000, 20.0), _row(1, 256, 2000, 20.0)],
        [_row(2, 8, 200, 10.0), _row(2, 256, 200, 11.0), _row(2, 8, 2000, 10.0), _row(2, 256, 2000, 11.0)],
    ]
    worst = engine_step.flatness(turns)
    # requests: at 200 tokens the turns give 1.2, 1.5 and 1.1 (median 1.2); at 2,000, 1.0, 1.0 and 1.1 (median 1.0).
    assert worst["requests"] == pytest.approx(1.2)
    # context: at 8 requests 1.0, 2.0, 1.0 (median 1.0); at 256, 10/12, 20/15, 11/11 (median 1.0).
    assert worst["context"] == pytest.approx(1.0)
    assert "layers" not in worst
    assert engine_step.flatness(turns, "host_hot_us") == {"requests": 1.0, "context": 1.0}
    # Each cell's least: 10, 11, 10 and 10 us; requests 11 / 10 at 200 tokens, context 10 / 11 at 256 requests.
    least = engine_step.least_flatness(turns, "host_alone_us")
    assert least["requests"] == pytest.approx(1.1) and least["context"] == pytest.approx(1.0)
    medians = {(r["requests"], r["context"]): r["host_alone_us"] for r in engine_step.median_rows(turns)}
    assert medians == {(8, 200): 10.0, (256, 200): 12.0, (8, 2000): 10.0, (256, 2000): 11.0}
