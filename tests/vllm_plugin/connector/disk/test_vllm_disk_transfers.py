"""The canary's KV connector over vLLM's ExampleConnector (`connector.disk.DiskVerifier`) on the
real engine (vLLM's CPU build), in-process: a transfer through the disk verified, with each
fault of the stored files found; a transfer from a producer engine to a consumer engine; and
ExampleConnector in the canary's place refused where it loads KV.
The engines serve a tiny random Llama in float32, as the connector's other tests.
"""

import json
import random

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from connector_driver import Reported, _greedy, _metric, _worker_connector, connector_engine, refused_start  # noqa: E402
from engine_driver import BLOCK_SIZE, ENGINES, parse_violations, random_tokens  # noqa: E402

from torch_kvcanary.integrations.vllm import config, connector  # noqa: E402

# Verified transfers -----------------------------------------------------------------------


def _layer_files(folder) -> list:
    return sorted(path for path in folder.iterdir() if path.name != connector.DiskVerifier.SIDECAR)


def _rewrite(path, change) -> None:
    """Rewrites a stored layer file (``{"kv_cache": [tokens, heads, C]}``) with ``change`` applied to its tensor."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({"kv_cache": change(tensors["kv_cache"]).contiguous()}, str(path))


def _flip_stored(kv: torch.Tensor) -> torch.Tensor:
    kv = kv.clone()
    kv.view(torch.int32)[40, 1, 77] ^= 1 << 30  # token 40, in the second block
    return kv


def _swap_blocks(kv: torch.Tensor) -> torch.Tensor:
    return torch.cat([kv[BLOCK_SIZE : 2 * BLOCK_SIZE], kv[:BLOCK_SIZE], kv[2 * BLOCK_SIZE :]])


FAULTS = ["none", "flipped byte", "swapped blocks", "another request's file", "truncated file", "no records"]


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """The folder ExampleConnector saves to, that of `disk_engine`."""
    return tmp_path_factory.mktemp("kv")


@pytest.fixture
def disk_engine(tiny_llama, storage):
    """The engine of the verified transfers under repair (`ENGINES`), with ExampleConnector
    inside saving to ``storage``. Each test prompts with tokens of its own (ExampleConnector
    names a prompt's folder by its tokens) and resets the prefix cache."""
    inner = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    transfer = {
        "kv_connector": config.CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {connector.INNER: inner},
    }
    return ENGINES.get(
        ("disk", tiny_llama, json.dumps(transfer)), lambda: connector_engine(tiny_llama, "repair", kv_transfer_config=transfer)
    )


def _saved(storage, llm, prompt, max_tokens: int):
    """The answer to ``prompt``, and the folder ExampleConnector saved its blocks to."""
    before = set(storage.iterdir())
    (answer,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens), use_tqdm=False)
    (folder,) = set(storage.iterdir()) - before
    return answer, folder


@pytest.mark.parametrize("fault", FAULTS)
def test_a_transfer_through_example_connector_is_verified(disk_engine, storage, monkeypatch, fault):
    # The producer saves a prompt's first two blocks to disk (vLLM's ExampleConnector), and
    # the canary's records beside them; the consumer (the same engine, its prefix cache
    # reset) loads them for the same prompt, and verifies what landed before the forward.
    llm, lines, _ = disk_engine
    rng = random.Random(20 + FAULTS.index(fault))
    prompt, other = random_tokens(rng, 2 * BLOCK_SIZE + 10), random_tokens(rng, 2 * BLOCK_SIZE + 10)
    ours = _worker_connector()
    assert type(ours.inner).__name__ == "ExampleConnector"
    clean, folder = _saved(storage, llm, prompt, 24)
    _, other_folder = _saved(storage, llm, other, 1)
    assert len(_layer_files(folder)) == 2 and (folder / connector.DiskVerifier.SIDECAR).exists()
    llm.reset_prefix_cache()
    if fault == "flipped byte":
        _rewrite(_layer_files(folder)[1], _flip_stored)
    elif fault == "swapped blocks":
        _rewrite(_layer_files(folder)[0], _swap_blocks)
    elif fault == "another request's file":
        for mine, theirs in zip(_layer_files(folder), _layer_files(other_folder)):
            mine.write_bytes(theirs.read_bytes())
    elif fault == "truncated file":
        path = _layer_files(folder)[1]
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif fault == "no records":
        (folder / connector.DiskVerifier.SIDECAR).unlink()
    reported = Reported(monkeypatch, ours)
    verified, failed = _metric("vllm:kv_canary_transfer_slots_verified_total"), _metric("vllm:kv_canary_transfer_slots_failed_total")
    (loaded,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(24), use_tqdm=False)
    assert loaded.num_cached_tokens == 2 * BLOCK_SIZE  # both blocks came from disk
    assert loaded.outputs[0].token_ids == clean.outputs[0].token_ids
    assert _metric("vllm:kv_canary_transfer_slots_verified_total") - verified == 2 * BLOCK_SIZE
    failed = _metric("vllm:kv_canary_transfer_slots_failed_total") - failed
    blocks = reported.take()
    if fault == "none":
        assert failed == 0 and blocks == set() and lines.take() == []
    else:
        assert failed > 0 and blocks, "the fault in what was stored was not reported as a load error"
        # One slot's bytes (a row of its block), or every slot of both blocks.
        assert failed == (1 if fault == "flipped byte" else 2 * BLOCK_SIZE)
        said = lines.take()
        if fault == "truncated file":  # the inner connector's load raised: logged, with its traceback
            assert said[0] == "kv-canary: ExampleConnector failed to load KV; its blocks are reported as load errors"
            said = said[1:]
        assert said and all(reasons == ["verify_real_kv_hash"] for reasons, _, _ in parse_violations(said))
    llm.reset_prefix_cache()


def test_a_connector_in_the_canarys_place_that_loads_kv_is_refused_at_start(tiny_llama, tmp_path):
    # ExampleConnector configured on its own: as a producer it only saves, and serves beside
    # the canary; as a consumer it would write loaded slots the canary holds no records of.
    storage = tmp_path / "kv"
    storage.mkdir()
    extra = {"shared_storage_path": str(storage)}
    producer = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    prompt = random_tokens(random.Random(22), 2 * BLOCK_SIZE + 10)
    with connector_engine(tiny_llama, "log", kv_transfer_config=producer) as (llm, lines, _):
        llm.generate([{"prompt_token_ids": prompt}], _greedy(8), use_tqdm=False)
        assert lines.take() == []
    assert any(storage.iterdir())  # it saved
    both = {**producer, "kv_role": "kv_both"}
    error = refused_start(tiny_llama, "log", kv_transfer_config=both)
    wrapped = {"kv_connector": config.CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {connector.INNER: both}}
    assert str(error) == (
        'kv-canary: vLLM\'s KV connector ExampleConnector with "kv_role": "kv_both" loads KV into the cache outside the '
        "model's forward, into slots the canary holds no records of, which it would report as corrupt: serve it as "
        f"KvCanaryConnector's inner connector, which verifies what it loads (--kv-transfer-config '{json.dumps(wrapped)}'), "
        "or unset KVCANARY_VLLM to serve it without the canary"
    )


def test_a_transfer_from_a_producer_engine_to_a_consumer_engine(tiny_llama, tmp_path, monkeypatch):
    # Two engines one after the other over one storage folder: the producer only saves, the
    # consumer only loads, and a byte of the stored blocks is flipped in between.
    storage = tmp_path / "kv"
    storage.mkdir()

    def transfer(role: str) -> dict:
        inner = {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        return {
            "kv_connector": config.CONNECTOR,
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"inner": inner},
        }

    prompt = random_tokens(random.Random(21), 2 * BLOCK_SIZE + 10)
    with connector_engine(tiny_llama, "repair", kv_transfer_config=transfer("kv_producer")) as (llm, lines, _):
        (produced,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(24), use_tqdm=False)
        assert lines.take() == []
    (folder,) = storage.iterdir()
    _rewrite(_layer_files(folder)[0], _flip_stored)
    with connector_engine(tiny_llama, "repair", kv_transfer_config=transfer("kv_consumer")) as (llm, lines, _):
        reported = Reported(monkeypatch, _worker_connector())
        failed = _metric("vllm:kv_canary_transfer_slots_failed_total")
        (consumed,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(24), use_tqdm=False)
        assert consumed.num_cached_tokens == 2 * BLOCK_SIZE
        assert _metric("vllm:kv_canary_transfer_slots_failed_total") - failed == 1
        assert len(reported.take()) == 1  # the block of the flipped token, recomputed
        assert consumed.outputs[0].token_ids == produced.outputs[0].token_ids
        assert [reasons for reasons, _, _ in parse_violations(lines.take())] == [["verify_real_kv_hash"]]
