"""Prompt embeddings on one server (vLLM's CPU build, in-process, ``enable_prompt_embeds``,
prefix caching, the plugin under ``repair`` with `KvCanaryConnector`): vLLM's forward then
runs on ``inputs_embeds`` and gets no input ids, so the plugin records what fed each position
itself: the token id, or for a position given as an embedding row that row's word
(`torch_kvcanary.identity.embedding_word`, docs/spec.md section 8).

vLLM #56655: a mixed request's mask of token and embedding positions is not part of vLLM
0.32's block hash (its embeddings and its token ids are, with 0 at the embedding positions),
so a request that feeds token 0 at those positions, with the same embeddings beside, hits the
blocks computed from the embedding rows. The canary names that read (``verify_token``) and
under ``repair`` vLLM recomputes the reader, which answers as it does alone.
"""

import random
import re

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from connector_driver import Reported, _greedy, _worker_connector, connector_engine  # noqa: E402
from engine_driver import BLOCK_SIZE, ENGINES, parse_violations, random_tokens  # noqa: E402

from torch_kvcanary.identity import embedding_word  # noqa: E402
from torch_kvcanary.integrations.vllm import plugin  # noqa: E402
from torch_kvcanary.testing.random_models import TINY  # noqa: E402

LENGTH = 2 * BLOCK_SIZE + 10  # two whole blocks a later request finds in the prefix cache
EMBEDDED = range(5, 9)  # the positions a mixed prompt gives as embedding rows, in its first block
TOKENS = re.compile(r"position=(\d+) stored_token=(-?\d+) expected_token=(-?\d+)")


@pytest.fixture
def engine(tiny_llama):
    return ENGINES.get(("prompt-embeds", "repair"), lambda: connector_engine(tiny_llama, "repair", enable_prompt_embeds=True))


def _embeddings(seed: int) -> torch.Tensor:
    return torch.randn(LENGTH, TINY["hidden_size"], generator=torch.Generator().manual_seed(seed)) * 0.05


def _run(llm, prompt: dict):
    (output,) = llm.generate([prompt], _greedy(4), use_tqdm=False)
    return output


def _answer(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def _prompt(kind: str, seed: int) -> dict:
    tokens = {"prompt_token_ids": random_tokens(random.Random(seed), LENGTH)}
    if kind == "tokens":
        return tokens
    if kind == "embeddings":
        return {"prompt_embeds": _embeddings(seed)}
    return {**tokens, "prompt_embeds": _embeddings(seed), "prompt_is_token_ids": [p not in EMBEDDED for p in range(LENGTH)]}


def test_the_start_line_says_prompt_embeddings_are_read(engine):
    llm, _, _ = engine
    described = plugin.active().request_roots.describe()
    assert "prompt embeddings (a word per embedding row)" in described and "not read" not in described


@pytest.mark.parametrize("kind", ["tokens", "embeddings", "mixed"])
def test_a_prompt_asked_twice_is_silent(engine, kind, monkeypatch):
    llm, lines, _ = engine
    reported = Reported(monkeypatch, _worker_connector())
    prompt = _prompt(kind, seed=len(kind))
    first, second = _run(llm, prompt), _run(llm, prompt)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 2 * BLOCK_SIZE
    assert _answer(second) == _answer(first)
    assert lines.take() == [] and reported.take() == set()


def test_token_zero_after_embedding_rows_is_named_and_recomputed(engine, monkeypatch):
    # vLLM #56655: `mixed` gives EMBEDDED as rows of `embeds`; `zeros` feeds token 0 there,
    # the same rows beside: both hash alike, so `zeros` hits `mixed`'s blocks.
    llm, lines, _ = engine
    reported = Reported(monkeypatch, _worker_connector())
    tokens = random_tokens(random.Random(3), LENGTH)
    embeds = _embeddings(3)
    mask = [p not in EMBEDDED for p in range(LENGTH)]
    zeros = {
        "prompt_embeds": embeds,
        "prompt_token_ids": [t if m else 0 for t, m in zip(tokens, mask)],
        "prompt_is_token_ids": [True] * LENGTH,
    }
    mixed = {"prompt_embeds": embeds, "prompt_token_ids": tokens, "prompt_is_token_ids": mask}
    alone = _answer(_run(llm, zeros))
    llm.reset_prefix_cache()
    assert _answer(_run(llm, mixed)) != alone  # the rows' KV differs from token 0's
    after = _run(llm, zeros)
    assert after.num_cached_tokens == 2 * BLOCK_SIZE  # vLLM served the rows' blocks
    found = lines.take()
    violations = parse_violations(found)
    assert {tuple(reasons) for reasons, _, _ in violations} == {("verify_token",)}
    assert {slot % BLOCK_SIZE for _, slot, _ in violations} == set(EMBEDDED)
    # Each embedded position holds its row's word (docs/spec.md section 8); the reader gave 0.
    fields = sorted(tuple(int(v) for v in TOKENS.search(line).groups()) for line in found)
    assert fields == [(p, embedding_word(embeds[p]), 0) for p in EMBEDDED]
    assert reported.take() == {violations[0][1] // BLOCK_SIZE}
    assert _answer(after) == alone  # recomputed as token 0
    assert lines.take() == []
