"""The identity of docs/spec.md section 8 against its chain vectors
(tests/data/chain_vectors.json): the spec transcription regenerates the file byte for byte,
torch_kvcanary.identity gives its words and roots, KvCanary on the CPU writes its records and
gives its verify rows, the plugin's `RequestRoots` roots vLLM's requests as the file does, and
the file says what the spec says of them (no identity is the anchor, a reload is another
root, an adapter's per-server int id is no part of it, a prefix before an item stays shared)."""

import ast
import base64
import copy
import inspect
import json

import chain_golden
import pytest
import spec_oracle
import torch
from chain_golden import CHAIN_PATH, load_chains, pinned_tensor, regenerate, weights_tensors

from torch_kvcanary import KvCanary, identity, view_source
from torch_kvcanary.integrations.vllm.adapter import RequestIdentity
from torch_kvcanary.integrations.vllm.request_roots import RequestRoots

ANCHOR = 0xDE7FAE23A9A1B716 - (1 << 64)


@pytest.fixture(scope="module")
def chains() -> dict:
    return load_chains()


def _by_name(entries: list[dict]) -> dict[str, dict]:
    return {e["name"]: e for e in entries}


def test_regeneration_gives_the_pinned_file():
    pinned = CHAIN_PATH.read_text()
    assert regenerate(pinned) == pinned


def test_expected_values_follow_the_inputs(chains):
    """One byte of adapter x's weights changed changes the roots built on x and the records
    rooted there, and nothing else: the expected values are computed, not copied."""
    document = copy.deepcopy(chains)
    tensor = document["weights"][0]["tensors"][0]
    raw = bytearray(base64.b64decode(tensor["data_b64"]))
    raw[3] ^= 0x01
    tensor["data_b64"] = base64.b64encode(bytes(raw)).decode()
    changed = json.loads(regenerate(json.dumps(document)))
    old_roots, new_roots = _by_name(chains["roots"]), _by_name(changed["roots"])
    assert {n for n in old_roots if old_roots[n]["root"] != new_roots[n]["root"]} == {"lora_x", "lora_x_salt_a", "lora_x_weights_named_z"}
    old_chains, new_chains = _by_name(chains["chains"]), _by_name(changed["chains"])
    differ = {n for n in old_chains if old_chains[n]["records"] != new_chains[n]["records"]}
    assert differ == {"rooted_prefill_then_decode", "two_roots_one_call"}


def test_texts_and_weights_words(chains):
    texts = {t["text"]: t["word"] for t in chains["texts"]}
    assert [identity.text_word(t) for t in texts] == list(texts.values())
    assert len(set(texts.values())) == len(texts)  # "a", "a\0" and "a\0\0" are three words
    # A lone surrogate, which strict UTF-8 refuses, has a word (a client's cache salt may hold
    # one). A surrogate pair in a str is two code points, not the character it would encode
    # (JSON cannot pin the pair apart from the character: the oracle is asked here).
    lone = [t for t in texts if any(0xD800 <= ord(c) <= 0xDFFF for c in t)]
    assert len(lone) == 2
    for text in lone:
        with pytest.raises(UnicodeEncodeError):
            text.encode("utf-8")
    pair, character = "\ud83d\ude00", "\U0001f600"
    assert identity.text_word(pair) == spec_oracle.text_word(pair) != identity.text_word(character) == spec_oracle.text_word(character)
    for entry in chains["weights"]:
        tensors = weights_tensors(entry)
        assert identity.lora_weights_word(tensors) == entry["word"]
        # The order of the mapping and the tensors' layouts do not count; their bytes do.
        reordered = {name: tensors[name].t().contiguous().t() for name in reversed(list(tensors))}
        assert identity.lora_weights_word(reordered) == entry["word"]


def test_roots(chains):
    words = {w["name"]: identity.lora_weights_word(weights_tensors(w)) for w in chains["weights"]}
    for entry in chains["roots"]:
        lora = entry["lora"]
        lora = None if lora is None else identity.LoraIdentity(lora["name"], words[lora["weights"]])
        assert identity.request_root(lora=lora, cache_salt=entry["cache_salt"]) == entry["root"], entry["name"]
    roots = {e["name"]: e["root"] for e in chains["roots"]}
    assert roots["none"] == roots["empty_salt"] == identity.ANCHOR == ANCHOR
    assert roots["lora_x_reloaded"] != roots["lora_x"] != roots["lora_x_weights_named_z"]  # the weights count, and the name
    assert len(set(roots.values())) == len(roots) - 1  # every identity its own root, but the empty salt


class _Runner:
    """What `RequestRoots` reads of a runner: each request's `RequestIdentity`, and the
    weights of the adapters its LoRA manager holds, by vLLM's int id."""

    uncarried_salts = 0

    def __init__(self, held: dict[int, dict[str, torch.Tensor]], requests: dict[str, RequestIdentity]):
        self.held, self.requests = held, requests

    def watch_lora_loads(self, loaded) -> bool:
        for lora_id, weights in self.held.items():
            loaded(lora_id, weights)
        return True

    def take_finished(self) -> set[str]:
        return set()

    def request_identity(self, request_id: str) -> RequestIdentity:
        return self.requests[request_id]

    def held_adapter_weights(self, lora_id: int) -> dict[str, torch.Tensor] | None:
        return self.held.get(lora_id)


def test_the_plugins_roots_hold_an_adapters_name_and_weights_not_its_int_id(chains):
    # vLLM numbers adapters per server: adapter-x as id 1 on one server and id 7 on another
    # (or unloaded and loaded again) has the file's one root; its weights under another name,
    # or other weights under its name, have theirs.
    weights = {w["name"]: weights_tensors(w) for w in chains["weights"]}
    held = {1: weights["x"], 7: weights["x"], 8: weights["x"], 9: weights["x_reloaded"]}
    requests = {
        "x as 1": RequestIdentity(1, "adapter-x"),
        "x as 7": RequestIdentity(7, "adapter-x"),
        "x as 7, salted": RequestIdentity(7, "adapter-x", "tenant-a"),
        "x's weights as z": RequestIdentity(8, "adapter-z"),
        "x reloaded": RequestIdentity(9, "adapter-x"),
        "none": RequestIdentity(),
    }
    roots = RequestRoots(_Runner(held, requests))
    pinned = {e["name"]: e["root"] for e in chains["roots"]}
    assert {r: roots.root(r) for r in requests} == {
        "x as 1": pinned["lora_x"],
        "x as 7": pinned["lora_x"],
        "x as 7, salted": pinned["lora_x_salt_a"],
        "x's weights as z": pinned["lora_x_weights_named_z"],
        "x reloaded": pinned["lora_x_reloaded"],
        "none": pinned["none"],
    }


def test_item_and_embedding_words(chains):
    for entry in chains["items"]:
        item = identity.multimodal_item_word(entry["mm_hash"])
        assert item == entry["item"]
        assert [identity.item_word(item, k) for k in range(len(entry["words"]))] == entry["words"]
    for entry in chains["embeddings"]:
        row = pinned_tensor(entry)
        assert identity.embedding_word(row) == entry["word"]
        assert identity.embedding_word(torch.stack([row, row])[1]) == entry["word"]
    words = [w for e in chains["items"] for w in e["words"]] + [e["word"] for e in chains["embeddings"]]
    assert all(0 <= w < 1 << 63 for w in words)


def test_what_the_vectors_show(chains):
    """Without identity the records are the anchor's; a text prefix before an item chains
    as without it; a reader under another root is told at the first position alone."""
    records = {c["name"]: c["records"] for c in chains["chains"]}
    assert records["unrooted"] == records["anchor_root"]
    with_item, text_only = records["mixed_item"], records["mixed_text_only"]
    assert [r[3] for r in with_item[:4]] == [r[3] for r in text_only[:4]]  # the item starts at position 3
    assert all(a[3] != b[3] for a, b in zip(with_item[4:], text_only[4:]))
    checks = _by_name(chains["verify"])
    assert [row[7] for row in checks["other_root_at_first_position"]["rows"]] == [256]
    roots = {e["name"]: e["root"] for e in chains["roots"]}
    assert checks["other_root_at_first_position"]["rows"][0][6] == roots["lora_x_reloaded"]
    assert checks["same_root_silent"]["rows"] == []


class _Pinned:
    """The file's inputs resolved with the file's own values (its roots and words)."""

    def __init__(self, chains: dict):
        self.roots = {e["name"]: e["root"] for e in chains["roots"]}
        self.items = [e["words"] for e in chains["items"]]
        self.embeddings = [e["word"] for e in chains["embeddings"]]

    def token(self, spec) -> int:
        if isinstance(spec, int):
            return spec
        return self.items[spec["item"]][spec["offset"]] if "item" in spec else self.embeddings[spec["embedding"]]

    def inputs(self, call: dict) -> dict:
        values = {key: call.get(key) for key in ("positions", "prev_slots")}
        values["tokens"] = None if call.get("tokens") is None else [self.token(t) for t in call["tokens"]]
        values["roots"] = None if call.get("roots") is None else [self.roots[name] for name in call["roots"]]
        return {key: None if v is None else torch.tensor(v, dtype=torch.int64) for key, v in values.items()}


def _replayed(chains: dict, case: dict) -> KvCanary:
    """A canary on the CPU after the case's record calls (its KV bytes never change, so
    every fold verify compares is equal, as the file's folds are)."""
    canary = KvCanary(view_source(torch.zeros(case["capacity"], 1, 16, dtype=torch.uint8), read_bytes=16), on_violation=None)
    pinned = _Pinned(chains)
    for call in case["calls"]:
        canary.record(torch.tensor(call["slots"]), **pinned.inputs(call))
    return canary


def test_kv_canary_writes_the_chains(chains):
    for case in chains["chains"]:
        records = _replayed(chains, case).records
        assert [[s, *records[s, :3].tolist()] for s, *_ in case["records"]] == case["records"], case["name"]


def _verify(canary: KvCanary, slots: torch.Tensor, inputs: dict) -> torch.Tensor:
    """KvCanary.verify of a check; the op itself where the check gives roots without
    prev_slots, which the op takes (unused: no chain is checked) and KvCanary.verify refuses."""
    if inputs["roots"] is None or inputs["prev_slots"] is not None:
        return canary.verify(slots, **inputs)
    with pytest.raises(ValueError, match="^kv-canary: verify was given roots but no prev_slots"):
        canary.verify(slots, **inputs)
    tables = (canary._records, canary._owner_tags, canary._counters, canary._ring)
    return torch.ops.kvcanary.verify.bound(
        canary._bound.table, slots, inputs["positions"], inputs["tokens"], None, None, *tables, -1, True, inputs["roots"]
    )


def test_kv_canary_gives_the_verify_rows(chains):
    for case in chains["verify"]:
        canary = _replayed(chains, case)
        flags = _verify(canary, torch.tensor(case["check"]["slots"]), _Pinned(chains).inputs(case["check"]))
        rows = [
            [v.kind, v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain, v.expected_aux, v.reasons] for v in canary.poll()
        ]
        assert (flags.tolist(), rows) == (case["flags"], case["rows"]), case["name"]


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: identity.request_root(cache_salt=b"salt"), TypeError),
        (lambda: identity.request_root(lora=("x", 2)), TypeError),
        (lambda: identity.item_word(1, -1), ValueError),
        (lambda: identity.item_word(1 << 63, 0), ValueError),
        (lambda: identity.lora_weights_word([torch.zeros(2)]), TypeError),
        (lambda: identity.lora_weights_word({"w": [0.0]}), TypeError),
    ],
)
def test_bad_input_is_refused(call, error):
    with pytest.raises(error, match="^kv-canary: "):
        call()


def test_the_transcription_does_not_import_the_package():
    for module in (chain_golden, spec_oracle):
        tree = ast.parse(inspect.getsource(module))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {name for name in imported if name and name.split(".")[0] == "torch_kvcanary"}
