"""The plugin's engine step as it runs on the CPU, on buffers shaped as vLLM's runners hold them
(`fake_runner.FakeRunner`), without vLLM: per steady step one canary op (two around the
forward on a block-packed backend) and no other torch op, hence no copy to the host and no
`item`, and no tensor allocated, by the step or in the op; a violation named by the request of its own step, read in that step
where the op ran on the host, and one step later where the device had not finished it."""

from __future__ import annotations

import gc

import pytest
import torch

from torch_kvcanary.integrations.vllm import reports, worker
from torch_kvcanary.integrations.vllm.config import Settings
from torch_kvcanary.paged_step import MailboxWord
from torch_kvcanary.sources import HashMode
from torch_kvcanary.testing import fake_runner

RANGE = "kvcanary_plugin_step"


def _started(runner: str, backend: str = fake_runner.BACKEND, requests: int = 4, context: int = 40):
    buffers = fake_runner.StepBuffers(runner, layers=2, requests=requests, context=context, decode_steps=8)
    canary = worker.WorkerCanary(buffers, Settings("log", HashMode.ALL), runner_view=fake_runner.FakeRunner(buffers, backend))
    canary.end_step(canary.begin_step(lambda: buffers.step(context)))
    canary.end_step(canary.begin_step(lambda: buffers.step(1)))
    return buffers, canary


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("backend, calls", [("FLASH_ATTN", 1), ("CPU_ATTN", 2)])
def test_a_steady_step_is_its_canary_calls_alone(runner, backend, calls):
    buffers, canary = _started(runner, backend)
    steps = 4
    # A garbage collection inside the range would run the finalizers of other tests' objects there.
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
            for _ in range(steps):
                forward = buffers.step(1)  # the runner's work, outside the plugin's step
                with torch.profiler.record_function(RANGE):
                    run = canary.begin_step(lambda forward=forward: forward)
                with torch.profiler.record_function(RANGE):
                    canary.end_step(run)
    finally:
        gc.enable()
    events = profile.events()
    called = [e for e in events if e.cpu_parent is not None and e.cpu_parent.name == RANGE]
    assert [e.name for e in called] == ["kvcanary::paged_step"] * (calls * steps)
    # A tensor the op allocated, even from its C++ code, would count in its memory.
    assert [e.cpu_memory_usage for e in called] == [0] * (calls * steps)
    assert canary.stats()["violations"] == 0
    assert reports.step_path(canary).startswith(
        "step path: " + ("two kvcanary::paged_step calls a step" if calls == 2 else "one kvcanary::paged_step call a step")
    )


def _flip(buffers, request: int, position: int) -> None:
    bits = buffers.caches[0].view(torch.int16)  # [num_blocks, heads, block_size, 2 * head_size]
    bits[buffers.block_of(request, position), 0, position % fake_runner.BLOCK_SIZE, 0] ^= 1


def _lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary violation")]
    caplog.clear()
    return lines


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_on_the_cpu_a_violation_is_read_in_its_step_and_names_its_request(runner, caplog):
    buffers, canary = _started(runner)
    buffers.move(torch.tensor([3, 2, 1, 0]))  # request 2 now in row 1
    _flip(buffers, request=2, position=17)
    with caplog.at_level("WARNING"):
        canary.end_step(canary.begin_step(lambda: buffers.step(1)))
        (line,) = _lines(caplog)
    assert line.endswith(" request_id=request-2"), line
    assert [slot.item() for slot in canary.step_flagged_slots()] == [buffers.block_of(2, 17) * fake_runner.BLOCK_SIZE + 1]


class UnfinishedDevice:
    """The canary's op as a device runs it: the mailbox shows a call's words only once the next
    call has begun (the device had not finished the step when the host looked)."""

    def __init__(self, paged):
        self.op, self.mailbox, self.finished = paged._op, paged.mailbox, None

    def __call__(self, *args):
        if self.finished is not None:
            self.mailbox.copy_(self.finished)
        before = self.mailbox.clone()
        self.op(*args)
        self.finished = self.mailbox.clone()
        self.mailbox.copy_(before)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_verdict_the_device_has_not_finished_is_read_a_step_later_and_names_its_request(runner, caplog):
    buffers, canary = _started(runner)
    canary._paged._op = UnfinishedDevice(canary._paged)
    with caplog.at_level("WARNING"):
        canary.end_step(canary.begin_step(lambda: buffers.step(1)))
        _flip(buffers, request=1, position=5)  # read by step s below
        step = canary.begin_step(lambda: buffers.step(1))
        canary.end_step(step)
        assert _lines(caplog) == []  # step s's verdict is not there yet
        assert canary._paged.mailbox[MailboxWord.STEP] == step.number - 1
        buffers.move(torch.tensor([1, 0, 3, 2]))  # request 1 moves to row 0 in step s + 1
        canary.end_step(canary.begin_step(lambda: buffers.step(1)))
        (line,) = _lines(caplog)  # step s's (and s + 1's) violation of request 1's slot
    assert line.endswith(" request_id=request-1"), line
    assert canary.stats()["violations"] == 2
