"""The vLLM plugin on Model Runner V2 (vLLM's CPU build, V2's CPU runner), each engine in a
Python process of its own; the tests of one configuration share one (`v2_log`).

V2 runs its bookkeeping kernels in Triton, and vLLM's CPU build here has Triton without a CPU
backend, so vLLM turns Triton off and V2 cannot run. Triton's interpreter (``TRITON_INTERPRET=1``)
runs Triton kernels on CPU tensors in Python: with it, and vLLM's Triton gates satisfied in
the test's process only (`TRITON_ON_CPU`), V2's CPU runner serves, and the plugin watches it
through V2's own forward bracket (`adapter.v2._ForwardBracket`).
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from helpers import REPO  # noqa: E402

from torch_kvcanary.testing.random_models import make_model  # noqa: E402

# vLLM's CPU build finds Triton but no "cpu" backend in it, and turns Triton off; a "cpu"
# entry whose driver is never active satisfies that check, and the two gates of Model Runner
# V2 are set as Triton's presence would set them. The kernels then run in Triton's interpreter.
TRITON_ON_CPU = """
import types
import triton.backends

class _InactiveDriver:
    @staticmethod
    def is_active():
        return False

triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_InactiveDriver, compiler=None))
import vllm.config.vllm, vllm.v1.worker.gpu_worker
vllm.config.vllm.HAS_TRITON = vllm.v1.worker.gpu_worker.HAS_TRITON = True
"""

ENGINE = """
import json, random, sys
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler
from torch_kvcanary.integrations.vllm import plugin

preemptions = []
preempt = Scheduler._preempt_request

def counting_preempt(self, request, *args, **kwargs):
    preemptions.append(request.request_id)
    return preempt(self, request, *args, **kwargs)

Scheduler._preempt_request = counting_preempt
BLOCK = 32
llm = vllm.LLM(
    model=sys.argv[1], dtype="bfloat16", max_model_len=512, block_size=BLOCK, kv_cache_memory_bytes=900 << 10,
    enforce_eager=True, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64,
    max_num_seqs=8, distributed_executor_backend="uni",
)
state = plugin.active()
runner = state.model_runner
print("RUNNER", type(runner).__module__, type(state.runner_view).__name__, flush=True)
greedy = lambda n: vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
tokens = lambda rng, n: [rng.randrange(2, 512) for _ in range(n)]

def request_index(request_id):
    return next(i for rid, i in runner.req_states.req_id_to_index.items() if rid.rsplit("-", 1)[0] == request_id)

def blocks(request_id):
    index = request_index(request_id)
    return runner.block_tables.block_tables[0].gpu[index, : runner.block_tables.num_blocks.np[0, index]].tolist()

def internal_id(request_id):
    return next(rid for rid in runner.req_states.req_id_to_index if rid.rsplit("-", 1)[0] == request_id)

def decoding(ids, engine):
    for _ in range(60):
        engine.step()
        if all(any(r.rsplit("-", 1)[0] == i for r in runner.req_states.req_id_to_index) for i in ids) and all(
            runner.req_states.num_computed_tokens_np[request_index(i)] >= 2 * BLOCK + 4 for i in ids
        ):
            return
    raise AssertionError("the requests did not all reach decoding")
"""

MIXED_WORKLOAD = """
rng = random.Random(1)
prefix = tokens(rng, 2 * BLOCK + 5)
prompts = [prefix + tokens(rng, 10 + 23 * i) for i in range(10)]
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(60 + 25 * (i % 4)) for i in range(10)], use_tqdm=False)
print("MIXED", json.dumps(dict(
    lengths=[len(o.outputs[0].token_ids) for o in outputs], cached=max(o.num_cached_tokens for o in outputs),
    preempted=len(preemptions), longest_prompt=max(map(len, prompts)), stats=state.canary.stats(),
)), flush=True)
"""

# A fault (sys.argv[2] or a section's: "flip" or "table") injected into one of three requests
# decoding, named by the kind; two steps then read it. Its requests end with the section.
FAULT = """
def fault(kind):
    engine = llm.llm_engine
    ids = [f"{kind}-{i}" for i in range(3)]
    rng = random.Random(2)
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, {"prompt_token_ids": tokens(rng, 70 + 9 * i)}, greedy(200))
    decoding(ids, engine)
    victim, other = ids[1], ids[2]
    if kind == "flip":
        block = blocks(victim)[1]
        state.kv_caches[1].view(torch.int16)[block, 1, 5, 77] ^= 1 << 9
    else:  # the victim's second block-table entry points at another request's second block
        block = blocks(other)[1]
        runner.block_tables.block_tables[0].gpu[request_index(victim), 1] = block
    print("FAULT", json.dumps(dict(block=block, victim=internal_id(victim), block_size=BLOCK)), flush=True)
    try:
        engine.step()
        engine.step()
    except Exception as error:
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__
        print("RAISED", type(error).__name__, flush=True)
        return
    engine.abort_request(ids)
    for _ in range(3):
        engine.step()
    llm.reset_prefix_cache()  # the flipped block's bytes stay wrong
"""

LINE = re.compile(r"kv_canary violation: launch_tag=vllm fail_reason=(\S+) slot_idx=(\d+) .* request_id=(\S+)$")


def _run(model, script: str, *args: str, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    environment.update(VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TRITON_INTERPRET="1", **env)
    command = [sys.executable, "-P", "-c", TRITON_ON_CPU + ENGINE + textwrap.dedent(script), str(model), *args]
    done = subprocess.run(command, env=environment, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert "RUNNER vllm.v1.worker.cpu.model_runner RunnerV2\n" in done.stdout, done.stdout[-4000:]
    return done.stdout


def _result(output: str, key: str):
    (line,) = [line for line in output.splitlines() if line.startswith(key + " ")]
    return json.loads(line[len(key) + 1 :])


def test_model_runner_v2_is_watched_and_a_mixed_workload_raises_no_false_alarm(v2_log):
    output = v2_log["start"] + v2_log["mixed"]
    assert re.search(r"kv-canary: watching vllm\.v1\.worker\.cpu\.model_runner\.CPUModelRunner: 1 KV cache group", output)
    mixed = _result(output, "MIXED")
    assert mixed["lengths"] == [60 + 25 * (i % 4) for i in range(10)]
    assert mixed["stats"]["violations"] == 0 and "kv_canary violation" not in output
    assert mixed["stats"]["slots_verified"] > 10_000 and mixed["stats"]["slots_recorded"] > 1_000
    assert mixed["cached"] >= 64, "the shared prefix was meant to hit the prefix cache"
    assert mixed["preempted"], "the KV space was meant to be small enough to preempt"
    assert mixed["longest_prompt"] > 64  # chunked prefill


KINDS = """
import json, random, sys
import vllm
from torch_kvcanary.integrations.vllm import plugin

llm = vllm.LLM(
    model=sys.argv[1], dtype="bfloat16", max_model_len=512, block_size=32, kv_cache_memory_bytes=8 << 20, enforce_eager=True,
    enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=8, distributed_executor_backend="uni",
)
state = plugin.active()
rng = random.Random(1)
prefix = [rng.randrange(2, 500) for _ in range(70)]
prompts = [{"prompt_token_ids": prefix + [rng.randrange(2, 500) for _ in range(10 + 23 * i)]} for i in range(8)]
outputs = llm.generate(prompts, vllm.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), use_tqdm=False)
print("KINDS", json.dumps(dict(
    runner=type(state.runner_view).__name__, groups=[group.kind for group in state.groups], stats=state.canary.stats(),
    lengths=[len(o.outputs[0].token_ids) for o in outputs], cached=max(o.num_cached_tokens for o in outputs),
    prefix_caching=llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
)), flush=True)
"""


@pytest.mark.parametrize(
    "kind, groups",
    [
        ("mistral", ["SlidingWindowSpec"]),
        ("gemma2", ["SlidingWindowSpec", "FullAttentionSpec"]),
        ("deepseek_v2", ["MLAAttentionSpec"]),
        ("llama4", ["ChunkedLocalAttentionSpec", "FullAttentionSpec"]),
    ],
)
def test_model_runner_v2_watches_every_attention_kind(tmp_path, kind, groups):
    # The model kinds of tests/vllm_plugin/adapter/test_vllm_models.py (which runs them on V1, faults included):
    # on V2, a workload with prefix cache hits and chunked prefill raises no false alarm (vLLM
    # turns both off for MLA models on a host without AMX: tests/helpers.py, ISA_SKIP_REASONS).
    model = make_model(tmp_path / kind, kind)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    environment.update(VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TRITON_INTERPRET="1", KVCANARY_VLLM="log")
    command = [sys.executable, "-P", "-c", TRITON_ON_CPU + textwrap.dedent(KINDS), str(model)]
    done = subprocess.run(command, env=environment, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    found = _result(done.stdout, "KINDS") if "KINDS " in done.stdout else None
    assert found is not None, done.stdout[-3000:]
    assert found["runner"] == "RunnerV2" and found["groups"] == groups
    assert found["lengths"] == [60] * 8
    assert found["cached"] >= 64 if found["prefix_caching"] else found["cached"] == 0
    assert found["stats"]["violations"] == 0 and found["stats"]["slots_verified"] > 10_000 and "kv_canary violation" not in done.stdout


@pytest.mark.parametrize("fault", ["flip", "table"])
def test_model_runner_v2_a_fault_names_its_request(v2_log, fault):
    output = v2_log[fault]
    injected = _result(output, "FAULT")
    found = [LINE.search(line).groups() for line in output.splitlines() if LINE.search(line)]
    assert found, f"the {fault} was not reported:\n{output[-3000:]}"
    assert "RAISED" not in output
    for reasons, slot, requests in found:
        assert requests.split(",") == [injected["victim"]]
        if fault == "flip":
            assert reasons == "verify_real_kv_hash" and int(slot) // injected["block_size"] == injected["block"]
    if fault == "table":  # another request's tokens, read from V2's token history; every byte intact
        reasons = {reason for found_reasons, _, _ in found for reason in found_reasons.split("+")}
        assert "verify_token" in reasons and "verify_chain_hash" in reasons and "verify_real_kv_hash" not in reasons


def test_model_runner_v2_under_raise_stops_the_step(tiny_llama):
    output = _run(tiny_llama, FAULT + "fault(sys.argv[2])\n", "flip", KVCANARY_VLLM="raise")
    assert "RAISED KvCorruptionError" in output, output[-3000:]


# A V2 runner class whose execute_model runs the step past V2's forward bracket (here by
# handing the model its KV connector unwrapped for the call): a subclass is watchable, and
# the step that skips the bracket stops the engine, naming the runner.
PAST_THE_BRACKET = """
from torch_kvcanary.integrations.vllm import adapter
from vllm.v1.worker.cpu.model_runner import CPUModelRunner

class PastTheBracket(CPUModelRunner):
    def execute_model(self, scheduler_output, *args, **kwargs):
        bracket = self.kv_connector
        self.kv_connector = bracket._connector
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self.kv_connector = bracket

print("UNWATCHABLE", json.dumps(adapter.unwatchable(object.__new__(PastTheBracket))), flush=True)
llm.generate([{"prompt_token_ids": list(range(5, 40))}], greedy(4), use_tqdm=False)  # watched
runner.__class__ = PastTheBracket
try:
    llm.generate([{"prompt_token_ids": list(range(45, 80))}], greedy(4), use_tqdm=False)
    print("GENERATED", flush=True)
except Exception as error:
    messages = []
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    print("RAISED", json.dumps(" | ".join(messages)), flush=True)
"""


# The engine under log runs its tests one after another, each in a section of its output:
# the mixed workload first (it asserts no violation at all), then each fault on requests of
# its own, then the step past the forward bracket, which ends the engine.
V2_LOG_SECTIONS = {
    "mixed": MIXED_WORKLOAD,
    "flip": "fault('flip')",
    "table": "fault('table')",
    "past the bracket": PAST_THE_BRACKET,
}


@pytest.fixture(scope="module")
def v2_log(tiny_llama) -> dict[str, str]:
    """The output of each section of `V2_LOG_SECTIONS` from one engine under log."""
    script = FAULT + "".join(f"print('SECTION {name}', flush=True)\n{code}\n" for name, code in V2_LOG_SECTIONS.items())
    output = _run(tiny_llama, script, KVCANARY_VLLM="log")
    sections, name = {"start": []}, "start"
    for line in output.splitlines():
        if line.startswith("SECTION "):
            name = line[len("SECTION ") :]
            sections[name] = []
        sections[name].append(line)
    assert list(sections) == ["start", *V2_LOG_SECTIONS], output[-4000:]
    return {name: "\n".join(lines) + "\n" for name, lines in sections.items()}


def test_a_model_runner_v2_step_past_its_forward_bracket_stops_the_engine(v2_log):
    output = v2_log["past the bracket"]
    assert _result(output, "UNWATCHABLE") is None
    assert "GENERATED" not in output
    assert (
        "kv-canary: the vLLM plugin did not see the model forward of an engine step of __main__.PastTheBracket: its execute_model "
        "ran the step's tokens without its KV connector's pre_forward (vllm.v1.worker.gpu.model_runner.GPUModelRunner's bracket "
        "of every forward)"
    ) in _result(output, "RAISED"), output[-3000:]


def test_model_runner_v2_refuses_the_kv_connector(tiny_llama):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    environment.update(VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TRITON_INTERPRET="1", KVCANARY_VLLM="repair")
    start = TRITON_ON_CPU + textwrap.dedent("""
        import sys, vllm
        try:
            vllm.LLM(
                model=sys.argv[1], dtype="bfloat16", max_model_len=512, block_size=32, kv_cache_memory_bytes=900 << 10,
                enforce_eager=True, distributed_executor_backend="uni", async_scheduling=False,
                kv_transfer_config={"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"},
            )
        except Exception as error:
            while error.__cause__ is not None or error.__context__ is not None:
                error = error.__cause__ or error.__context__
            print("REFUSED", error)
    """)
    done = subprocess.run([sys.executable, "-P", "-c", start, str(tiny_llama)], env=environment, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    (refused,) = [line for line in done.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused.startswith(
        "REFUSED kv-canary: KVCANARY_VLLM=repair needs Model Runner V1 for the KV connector (VLLM_USE_V2_MODEL_RUNNER=0)"
    )
