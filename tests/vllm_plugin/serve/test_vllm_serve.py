"""The vLLM plugin through `vllm serve` (vLLM's CPU build, its default multiprocess engine,
the OpenAI API on 127.0.0.1): a soak of mixed requests that share prefixes is clean, and the
engine's memory grows no more over its measured passes with the canary than without it
(while a plugin that leaks grows it past the bound); a byte flipped in a cached block (the
tests' plugin, `vllm_serve.FLIP_PLUGIN`) is reported once, naming the request that read it,
and the server keeps serving. `make soak-vllm` runs the same soak.
"""

import re

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from helpers import HOST_AMX, PROJECT_VERSION, needs_isa  # noqa: E402

from torch_kvcanary.testing.random_models import VOCAB_SIZE, make_model  # noqa: E402
from torch_kvcanary.testing.serve import Server, flip, install_flip_plugin, install_vllm_plugin, path_with  # noqa: E402
from torch_kvcanary.testing.soak.memory import CANARY_GROWTH_BOUND, soak_server, soak_workload, soaks_in_turns  # noqa: E402

# The soak (about 10 s a pass here, four passes a server): 1,000 requests, enough for a request to read, in one
# step, a block another request of the step writes (recorded in the right order,
# `worker._CanaryStep`), and for a leak of a few KiB a request to stand out of the
# allocators' noise (`soak.memory.CANARY_GROWTH_BOUND`).
SOAK_REQUESTS = 1000
SOAK_ENV = dict(KVCANARY_VLLM="log")

# A vLLM general plugin of the test's own that leaks: the worker keeps every request's prompt
# as vLLM hands it over (its NewRequestData), about 6 KiB a request of the soak.
LEAK_PLUGIN = """
def register():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    kept = []
    update_states = GPUModelRunner._update_states

    def update_states_keeping_every_prompt(self, scheduler_output):
        kept.extend(scheduler_output.scheduled_new_reqs)
        return update_states(self, scheduler_output)

    GPUModelRunner._update_states = update_states_keeping_every_prompt
"""


@pytest.fixture(scope="module")
def soaked(tiny_llama):
    """The soak with the canary off, then on: (off, on)."""
    off, on = soaks_in_turns(tiny_llama, soak_workload(SOAK_REQUESTS, VOCAB_SIZE), SOAK_ENV)
    print("canary off:", off.summary())
    print("canary on: ", on.summary())
    return off, on


def test_a_soak_through_vllm_serve_is_clean_and_flat(soaked):
    off, on = soaked
    for result in soaked:
        assert not result.errors, result.errors[:3]
        assert result.generated_tokens > SOAK_REQUESTS
        # The workload did what it is meant to: reused cached prefixes and preempted requests
        # (its opening burst outgrows the KV pool on any host, `vllm_serve.preemption_burst`).
        assert result.prefix_cache_hits > 0 and result.preemptions > 0, result.summary()
    assert on.violation_lines == [] and on.canary_warnings == []
    # Both passes answer alike with the canary on and off: it changes no token.
    assert on.generated_tokens == off.generated_tokens
    assert on.growth - off.growth < CANARY_GROWTH_BOUND, (off.summary(), on.summary())


def test_the_soak_fails_a_plugin_that_keeps_every_prompt(soaked, tiny_llama, tmp_path):
    """The memory check measures a leak, not first touch: the same soak with a plugin that
    keeps every request's prompt grows past the bound where the canary alone does not."""
    off, _ = soaked
    site = install_vllm_plugin(tmp_path, "kvcanary_test_leak", LEAK_PLUGIN)
    env = dict(SOAK_ENV, KVCANARY_VLLM_SUMMARY_S="0", PYTHONPATH=path_with(site))
    leaking = soak_server(tiny_llama, soak_workload(SOAK_REQUESTS, VOCAB_SIZE), env)
    print("canary on, leaking:", leaking.summary())
    assert not leaking.errors and leaking.violation_lines == []
    assert leaking.growth - off.growth >= CANARY_GROWTH_BOUND, (off.summary(), leaking.summary())


# Each kind of attention model (`testing.random_models`): full attention, a sliding window,
# full and sliding groups over one pool, chunked-local and full groups, MLA, M-RoPE.
KINDS = ("llama", "mistral", "gemma2", "llama4", "deepseek_v2", "qwen2_vl")
# The flipped position: in the prompt's last full block, inside every kind's window
# (`random_models`: 48 tokens) for the requests that extend the prompt.
FLIPPED = 90


# The flipped block is read again through the prefix cache, which vLLM turns off for MLA
# models on a host without AMX.
ISA_MARKS = {"deepseek_v2": needs_isa("MLA prefix caching", HOST_AMX)}


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=ISA_MARKS.get(kind, ())) for kind in KINDS])
def test_a_flipped_byte_is_reported_once_naming_the_request(kind, tiny_llama, tmp_path):
    site = install_flip_plugin(tmp_path)
    model = tiny_llama if kind == "llama" else make_model(tmp_path / kind, kind)
    env = dict(KVCANARY_VLLM="log", KVCANARY_VLLM_SUMMARY_S="0", VLLM_SERVER_DEV_MODE="1", PYTHONPATH=path_with(site))
    prompt = list(range(10, 110))
    with Server(model, env) as server:
        assert "error" not in server.complete(prompt, 4)  # its blocks stay in the prefix cache
        assert server.canary_lines() and not [m for *_, m in server.canary_lines() if m.startswith("kv_canary violation")]
        slot = flip(server, prompt[FLIPPED], FLIPPED)
        readers = [server.complete(prompt + [200 + i], 8) for i in range(2)]
        other = server.complete(list(range(300, 340)), 8)
        assert all("error" not in answer for answer in [*readers, other]) and server.alive()
        canary = server.canary_lines()
    starts = [message for *_, message in canary if message.startswith("kv-canary: watching")]
    assert starts and all(message.endswith(f"; torch_kvcanary {PROJECT_VERSION}") for message in starts), starts
    violations = [message for _, _, level, message in canary if message.startswith("kv_canary violation")]
    (violation,) = violations  # once, at its first detection; its later ones go to the summary
    match = re.search(r" slot_idx=(\d+) .* request_id=(\S+)$", violation)
    assert match and int(match[1]) // 32 == int(slot) // 32, violation  # CPU_ATTN packs a block's rows
    assert match[2].startswith(readers[0]["id"]), (violation, readers[0]["id"])
    summaries = [m for _, _, _, m in canary if m.startswith("kv_canary summary")]
    repeated = sum(int(re.search(r"repeated_detections=(\d+)", m)[1]) for m in summaries)
    assert repeated > 0  # the second reader, and each later step of both, read it again
