"""KV of another identity through vLLM's ExampleConnector, on the real engine (vLLM's CPU
build, in-process, LoRA on): ExampleConnector keys a request's folder on its prompt tokens
alone (vLLM #53495), so a request under LoRA adapter y loads the KV that adapter x computed
for the same tokens and answers with it. Plain, y's answer differs from its clean one; under
`KvCanaryConnector` with ``repair`` the load is named as KV of another identity and
recomputed, and y answers as it does clean. The same holds for a ``cache_salt``, and a load
of the request's own identity is silent.
The adapters are random (`torch_kvcanary.testing.lora`), their B matrices non-zero on the K
and V projections, so x and y write different KV for the same tokens.
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from connector_driver import Reported, _greedy, _metric, _worker_connector, connector_engine  # noqa: E402
from engine_driver import BLOCK_SIZE, parse_violations, random_tokens  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from torch_kvcanary.integrations.vllm import config, connector  # noqa: E402
from torch_kvcanary.testing.lora import make_lora  # noqa: E402

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=1)
# ExampleConnector stores and loads a prompt's whole blocks but its last token's.
PROMPT_LENGTH = 2 * BLOCK_SIZE + 10
STORED = 2 * BLOCK_SIZE


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    """Adapters x and y for the tiny Llama, as vLLM's LoRA requests."""
    folder = tmp_path_factory.mktemp("lora")
    return {
        name: LoRARequest(name, lora_id, str(make_lora(folder / name, tiny_llama, seed=lora_id)))
        for lora_id, name in enumerate(("x", "y"), start=1)
    }


class Storage:
    """ExampleConnector's folder, and its settings as an inner connector or on its own."""

    def __init__(self, path):
        self.path = path
        path.mkdir()
        self.example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }

    def clear(self) -> None:
        """Forgets every stored request, so that the next request of a prompt stores it anew."""
        for folder in self.path.iterdir():
            shutil.rmtree(folder)


def _run(llm, prompt: list[int], lora: LoRARequest | None = None, **inputs):
    """One greedy request of ``prompt`` under ``lora``, after a reset of the prefix cache (so
    that its context comes from ExampleConnector's folder or from its own forward)."""
    llm.reset_prefix_cache()
    (output,) = llm.generate([{"prompt_token_ids": prompt, **inputs}], _greedy(16), lora_request=lora, use_tqdm=False)
    return output


# The plain flow runs in a process of its own: once the plugin has hooked vLLM in a process,
# every engine it starts there runs the canary.
PLAIN = """
import json, shutil, sys
from pathlib import Path
import vllm
from vllm.lora.request import LoRARequest

model, storage, prompt = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
adapters = {name: LoRARequest(name, lora_id, path) for name, lora_id, path in json.loads(sys.argv[4])}
inner = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
llm = vllm.LLM(
    model=model, dtype="float32", max_model_len=512, block_size=32, kv_cache_memory_bytes=4 << 20, enforce_eager=True,
    enable_prefix_caching=True, distributed_executor_backend="uni", kv_transfer_config=inner, **json.loads(sys.argv[5]),
)
answers = {}
for name, adapter, forget in (("base", None, False), ("clean", "y", True), ("other", "x", True), ("wrong", "y", False)):
    if forget:  # the next request of the prompt stores it anew
        for folder in storage.iterdir():
            shutil.rmtree(folder)
    llm.reset_prefix_cache()
    params = vllm.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=adapters.get(adapter), use_tqdm=False)
    answers[name] = [list(output.outputs[0].token_ids), output.num_cached_tokens, output.outputs[0].finish_reason]
print("ANSWERS " + json.dumps(answers), flush=True)
"""


def _plain(model, storage, prompt: list[int], adapters: dict[str, LoRARequest]) -> dict[str, list]:
    """The answers of `PLAIN` in a Python process of its own, without the plugin (``-P``: it
    imports the installed packages, not the checkout); its process group is killed once it exited."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    loras = [(name, lora.lora_int_id, lora.lora_path) for name, lora in adapters.items()]
    command = [sys.executable, "-P", "-c", PLAIN, str(model), str(storage), json.dumps(prompt), json.dumps(loras), json.dumps(LORA)]
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    said = [line for line in output.splitlines() if line.startswith("ANSWERS ")]
    assert process.returncode == 0 and said, output[-4000:]
    return json.loads(said[0].removeprefix("ANSWERS "))


def test_example_connector_serves_another_adapters_kv_as_its_own(tiny_llama, adapters, tmp_path):
    # vLLM #53495 without the canary: y's clean answer (its own KV stored), then x stores
    # its KV under the same tokens, and y loads x's KV and answers otherwise, with no error.
    storage = Storage(tmp_path / "kv")
    answers = _plain(tiny_llama, storage.path, random_tokens(random.Random(61), PROMPT_LENGTH), adapters)
    (base, _, _), (clean, clean_cached, _), (other, other_cached, _) = answers["base"], answers["clean"], answers["other"]
    assert clean_cached == other_cached == 0
    assert len({tuple(base), tuple(clean), tuple(other)}) == 3, "the adapters change nothing"
    wrong, cached, finish_reason = answers["wrong"]
    assert cached == STORED  # x's KV, from x's folder
    assert finish_reason == "length" and wrong != clean


def _canary_transfer(storage: Storage) -> dict:
    """`KvCanaryConnector` under repair, ExampleConnector inside."""
    inner = {connector.INNER: storage.example}
    return {
        "kv_connector": config.CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": inner,
    }


def _identity_failures() -> float:
    return _metric("vllm:kv_canary_transfer_slots_failed_total", kind="identity")


def _assert_named(said: list[str], request_id: str) -> None:
    """One line names the request's load as KV of another identity, beside the violation
    lines of its slots (their folds broken as they landed)."""
    named = [line for line in said if line.startswith("kv-canary: request ")]
    assert len(named) == 1, said
    assert re.match(rf"kv-canary: request {re.escape(request_id)}\S*: {STORED} of the {STORED} slots ExampleConnector loaded", named[0])
    assert "another identity" in named[0] and "(counted as identity)" in named[0], named[0]
    violations = [line for line in said if line not in named]
    assert len(violations) == STORED and all(reasons == ["verify_real_kv_hash"] for reasons, _, _ in parse_violations(violations))


def test_kv_of_another_identity_is_named_and_repaired(tiny_llama, adapters, tmp_path, monkeypatch):
    # The flow of the plain test under KvCanaryConnector with repair: y loading its own KV is
    # silent; y loading x's is named (kind identity) and recomputed, and answers as clean.
    # Then a cache salt: s2 loading the KV stored under s1 is named, s1 loading it is silent.
    storage = Storage(tmp_path / "kv")
    rng = random.Random(62)
    prompt, salted = random_tokens(rng, PROMPT_LENGTH), random_tokens(rng, PROMPT_LENGTH)
    with connector_engine(tiny_llama, "repair", kv_transfer_config=_canary_transfer(storage), **LORA) as (llm, lines, _):
        reported = Reported(monkeypatch, _worker_connector())
        clean = _run(llm, prompt, adapters["y"])
        assert clean.num_cached_tokens == 0
        failed = _identity_failures()
        own = _run(llm, prompt, adapters["y"])
        assert own.num_cached_tokens == STORED and own.outputs[0].token_ids == clean.outputs[0].token_ids
        assert (lines.take(), reported.take(), _identity_failures() - failed) == ([], set(), 0)
        storage.clear()
        _run(llm, prompt, adapters["x"])
        loaded = _run(llm, prompt, adapters["y"])
        assert loaded.num_cached_tokens == STORED  # x's KV, from x's folder
        assert loaded.outputs[0].token_ids == clean.outputs[0].token_ids
        assert len(reported.take()) == STORED // BLOCK_SIZE  # both loaded blocks, recomputed
        assert _identity_failures() - failed == STORED
        _assert_named(lines.take(), loaded.request_id)

        first = _run(llm, salted, cache_salt="s1")
        assert first.num_cached_tokens == 0
        same = _run(llm, salted, cache_salt="s1")
        assert same.num_cached_tokens == STORED and (lines.take(), _identity_failures() - failed) == ([], STORED)
        other = _run(llm, salted, cache_salt="s2")
        assert other.num_cached_tokens == STORED and other.outputs[0].token_ids == first.outputs[0].token_ids
        assert _identity_failures() - failed == 2 * STORED
        _assert_named(lines.take(), other.request_id)
