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

import random
import shutil

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")

from connector_driver import _greedy, connector_engine  # noqa: E402
from engine_driver import BLOCK_SIZE, random_tokens  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

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


def test_example_connector_serves_another_adapters_kv_as_its_own(tiny_llama, adapters, tmp_path):
    # vLLM #53495 without the canary: y's clean answer (its own KV stored), then x stores
    # its KV under the same tokens, and y loads x's KV and answers otherwise, with no error.
    storage = Storage(tmp_path / "kv")
    prompt = random_tokens(random.Random(61), PROMPT_LENGTH)
    with connector_engine(tiny_llama, "", kv_transfer_config=storage.example, **LORA) as (llm, _, _):
        base = _run(llm, prompt)
        storage.clear()
        clean = _run(llm, prompt, adapters["y"])
        assert clean.num_cached_tokens == 0
        storage.clear()
        other = _run(llm, prompt, adapters["x"])
        assert other.num_cached_tokens == 0
        assert len({tuple(output.outputs[0].token_ids) for output in (base, clean, other)}) == 3, "the adapters change nothing"
        wrong = _run(llm, prompt, adapters["y"])
        assert wrong.num_cached_tokens == STORED  # x's KV, from x's folder
        assert wrong.outputs[0].finish_reason == "length"
        assert wrong.outputs[0].token_ids != clean.outputs[0].token_ids
