"""A request's identity on one server (vLLM's CPU build, in-process, LoRA on, prefix caching):
vLLM 0.32 keys a LoRA request's prefix-cache blocks on the adapter's name and path
(``kv_cache_utils._gen_lora_extra_hash_keys``), so an adapter reloaded in place (same name,
same path, other weights: ``LoRARequest(load_inplace=True)``) keeps serving the blocks its
old weights computed (vLLM #42125, #30931). The canary roots each request's records in its
adapter's weights as the worker loaded them, so that hit is a violation naming the reader,
the slot and ``verify_identity``; under ``repair`` vLLM recomputes the reader, which then
answers as the new weights do; under ``quarantine`` it fails the reader alone. Requests of
one identity share their blocks silently, beside requests of none, of a cache salt, and of
adapters unloaded and loaded again, under the same int id or another (vLLM numbers adapters
per server: the root holds the adapter's name and weights, not its id).

The adapters are random (`torch_kvcanary.testing.lora`), B non-zero on the K and V
projections, so two of them write different KV for the same tokens.
"""

import random
import shutil
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from connector_driver import Reported, _greedy, _worker_connector, connector_engine  # noqa: E402
from engine_driver import BLOCK_SIZE, parse_violations, random_tokens  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from torch_kvcanary.integrations.vllm import plugin  # noqa: E402
from torch_kvcanary.testing.lora import make_lora  # noqa: E402

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
PROMPT_LENGTH = 2 * BLOCK_SIZE + 10  # two whole blocks a later request finds in the prefix cache
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory) -> dict[str, object]:
    """Adapters x and y for the tiny Llama, each in its own folder."""
    folder = tmp_path_factory.mktemp("lora")
    return {name: make_lora(folder / name, tiny_llama, seed=seed) for seed, name in enumerate(("x", "y"), start=1)}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with connector_engine(tiny_llama, "repair", **LORA) as started:
        yield started


def _run(llm, prompts: list[dict], lora: LoRARequest | None = None):
    return llm.generate(prompts, _greedy(8), lora_request=lora, use_tqdm=False)


def _answer(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def _reloaded_in_place(llm, folders, tmp_path, name: str, lora_id: int):
    """Adapter ``name`` loaded from a copy of x's folder answers a prompt (its blocks cached);
    then its folder gets y's weights and it is reloaded in place, as vLLM's
    ``/v1/load_lora_adapter`` with ``load_inplace`` does. (its request, the prompt, x's answer
    and y's clean answer of the prompt: y under its own name computes it afresh)."""
    folder = tmp_path / name
    shutil.copytree(folders["x"], folder)
    lora = LoRARequest(name, lora_id, str(folder))
    prompt = {"prompt_token_ids": random_tokens(random.Random(lora_id), PROMPT_LENGTH)}
    (before,) = _run(llm, [prompt], lora)
    (clean,) = _run(llm, [prompt], LoRARequest("y", 2, str(folders["y"])))
    assert clean.num_cached_tokens == 0 and _answer(clean) != _answer(before)  # the adapters' KV differ
    shutil.copy(folders["y"] / WEIGHTS, folder / WEIGHTS)
    assert llm.llm_engine.add_lora(LoRARequest(name, lora_id, str(folder), load_inplace=True))
    return lora, prompt, _answer(before), _answer(clean)


def _identity_line(lines, request_id: str) -> int:
    """The slot of the one violation of ``lines``: verify_identity, of ``request_id`` (its
    first position: a block's first slot)."""
    ((reasons, slot, requests),) = parse_violations(lines)
    assert reasons == ["verify_identity"] and [r.rsplit("-", 1)[0] for r in requests] == [request_id]  # vLLM's id and a suffix
    assert slot % BLOCK_SIZE == 0
    return slot


def test_an_adapter_reloaded_in_place_is_named_and_repaired(engine, folders, tmp_path, monkeypatch):
    llm, lines, _ = engine
    reported = Reported(monkeypatch, _worker_connector())
    lora, prompt, _, clean = _reloaded_in_place(llm, folders, tmp_path, "r", 3)
    assert lines.take() == [] and reported.take() == set()
    (after,) = _run(llm, [prompt], lora)
    assert after.num_cached_tokens == 2 * BLOCK_SIZE  # vLLM served the old weights' blocks
    slot = _identity_line(lines.take(), after.request_id)
    assert reported.take() == {slot // BLOCK_SIZE}  # the block of the reader's first position
    assert _answer(after) == clean  # recomputed under the new weights
    (again,) = _run(llm, [prompt], lora)  # the recomputed blocks are the new weights': shared silently
    assert again.num_cached_tokens == 2 * BLOCK_SIZE and _answer(again) == clean
    assert lines.take() == [] and reported.take() == set()


def test_without_a_policy_that_acts_the_reloaded_adapter_answers_with_the_old_blocks(engine, folders, tmp_path, monkeypatch):
    # What vLLM 0.32 does by itself: the hit on the old weights' blocks answers as x did.
    llm, lines, _ = engine
    monkeypatch.setattr(plugin.active(), "policy", "log")
    lora, prompt, stale, clean = _reloaded_in_place(llm, folders, tmp_path, "s", 4)
    (after,) = _run(llm, [prompt], lora)
    assert after.num_cached_tokens == 2 * BLOCK_SIZE
    assert _answer(after) not in (stale, clean)  # the old weights' KV of the prompt, the new weights' of the rest
    _identity_line(lines.take(), after.request_id)


def test_one_identity_shares_its_blocks_silently_beside_others(engine, folders):
    # x twice, no adapter, a salt, x unloaded and loaded again (the same weights): each
    # second request hits its first one's blocks, silently; no request reads another's.
    llm, lines, _ = engine
    x = LoRARequest("x", 1, str(folders["x"]))
    rng = random.Random(7)
    prompt = {"prompt_token_ids": random_tokens(rng, PROMPT_LENGTH)}
    salted = {**prompt, "cache_salt": "tenant-a"}
    roots = plugin.active().request_roots
    rooted = roots.rooted
    first = _run(llm, [prompt, salted, prompt], [x, None, None])
    assert [o.num_cached_tokens for o in first] == [0, 0, 0]
    assert roots.rooted - rooted == 2  # x's and the salted request's: the worker saw the salt
    second = _run(llm, [prompt, salted, prompt], [x, None, None])
    assert [o.num_cached_tokens for o in second] == [2 * BLOCK_SIZE] * 3
    assert [_answer(o) for o in second] == [_answer(o) for o in first]
    assert _answer(first[0]) != _answer(first[2])  # x's KV differs from the base model's
    assert llm.llm_engine.remove_lora(1)
    (reloaded,) = _run(llm, [prompt], x)
    assert reloaded.num_cached_tokens == 2 * BLOCK_SIZE and _answer(reloaded) == _answer(first[0])
    assert lines.take() == []


def test_the_same_files_loaded_again_under_another_int_id_share_their_blocks_silently(engine, folders, monkeypatch):
    # vLLM numbers adapters per server (a P and a D that loaded adapters in another order
    # number them apart): an adapter unloaded and loaded again from the same files under a
    # new int id is the same identity, and its earlier blocks serve it without a line.
    llm, lines, _ = engine
    reported = Reported(monkeypatch, _worker_connector())
    prompt = {"prompt_token_ids": random_tokens(random.Random(11), PROMPT_LENGTH)}
    (before,) = _run(llm, [prompt], LoRARequest("u", 11, str(folders["x"])))
    assert llm.llm_engine.remove_lora(11)
    (after,) = _run(llm, [prompt], LoRARequest("u", 12, str(folders["x"])))
    assert after.num_cached_tokens == 2 * BLOCK_SIZE  # vLLM keys the blocks on the adapter's name and path
    assert _answer(after) == _answer(before)
    assert lines.take() == [] and reported.take() == set()


def test_each_request_is_rooted_once_and_forgotten_once_finished(engine):
    llm, lines, _ = engine
    roots = plugin.active().request_roots
    prompts = [{"prompt_token_ids": random_tokens(random.Random(seed), 40)} for seed in range(3)]
    derived = roots.derived
    first = _run(llm, prompts)
    assert roots.derived - derived == 3  # once per request, over its 8 steps of decoding
    _run(llm, prompts[:1])  # its steps tell the worker the first three finished
    assert not {o.request_id for o in first} & roots.held()
    assert roots.derived - derived == 4 and lines.take() == []


def test_a_reload_while_the_old_weights_requests_run_leaves_their_blocks_to_them(engine, folders, tmp_path, monkeypatch):
    # vLLM recomputes a shared block in place for all its holders: a new request hitting
    # blocks a running request of the old weights holds is named and goes on as vLLM serves
    # it, and both finish (reporting the block would roll both back at every step). Once
    # the old request is gone, the next reader's hit is reported and recomputed.
    llm, lines, _ = engine
    reported = Reported(monkeypatch, _worker_connector())
    folder = tmp_path / "t"
    shutil.copytree(folders["x"], folder)
    lora = LoRARequest("t", 6, str(folder))
    prompt = {"prompt_token_ids": random_tokens(random.Random(6), PROMPT_LENGTH)}
    (clean,) = _run(llm, [prompt], LoRARequest("y", 2, str(folders["y"])))
    engine_ = llm.llm_engine
    engine_.add_request("old", prompt, _greedy(40), lora_request=lora)
    for _ in range(4):
        engine_.step()
    shutil.copy(folders["y"] / WEIGHTS, folder / WEIGHTS)
    assert engine_.add_lora(LoRARequest("t", 6, str(folder), load_inplace=True))
    engine_.add_request("new", prompt, _greedy(8), lora_request=lora)
    finished = {}
    for _ in range(120):
        finished.update({o.request_id: len(_answer(o)) for o in engine_.step() if o.finished})
        if len(finished) == 2:
            break
    assert finished == {"old": 40, "new": 8}
    assert reported.take() == set()
    slot = _identity_line(lines.take(), "new")
    (after,) = _run(llm, [prompt], lora)
    assert after.num_cached_tokens == 2 * BLOCK_SIZE and _answer(after) == _answer(clean)
    assert reported.take() == {slot // BLOCK_SIZE}
    assert lines.take() == []  # the slot's line came at its first detection


def test_under_quarantine_the_reader_of_the_old_blocks_fails_alone(tiny_llama, folders, tmp_path):
    with connector_engine(tiny_llama, "quarantine", **LORA) as (llm, lines, _):
        lora, prompt, _, _ = _reloaded_in_place(llm, folders, tmp_path, "q", 5)
        other = {"prompt_token_ids": random_tokens(random.Random(50), PROMPT_LENGTH)}
        after, beside = _run(llm, [prompt, other], [lora, LoRARequest("y", 2, str(folders["y"]))])
        assert after.outputs[0].finish_reason == "error"
        assert beside.outputs[0].finish_reason == "length" and len(_answer(beside)) == 8
        _identity_line(lines.take(), after.request_id)


def test_the_cache_salt_reaches_a_worker_through_the_executors_pickling(engine):
    # The scheduler's NewRequestData carries the salt (the engine's plugin patched it); the
    # multiprocess executor hands the scheduler output to its workers pickled.
    import pickle

    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.request import Request

    from torch_kvcanary.integrations.vllm.adapter.identity import IdentityNotes

    requests = [Request(f"r{i}", [5, 6, 7], vllm.SamplingParams(), None, cache_salt=salt) for i, salt in enumerate(("tenant-a", None))]
    sent = SimpleNamespace(scheduled_new_reqs=[NewRequestData.from_request(r, ([1],)) for r in requests], finished_req_ids=set())
    notes = IdentityNotes()
    notes.note(pickle.loads(pickle.dumps(sent)))
    assert (notes.salts, notes.uncarried) == ({"r0": "tenant-a"}, 0)
    assert notes.take_salt("r0") == "tenant-a" and notes.take_salt("r0") is None  # taken once
