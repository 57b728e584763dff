"""The vLLM plugin's worker without vLLM: the token copy (`step_buffers.TokenCopy`) follows
requests across the batch's rows, and a policy that stops the step is refused under tensor
parallelism where the engine would hang (on the tests' fake runner)."""

import re

import numpy as np
import pytest
import torch

from torch_kvcanary import HashMode
from torch_kvcanary.integrations.vllm import adapter, config, step_buffers, worker
from torch_kvcanary.testing import fake_runner


def test_a_token_copy_follows_requests_across_rows():
    # The host's tokens of each request (what `adapter.RunnerV1.known_tokens` gives when it
    # takes a row), and what the copy must hold row by row after each step.
    host = {"a": [5, 6, 7], "b": [8, 9], "c": [1, 2, 3, 4], "d": [-1, 3]}
    copy = step_buffers.TokenCopy(3, 6, torch.int32, torch.device("cpu"))

    def follow(request_ids):
        history = copy.follow(request_ids, lambda row: torch.tensor(host[request_ids[row]], dtype=torch.int32))
        assert history.tokens is copy.tokens and history.known is None

    def rows():
        return copy.tokens.tolist()

    follow(["a", "b"])
    assert rows() == [[5, 6, 7, -1, -1, -1], [8, 9, -1, -1, -1, -1], [-1] * 6]
    step = adapter.Step(["a", "b"], np.array([1, 2]), np.array([3, 2]), torch.tensor([70, 90, 91, 0]), torch.tensor([3, 2, 3, 0]))
    copy.record(step, 3)  # a step's tokens (the runner's buffers hold one more)
    assert rows() == [[5, 6, 7, 70, -1, -1], [8, 9, 90, 91, -1, -1], [-1] * 6]
    follow(["b", "a", "c"])  # a and b swap rows (taken from the copy, not the host); c joins
    assert rows() == [[8, 9, 90, 91, -1, -1], [5, 6, 7, 70, -1, -1], [1, 2, 3, 4, -1, -1]]
    follow(["d", "a"])  # b and c leave; d joins b's old row, whose tokens do not linger
    assert rows() == [[-1, 3, -1, -1, -1, -1], [5, 6, 7, 70, -1, -1], [1, 2, 3, 4, -1, -1]]


@pytest.mark.parametrize("version, policy, tensor_parallel_size, refused", [
    ("0.31.0", "raise", 2, True), ("0.30.0", "repair", 4, True), ("0.31.0", "quarantine", 2, True),
    ("0.31.0", "log", 2, False), ("0.31.0", "raise", 1, False), ("0.32.0", "raise", 2, False), ("0.33.1", "raise", 2, False),
])  # fmt: skip
def test_a_policy_that_stops_the_step_under_tensor_parallelism_is_refused_where_the_engine_would_hang(
    monkeypatch, version, policy, tensor_parallel_size, refused
):
    monkeypatch.setattr(adapter, "vllm_version", lambda: version)
    buffers = fake_runner.StepBuffers("v1", layers=2, requests=2, context=8, decode_steps=1)
    runner = fake_runner.FakeRunner(buffers)
    runner.tensor_parallel_size = tensor_parallel_size
    if refused:
        message = (
            rf"^kv-canary: KVCANARY_VLLM={policy} stops the engine step with an exception, and on vLLM {re.escape(version)} the other "
            r"tensor-parallel ranks then wait for the raising one: .* or vLLM 0.32 or later, or unset KVCANARY_VLLM"
        )
        with pytest.raises(RuntimeError, match=message):
            worker.WorkerCanary(buffers, config.Settings(policy, HashMode.ALL), runner_view=runner)
    else:
        try:
            worker.WorkerCanary(buffers, config.Settings(policy, HashMode.ALL), runner_view=runner)
        except ValueError as error:  # the connector policies' own needs, which the bench runner does not meet
            assert "needs vLLM's KV connector" in str(error) and policy in ("repair", "quarantine")
